"""The driver stage's steps that run on the box (verl_lab_box/nvidia_driver.py) and its execute-time
settle/reboot step (tasks/driver.py), with the box's commands answered by recorded outputs
(tests/fixtures/driver/: apt 2.6.1's --simulate on a Debian 12 lab box; the DriverState cases).

What this proves is plumbing: which commands run in which order, what stops before anything is
installed, what the pin file says, which verdict reboots and when it may not. The module loading
and the reboot onto a new driver cannot run in the lab (tests/e2e/test_driver.py says why)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks import driver_settle as stage
from verl_lab_box import nvidia_driver as box

FIX = Path(__file__).resolve().parents[1] / "fixtures"
SIMULATE = (FIX / "driver" / "apt-simulate-bookworm.txt").read_text()
NO_HEADERS = (FIX / "driver" / "apt-simulate-no-headers.txt").read_text()
STATES = FIX / "facts" / "driver.DriverState"


def recorded(name: str) -> str:
    return "\n".join(json.loads((STATES / f"{name}.json").read_text())["output"]) + "\n"


def test_simulate_parsing_and_the_branch_check_on_real_apt_output():
    would = box.simulated(SIMULATE)
    assert len(would) == 110 and would["nvidia-driver"] == "535.261.03-1" and would["libcuda1"] == "535.261.03-1"
    assert would["nvidia-modprobe"] == "535.161.07-1~deb12u1"          # another source, same branch
    assert box.foreign_branch(would, 535) == []                          # libllvm15 1:15.0.6 etc. are not drivers
    assert "nvidia-driver 535.261.03-1" in box.foreign_branch(would, 580)
    # composed in Ubuntu's format: a retired branch's name that now brings the next branch
    transitional = box.simulated("Inst nvidia-headless-570-server (580.95.05-0ubuntu0.24.04.2 Ubuntu:24.04/noble-updates"
                                 " [amd64])\nInst nvidia-dkms-580-server (580.95.05-0ubuntu0.24.04.2 Ubuntu:24.04/noble-"
                                 "updates [amd64])\n")
    assert box.foreign_branch(transitional, 570) == ["nvidia-dkms-580-server 580.95.05-0ubuntu0.24.04.2",
                                                     "nvidia-headless-570-server 580.95.05-0ubuntu0.24.04.2"]


def test_versions():
    assert box.upstream("535.261.03-1") == "535.261.03"
    assert box.upstream("535.309.01-0+deb12u1") == "535.309.01"
    assert box.upstream("580.173.02-0ubuntu0.24.04.1") == "580.173.02"
    assert box.branch_of("1:15.0.6-4+b1") == 15 and box.branch_of(None) is None


def test_pin_text_reads_back():
    plan = {"branch": 535, "source": "nvidia-graphics-drivers", "chosen_for": "Tesla P40 (6.1)"}
    text = box.pin_text(["libcuda1", "nvidia-driver"], "535.261.03-1", plan)
    assert box.parse_pin(text) == {"packages": ["libcuda1", "nvidia-driver"], "version": "535.261.03-1"}
    assert text.endswith("Package: libcuda1 nvidia-driver\nPin: version 535.261.03-1\nPin-Priority: 1001\n")
    assert box.parse_pin("") is None


class FakeBox:
    """subprocess.run as the box answers it: the fact command, apt, dpkg, nvidia-smi."""

    def __init__(self, state_text: str, simulate: tuple[int, str] = (0, SIMULATE), smi: tuple[int, str] = (0, "")):
        self.state_text, self.simulate, self.smi = state_text, simulate, smi
        self.calls: list[list[str]] = []

    def __call__(self, argv, capture_output=True, text=True, env=None, **kw):
        self.calls.append(list(argv))
        out, rc = "", 0
        if argv[:2] == ["sh", "-c"] and "verl-lab-driver" in argv[2]:
            out = self.state_text
        elif argv[:2] == ["sh", "-c"]:
            rc = 1                                   # command -v update-initramfs: not in a lab box
        elif "--simulate" in argv:
            rc, out = self.simulate
        elif argv[0] == "nvidia-smi":
            rc, out = self.smi
        return subprocess.CompletedProcess(argv, rc, out, "")


@pytest.fixture
def plan(tmp_path):
    return {"branch": 535, "packages": ["nvidia-driver", "nvidia-smi", "libcuda1"], "module_package": "nvidia-kernel-dkms",
            "source": "nvidia-graphics-drivers", "headers": ["linux-headers-6.1.0-26-amd64", "linux-headers-amd64"],
            "distro": "Debian 12 (bookworm)", "pin": str(tmp_path / "pin"), "log": str(tmp_path / "logs" / "driver.log"),
            "unit": "verl-lab-train.service", "chosen_for": "Tesla P40 (6.1) (read by nvidia-smi)", "reason": "R535"}


def run_main(monkeypatch, tmp_path, plan, fake, command):
    monkeypatch.setattr(box.subprocess, "run", fake)
    path = tmp_path / "driver-plan.json"
    path.write_text(json.dumps(plan))
    return box.main([command, "--plan", str(path)])


def test_install_resolves_then_installs_then_holds_and_pins(monkeypatch, tmp_path, plan):
    fake = FakeBox(recorded("debian12_held_no_module"))
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 0
    apt = [c for c in fake.calls if c[0] in ("apt-get", "apt-mark")]
    assert apt[0] == ["apt-get", "update"]
    assert apt[1][:3] == ["apt-get", "install", "--no-install-recommends"] and "--simulate" in apt[1]
    assert apt[1][-5:] == ["nvidia-driver", "nvidia-smi", "libcuda1", "linux-headers-6.1.0-26-amd64", "linux-headers-amd64"]
    assert apt[2][:3] == ["apt-get", "-y", "install"] and "--simulate" not in apt[2] and apt[2][-5:] == apt[1][-5:]
    assert apt[3][:2] == ["apt-mark", "hold"] and {"nvidia-driver", "libcuda1", "nvidia-kernel-dkms"} <= set(apt[3])
    pin = Path(plan["pin"])
    assert box.parse_pin(pin.read_text()) == {"packages": apt[3][2:], "version": "535.261.03-1"}
    assert oct(pin.stat().st_mode & 0o777) == "0o644"
    assert "+ apt-get update" in Path(plan["log"]).read_text()


def test_install_stops_before_installing_when_apt_cannot_resolve(monkeypatch, tmp_path, plan, capsys):
    fake = FakeBox(recorded("debian12_fresh"), simulate=(100, NO_HEADERS))
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 1
    assert not [c for c in fake.calls if c[:2] == ["apt-get", "-y"] or c[:1] == ["apt-mark"]]
    err = capsys.readouterr().err
    assert "E: Unable to locate package linux-headers-6.18.44-fc-v1272" in err and "nothing was installed" in err
    assert not Path(plan["pin"]).exists()


def test_install_refuses_a_name_that_brings_another_branch(monkeypatch, tmp_path, plan, capsys):
    fake = FakeBox(recorded("debian12_fresh"), simulate=(0, SIMULATE))
    assert run_main(monkeypatch, tmp_path, dict(plan, branch=580), fake, "install") == 1
    assert not [c for c in fake.calls if c[:2] == ["apt-get", "-y"]]
    assert "would install another branch: " in capsys.readouterr().err


def test_install_releases_its_own_previous_hold_first(monkeypatch, tmp_path, plan):
    Path(plan["pin"]).write_text(box.pin_text(["nvidia-driver"], "535.216.03-1", plan))
    fake = FakeBox(recorded("debian12_held_no_module"))
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 0
    assert fake.calls[0] == ["apt-mark", "unhold", "nvidia-driver"]


def loaded_state(version: str) -> str:
    text = recorded("debian12_held_no_module")
    text = text.replace(box.SECTION + "loaded\n",
                        box.SECTION + f"loaded\nNVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Tue Nov  4 "
                        "00:00:00 UTC 2025\n")
    return text.replace(box.SECTION + "built\n", box.SECTION + f"built\nnvidia-current {version}\n")


def test_prove_prints_the_version_only_when_proc_and_nvidia_smi_agree(monkeypatch, tmp_path, plan, capsys):
    good = FakeBox(loaded_state("535.261.03"), smi=(0, "0, Tesla P40, 535.261.03\n1, Tesla P40, 535.261.03\n"))
    assert run_main(monkeypatch, tmp_path, plan, good, "prove") == 0
    out = capsys.readouterr()
    assert out.out == "535.261.03\n" and "ok    nvidia-smi: 2 GPU(s), driver 535.261.03" in out.err
    stale = FakeBox(loaded_state("535.261.03"), smi=(0, "0, Tesla P40, 535.104.05\n"))
    assert run_main(monkeypatch, tmp_path, plan, stale, "prove") == 1
    assert capsys.readouterr().out == ""
    mismatch = FakeBox(loaded_state("535.261.03"), smi=(18, "Failed to initialize NVML: Driver/library version mismatch\n"))
    assert run_main(monkeypatch, tmp_path, plan, mismatch, "prove") == 1
    assert "Driver/library version mismatch" in capsys.readouterr().err
    unloaded = FakeBox(recorded("debian12_held_no_module"))
    assert run_main(monkeypatch, tmp_path, plan, unloaded, "prove") == 1
    assert "the driver is not loaded: no nvidia kernel module 535.261.03" in capsys.readouterr().err


# ---------------------------------------------------------------- settle: load, reboot, or stop


class FakeHost:
    """A pyinfra host for the settle step: answers the verdict, the unit, the reboot and its token."""

    name = "box1"

    def __init__(self, verdict: str, unit_active: bool = False, boots_after: int = 2):
        self.verdict, self.unit_active, self.boots_after = verdict, unit_active, boots_after
        self.commands, self.logged, self.connects, self.connected = [], [], 0, True
        self.token = False

    def run_shell_command(self, command):
        cmd = command.get_raw_value() if hasattr(command, "get_raw_value") else str(command)
        self.commands.append(cmd)
        ok, out = True, ""
        if " verdict " in cmd:
            out = json.dumps({"verdict": self.verdict, "installed": "535.261.03", "reason": f"because {self.verdict}"})
        elif cmd.startswith("systemctl is-active"):
            ok = self.unit_active
        elif cmd.startswith("touch "):
            self.token = True
        elif "test ! -e" in cmd:
            ok = not self.token
        return ok, SimpleNamespace(stdout=out, output=out)

    def log_styled(self, message, **kw):
        self.logged.append(message)

    def disconnect(self):
        self.connected = False

    def connect(self, show_errors=True):
        self.connects += 1
        self.connected = True
        if self.connects >= self.boots_after:
            self.token = False                       # /run is empty after the reboot


def settle(h, reboot=False):
    return stage._settle(None, h, "/usr/bin/python3", "/p/nvidia_driver.py", "/p/driver-plan.json", reboot,
                         "verl-lab-train.service", 60)


@pytest.fixture
def no_sleep(monkeypatch):
    import time
    monkeypatch.setattr(time, "sleep", lambda s: None)


def test_settle_loaded_does_nothing_and_load_runs_modprobe():
    h = FakeHost("loaded")
    assert settle(h) is True and len(h.commands) == 1
    h = FakeHost("load")
    assert settle(h) is True and h.commands[1].endswith("load --plan /p/driver-plan.json")


def test_settle_without_permission_says_reboot_needed_and_does_not_reboot():
    h = FakeHost("reboot")
    assert settle(h) is False
    assert "reboot needed" in h.logged[0] and "driver_reboot = True" in h.logged[0]
    assert not [c for c in h.commands if "systemctl reboot" in c]


def test_settle_never_reboots_a_box_that_trains(no_sleep):
    h = FakeHost("reboot", unit_active=True)
    assert settle(h, reboot=True) is False
    assert "verl-lab-train.service is active: not rebooting" in h.logged[0]
    assert not [c for c in h.commands if "systemctl reboot" in c]


def test_settle_reboots_and_waits_for_a_new_boot(no_sleep):
    h = FakeHost("reboot", boots_after=3)
    assert settle(h, reboot=True) is True
    reboot = [c for c in h.commands if "systemctl reboot" in c]
    assert reboot and reboot[0].startswith(f"touch {stage.REBOOT_TOKEN} && ( sleep 1 && systemctl reboot )")
    assert h.connects == 3 and h.connected                    # waited through two connects that were the old boot


def test_settle_stops_on_a_missing_module():
    h = FakeHost("no-module")
    assert settle(h, reboot=True) is False and "because no-module" in h.logged[0]


def test_settle_gives_up_when_the_box_does_not_come_back(no_sleep, monkeypatch):
    import time
    clock = iter(range(0, 10_000, 30))
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    h = FakeHost("reboot", boots_after=10**9)
    assert settle(h, reboot=True) is False and "did not come back within 60 s" in h.logged[-1]
