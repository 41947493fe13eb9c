"""The driver stage's steps that run on the box (verl_lab_box/nvidia_driver.py) and its execute-time
settle/reboot step (tasks/driver/settle.py), with the box's commands answered by recorded outputs
(tests/fixtures/driver/: apt 2.6.1's --simulate on a Debian 12 lab box; the DriverState cases).

What this proves is plumbing: which commands run in which order, what stops before anything is
installed, what the pin file says, which verdict reboots and when it may not. The module loading
and the reboot onto a new driver cannot run in the lab (tests/e2e/test_driver.py says why)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.driver import settle as stage
from verl_lab_box import nvidia_driver as box
from verl_lab_box import nvidia_driver_apt as apt
from verl_lab_box import nvidia_driver_state as st

REAL_RUN = subprocess.run

FIX = Path(__file__).resolve().parents[1] / "fixtures"
SIMULATE = (FIX / "driver" / "apt-simulate-bookworm.txt").read_text()
NO_HEADERS = (FIX / "driver" / "apt-simulate-no-headers.txt").read_text()
STATES = FIX / "facts" / "driver.DriverState"


def recorded(name: str) -> str:
    return "\n".join(json.loads((STATES / f"{name}.json").read_text())["output"]) + "\n"


def test_simulate_parsing_and_the_branch_check_on_real_apt_output():
    would = apt.simulated(SIMULATE)
    assert len(would) == 110 and would["nvidia-driver"] == "535.261.03-1" and would["libcuda1"] == "535.261.03-1"
    assert would["nvidia-modprobe"] == "535.161.07-1~deb12u1"          # another source, same branch
    assert apt.foreign_branch(would, 535) == []                          # libllvm15 1:15.0.6 etc. are not drivers
    assert "nvidia-driver 535.261.03-1" in apt.foreign_branch(would, 580)
    # composed in Ubuntu's format: a retired branch's name that now brings the next branch
    transitional = apt.simulated("Inst nvidia-headless-570-server (580.95.05-0ubuntu0.24.04.2 Ubuntu:24.04/noble-updates"
                                 " [amd64])\nInst nvidia-dkms-580-server (580.95.05-0ubuntu0.24.04.2 Ubuntu:24.04/noble-"
                                 "updates [amd64])\n")
    assert apt.foreign_branch(transitional, 570) == ["nvidia-dkms-580-server 580.95.05-0ubuntu0.24.04.2",
                                                     "nvidia-headless-570-server 580.95.05-0ubuntu0.24.04.2"]


def test_versions():
    assert st.upstream("535.261.03-1") == "535.261.03"
    assert st.upstream("535.309.01-0+deb12u1") == "535.309.01"
    assert st.upstream("580.173.02-0ubuntu0.24.04.1") == "580.173.02"
    assert st.branch_of("1:15.0.6-4+b1") == 15 and st.branch_of(None) is None


def test_pin_text_reads_back():
    plan = {"branch": 535, "source": "nvidia-graphics-drivers", "chosen_for": "Tesla P40 (6.1)"}
    text = box.hold.pin_text([(["libcuda1", "nvidia-driver"], "535.261.03-1")], plan)
    assert st.parse_pin(text) == {"packages": ["libcuda1", "nvidia-driver"], "version": "535.261.03-1",
                                  "stanzas": [{"packages": ["libcuda1", "nvidia-driver"], "version": "535.261.03-1"}],
                                  "theirs": []}
    # the holds that were not the stage's: a comment line apt ignores, read back
    kept = box.hold.pin_text([(["libcuda1", "nvidia-driver"], "535.261.03-1")], plan, ["nvidia-driver"])
    assert f"\n{st.THEIRS}nvidia-driver\nPackage: " in kept and st.parse_pin(kept)["theirs"] == ["nvidia-driver"]
    assert "set driver_update = True" in text and "re-run the driver stage to change" not in text
    assert text.endswith("Package: libcuda1 nvidia-driver\nPin: version 535.261.03-1\nPin-Priority: 1001\n")
    assert st.parse_pin("") is None


# the plan fixture's headers, installed (the recorded simulation was made with the kernel's headers in place)
HEADERS_INSTALLED = {"linux-headers-6.1.0-26-amd64": "6.1.112-1", "linux-headers-amd64": "6.1.112-1",
                     "linux-headers-6.8.0-45-generic": "6.8.0-45.45"}


class FakeBox:
    """subprocess.run as the box answers it: the fact command, apt, dpkg, systemctl, nvidia-smi.
    ``states``: the box before the install, and after it (one: the same); a failed install leaves
    the box as before unless ``changed_on_failure``. ``simulate``: apt's --simulate answers, one a
    call, the last repeated. ``units``: what ``systemctl show`` of the units prints (a list: one a
    call, the last repeated). ``versions``: what dpkg-query says is installed. ``rc``: exit
    statuses by command (``{"apt-mark hold": 1, "update-initramfs": 1, ...}``)."""

    def __init__(self, states, simulate=(0, SIMULATE), smi: tuple[int, str] = (0, ""), install_rc: int = 0,
                 download=None, versions: dict | None = None, units="", rc: dict | None = None,
                 changed_on_failure: bool = False, initramfs: bool = False, then=(), job: str = "inactive",
                 raises: dict | None = None):
        states = [states] if isinstance(states, str) else list(states)
        self.before, self.after = states[0], states[-1]
        self.simulate = list(simulate) if isinstance(simulate, list) else [simulate]
        self.units = list(units) if isinstance(units, list) else [units]
        self.smi, self.install_rc, self.download = smi, install_rc, download
        self.versions, self.rc = HEADERS_INSTALLED if versions is None else versions, rc or {}
        self.changed_on_failure, self.initramfs = changed_on_failure, initramfs
        self.installed = False
        self.then = list(then)             # [(word, state)]: after the first call holding word, reads see state
        self.now = None
        self.job, self.raises = job, raises or {}
        self.calls: list[list[str]] = []
        self.inputs: dict[str, str] = {}

    def _next(self, answers):
        return answers.pop(0) if len(answers) > 1 else answers[0]

    def __call__(self, argv, capture_output=True, text=True, env=None, cwd=None, input=None, **kw):
        self.calls.append(list(argv))
        out, rc = "", 0
        words = "apt-mark hold" if argv[0] == "apt-mark" and "hold" in argv else " ".join(argv[:2])
        for word, exc in self.raises.items():
            if word in argv:
                raise exc
        if argv[:2] == ["sh", "-c"] and "verl-lab-driver" in argv[2]:
            out = self.after if self.installed else (self.now or self.before)
        elif argv[:2] == ["sh", "-c"]:
            rc = 0 if self.initramfs else 1          # command -v update-initramfs: not in a lab box
        elif "--simulate" in argv:
            rc, out = self._next(self.simulate)
        elif argv[:3] == ["apt-get", "-y", "install"]:
            rc = self.install_rc
            self.installed = rc == 0 or self.changed_on_failure
        elif argv[:2] == ["systemctl", "show"] and any(a.startswith("-pId") for a in argv):
            out = self._next(self.units)
        elif argv[0] == "dpkg-query" and "-f=${Version}" in argv:      # from the state's packages, else versions
            now = st.parse_fact_output(self.after if self.installed else self.before)
            out = next((p["version"] for p in now["packages"] if p["name"] == argv[-1] and p["installed"]),
                       self.versions.get(argv[-1], ""))
            rc = 0 if out else 1
        elif argv[:2] == ["apt-get", "download"] and self.download:
            import shutil
            shutil.copy(self.download, cwd)          # the real package, from the tests' cache
        elif argv[:2] == ["dpkg-deb", "-x"]:
            return REAL_RUN(argv, capture_output=True, text=True)            # the real dpkg-deb
        elif argv[0] == "nvidia-smi":
            rc, out = self.smi
        elif argv[:2] == ["dpkg", "--set-selections"]:
            self.inputs["selections"] = input
        elif argv[:3] == ["systemctl", "show", "-p"] and argv[-1] == st.JOB_UNIT:
            out = self.job
        if self.then and self.then[0][0] in argv:
            self.now = self.then.pop(0)[1]
        rc = self.rc.get(words, self.rc.get(argv[0], rc))
        return subprocess.CompletedProcess(argv, rc, out, "")


@pytest.fixture
def plan(tmp_path, monkeypatch):
    from verl_lab_box import nvidia_driver_units as units
    monkeypatch.setattr(units, "MASK_DIR", str(tmp_path / "system.control"))     # never the machine's own /run
    monkeypatch.setattr(units, "RECORD", str(tmp_path / "masked"))
    return {"branch": 535, "packages": ["nvidia-driver", "nvidia-smi", "libcuda1"], "module_package": "nvidia-kernel-dkms",
            "source": "nvidia-graphics-drivers", "headers": ["linux-headers-6.1.0-26-amd64", "linux-headers-amd64"],
            "distro": "Debian 12 (bookworm)", "pin": str(tmp_path / "pin"), "log": str(tmp_path / "logs" / "driver.log"),
            "units": ["verl-lab-train.service", "verl-lab-ray.service"], "busy": "refuse",
            "job_status": str(tmp_path / "driver-job.json"),
            "supported_gpus": None, "gpus": [{"name": "Tesla P40", "device": "1b38"}],
            "chosen_for": "Tesla P40 (6.1) (read by nvidia-smi)", "reason": "R535"}


def run_main(monkeypatch, tmp_path, plan, fake, command, here=True, gpu_list=False):
    """The box program's ``command``; install and headers run their steps in this process (``--here``,
    as the job's systemd unit runs them) unless ``here`` is False. The supported-gpus.json check
    (its own tests: tests/unit/test_driver_box_checks.py) passes unless ``gpu_list``."""
    monkeypatch.setattr(box.subprocess, "run", fake)
    if not gpu_list:
        monkeypatch.setattr(box.inst, "supported_gpus_problems", lambda plan, would, log: [])
    path = tmp_path / "driver-plan.json"
    path.write_text(json.dumps(plan))
    extra = ["--here"] if here and command in ("install", "headers") else []
    return box.main([command, "--plan", str(path), *extra])


def is_hold(call) -> bool:
    return call[0] == "apt-mark" and "hold" in call


def held_names(call) -> list[str]:
    return call[call.index("hold") + 1:]


def test_install_resolves_then_installs_exactly_the_simulated_versions_then_holds_and_pins(monkeypatch, tmp_path, plan):
    fake = FakeBox([recorded("debian12_fresh"), recorded("debian12_held_no_module")])
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 0
    cmds = [c for c in fake.calls if c[0] in ("apt-get", "apt-mark")]
    assert cmds[0] == ["apt-get", "update"]
    sim = cmds[1]
    assert sim[:3] == ["apt-get", "install", "--no-install-recommends"] and "--simulate" in sim
    assert sim[-5:] == ["nvidia-driver", "nvidia-smi", "libcuda1", "linux-headers-6.1.0-26-amd64", "linux-headers-amd64"]
    # the approved transaction: every package the simulation installs, at the version it showed
    # (and the headers it left alone, at their installed version: by name, a later candidate would come)
    exact = [f"{n}={v}" for n, v in sorted(apt.simulated(SIMULATE).items())] + [
        "linux-headers-6.1.0-26-amd64=6.1.112-1", "linux-headers-amd64=6.1.112-1"]
    assert len(exact) == 112 and "nvidia-driver=535.261.03-1" in exact and "dkms=3.0.10-8+deb12u1" in exact
    resim = cmds[2]
    assert "--simulate" in resim and resim[-112:] == exact           # simulated again, exactly, right before
    install = next(c for c in cmds if c[:3] == ["apt-get", "-y", "install"])
    assert "--simulate" not in install and install[-112:] == exact and "DPkg::Lock::Timeout=300" in install
    hold = next(c for c in cmds if is_hold(c))
    assert cmds.index(install) < cmds.index(hold)
    assert {"nvidia-driver", "libcuda1", "nvidia-kernel-dkms"} <= set(held_names(hold))
    # the dependencies named only for their version are automatic again (apt's own marks)
    auto = next(c for c in cmds if c[:2] == ["apt-mark", "auto"])
    assert "dkms" in auto and "nvidia-driver" not in auto and "linux-headers-amd64" not in auto
    pin = Path(plan["pin"])
    assert st.parse_pin(pin.read_text())["packages"] == held_names(hold)
    assert st.parse_pin(pin.read_text())["version"] == "535.261.03-1"
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


def apt_calls(fake):
    return [c for c in fake.calls if c[0] in ("apt-get", "apt-mark")]


def held_state(pin_version="535.261.03-1") -> str:
    return recorded("debian12_held_no_module")


def write_old_pin(plan, version="535.261.03-1"):
    text = box.hold.pin_text([(["libcuda1", "nvidia-driver", "nvidia-kernel-dkms"], version)], plan)
    Path(plan["pin"]).write_text(text)
    return text


def test_a_failed_simulation_keeps_the_hold_and_the_pin(monkeypatch, tmp_path, plan, capsys):
    """Before: the hold was released and the pin deleted before apt-get update; a simulation that
    failed left the box with neither."""
    pin = write_old_pin(plan)
    fake = FakeBox(held_state(), simulate=(100, NO_HEADERS))
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 1
    assert not [c for c in fake.calls if c[:2] in (["apt-mark", "unhold"], ["apt-get", "-y"])]
    assert Path(plan["pin"]).read_text() == pin
    assert "the hold and the pin are as they were" in capsys.readouterr().err


UPDATE = "".join(f"Inst {p} [535.261.03-1] (535.309.01-0+deb12u1 Debian-Security:12/oldstable-security [amd64])\n"
                 for p in ("libcuda1", "nvidia-kernel-dkms", "nvidia-driver"))


def test_an_update_releases_the_hold_only_for_the_proven_install_and_restores_it_when_that_fails(
        monkeypatch, tmp_path, plan, capsys):
    pin = write_old_pin(plan)
    fake = FakeBox(held_state(), simulate=(0, UPDATE), install_rc=100)
    assert run_main(monkeypatch, tmp_path, dict(plan, update=True), fake, "install") == 1
    calls = apt_calls(fake)
    sim = next(c for c in calls if "--simulate" in c)
    assert any(o.startswith("Dir::Etc::PreferencesParts=") for o in sim)          # the pin may move: not read
    assert calls.index(sim) < calls.index(next(c for c in calls if c[0] == "apt-mark" and "unhold" in c))
    assert is_hold(calls[-1]) and Path(plan["pin"]).read_text() == pin     # put back
    assert "apt changed no driver package: the previous hold and pin are back" in capsys.readouterr().err


def unit_lines(text: str, unit: str = "verl-lab-train.service", active: str = "activating",
               sub: str = "auto-restart") -> str:
    """A recorded state with ``unit`` in that state (``systemctl show``'s lines in the units section)."""
    return text.replace(st.SECTION + "units\n", st.SECTION + f"units\nId={unit}\nLoadState=loaded\n"
                        f"ActiveState={active}\nSubState={sub}\nUnitFileState=static\n\n")


def test_a_busy_unit_or_a_gpu_process_stops_the_install_before_apt_and_masks_nothing(monkeypatch, tmp_path, plan,
                                                                                     capsys):
    from verl_lab_box import nvidia_driver_units as units
    for unit, active, sub in (("verl-lab-train.service", "activating", "auto-restart"),
                              ("verl-lab-ray.service", "active", "running")):
        fake = FakeBox(unit_lines(recorded("debian12_fresh"), unit, active, sub))
        assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 1
        assert apt_calls(fake) == [] and not [c for c in fake.calls if c[:2] == ["systemctl", "daemon-reload"]]
        err = capsys.readouterr().err
        assert f"{unit} is {active} ({sub}): no driver package is changed under a running job; nothing was changed" in err
        assert "train_unit_state = 'stopped'" in err and "driver_busy = 'stop'" in err
        assert not Path(units.MASK_DIR).exists() or not list(Path(units.MASK_DIR).iterdir())
    busy = recorded("debian12_fresh").replace(st.SECTION + "busy\n", st.SECTION + "busy\n4242 python3\n")
    fake = FakeBox(busy)
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 1
    assert apt_calls(fake) == [] and "processes hold /dev/nvidia* (4242 (python3))" in capsys.readouterr().err


HEADERS_ONLY = "Inst linux-headers-6.1.0-26-amd64 (6.1.112-1 Debian:12.8/stable [amd64])\n"


def test_headers_alone_leave_the_driver_its_hold_and_its_pin(monkeypatch, tmp_path, plan):
    pin = write_old_pin(plan)
    fake = FakeBox(held_state(), simulate=(0, HEADERS_ONLY), versions={"linux-headers-amd64": "6.1.112-1"})
    assert run_main(monkeypatch, tmp_path, plan, fake, "headers") == 0
    calls = apt_calls(fake)
    # the simulated headers at the simulated version, the installed metapackage at its installed one
    assert [c[-2:] for c in calls if c[:2] == ["apt-get", "-y"]] == [
        ["linux-headers-6.1.0-26-amd64=6.1.112-1", "linux-headers-amd64=6.1.112-1"]]
    assert not [c for c in calls if c[0] == "apt-mark" and c[1:2] != ["showauto"]]
    assert Path(plan["pin"]).read_text() == pin
    # a headers install that would bring a driver package is refused
    fake = FakeBox(held_state(), simulate=(0, HEADERS_ONLY + UPDATE))
    assert run_main(monkeypatch, tmp_path, plan, fake, "headers") == 1
    assert not [c for c in apt_calls(fake) if c[:2] == ["apt-get", "-y"]]


NOBLE_REMV = (FIX / "driver" / "apt-simulate-noble-remv.txt").read_text()


def test_a_simulation_that_removes_nvidia_packages_it_was_not_asked_to_replace_is_refused(
        monkeypatch, tmp_path, plan, capsys):
    """Ubuntu 24.04 (apt's format, composed: tests/fixtures/driver/README.md): the user's
    nvidia-driver-550 goes through Conflicts/Provides nvidia-dkms-kernel when 580-server is asked for."""
    assert apt.removed(NOBLE_REMV)["nvidia-dkms-550"] == "550.120-0ubuntu0.24.04.1"
    ubuntu = dict(plan, branch=580, packages=["nvidia-headless-580-server", "nvidia-utils-580-server"],
                  module_package="nvidia-dkms-580-server", source="nvidia-graphics-drivers-580-server",
                  headers=["linux-headers-6.8.0-45-generic"], distro="Ubuntu 24.04 (noble)")
    fake = FakeBox(recorded("debian12_fresh"), simulate=(0, NOBLE_REMV))
    assert run_main(monkeypatch, tmp_path, ubuntu, fake, "install") == 1
    assert not [c for c in fake.calls if c[:2] == ["apt-get", "-y"]]
    err = capsys.readouterr().err
    assert "apt would remove NVIDIA packages the stage did not install: libnvidia-compute-550 " in err
    assert "nvidia-dkms-550 550.120-0ubuntu0.24.04.1" in err and "nothing was installed" in err
    # what the stage itself installed and pinned before (another branch of its own) may be replaced
    gone = apt.removed(NOBLE_REMV)
    assert apt.unasked_removals(gone, list(gone)) == []


def loaded_state(version: str) -> str:
    text = recorded("debian12_held_no_module")
    text = text.replace(st.SECTION + "loaded\n",
                        st.SECTION + f"loaded\nNVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Tue Nov  4 "
                        "00:00:00 UTC 2025\n")
    return text.replace(st.SECTION + "built\n", st.SECTION + f"built\nnvidia-current {version}\n")


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

    def __init__(self, verdict: str, guard: str = "", boots_after: int = 2, reboot_starts: bool = True):
        self.verdict, self.guard, self.boots_after, self.reboot_starts = verdict, guard, boots_after, reboot_starts
        self.commands, self.logged, self.connects, self.connected = [], [], 0, True
        self.token = False

    def run_shell_command(self, command):
        cmd = command.get_raw_value() if hasattr(command, "get_raw_value") else str(command)
        self.commands.append(cmd)
        ok, out = True, ""
        if " verdict " in cmd:
            out = json.dumps({"verdict": self.verdict, "installed": "535.261.03", "reason": f"because {self.verdict}"})
        elif " reboot-guard " in cmd:               # the box program's answer: "" passes, else its refusal
            ok, out = not self.guard, self.guard
        elif cmd.startswith("touch "):
            ok = self.reboot_starts
            self.token = ok
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
    return stage._settle(None, h, "/usr/bin/python3", "/p/nvidia_driver.py", "/p/driver-plan.json", reboot, 60)


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


def test_settle_reboots_only_once_the_box_programs_guard_passed(no_sleep):
    """Before: `systemctl is-active` of the training unit alone; a unit in "activating (auto-restart)"
    or the Ray unit passed, and nothing kept them from starting before the reboot."""
    refusal = ("+ systemctl show ...\nverl-lab driver: verl-lab-train.service is activating (auto-restart): no "
               "driver package is changed under a running job; nothing was changed. stop training first")
    h = FakeHost("reboot", guard=refusal)
    assert settle(h, reboot=True) is False
    assert h.logged[0] == ("verl-lab driver: box1: reboot needed for the driver 535.261.03, but not rebooting: "
                           "verl-lab-train.service is activating (auto-restart): no driver package is changed under "
                           "a running job; nothing was changed. stop training first")
    assert not [c for c in h.commands if "systemctl reboot" in c]
    assert h.commands[1] == "/usr/bin/python3 /p/nvidia_driver.py reboot-guard --plan /p/driver-plan.json"


def test_a_reboot_that_does_not_start_unmasks_the_units(no_sleep):
    h = FakeHost("reboot", reboot_starts=False)
    assert settle(h, reboot=True) is False
    assert h.commands[-1] == "/usr/bin/python3 /p/nvidia_driver.py unmask --plan /p/driver-plan.json"


def test_settle_reboots_and_waits_for_a_new_boot(no_sleep):
    h = FakeHost("reboot", boots_after=3)
    assert settle(h, reboot=True) is True
    reboot = [c for c in h.commands if "systemctl reboot" in c]
    assert h.commands.index(reboot[0]) == h.commands.index(next(c for c in h.commands if "reboot-guard" in c)) + 1
    assert not [c for c in h.commands if " unmask " in c]                     # the boot ends the mask
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
