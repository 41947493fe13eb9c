"""The box program's checks before and after an install (issue 36): Fabric Manager on NVSwitch
boxes and the cuInit proof, the candidate package's own supported-gpus.json (Debian's real 535
package, from the tests' cache), an update moving the pin, a package coming back under the pin,
and the e2e's unattended-upgrades reading. The fake box and the helpers are
tests/unit/test_driver_box.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_driver_box import (  # noqa: F401
    UPDATE,
    FakeBox,
    apt,
    apt_calls,
    box,
    held_names,
    held_state,
    is_hold,
    loaded_state,
    plan,
    recorded,
    run_main,
    st,
    write_old_pin,
)

# ---------------------------------------------------------------- NVSwitch: Fabric Manager


def ubuntu_plan(plan, **extra):
    return {**plan, "branch": 580, "packages": ["nvidia-headless-580-server", "nvidia-utils-580-server"],
            "module_package": "nvidia-dkms-580-server", "source": "nvidia-graphics-drivers-580-server",
            "headers": ["linux-headers-6.8.0-45-generic"], "distro": "Ubuntu 24.04 (noble)",
            "fabricmanager": {"package": "nvidia-fabricmanager-580", "service": "nvidia-fabricmanager.service"}, **extra}


def ubuntu_state(fm_version: str | None, held: bool = False) -> str:
    v = "580.196.07-0ubuntu0.24.04.1"
    h = "h" if held else "i"
    rows = [f"{n}\tnvidia-graphics-drivers-580-server\t{v}\t{h}ii" for n in
            ("nvidia-headless-580-server", "nvidia-utils-580-server", "nvidia-dkms-580-server")]
    if fm_version:
        rows.append(f"nvidia-fabricmanager-580\tfabric-manager-580\t{fm_version}\t{h}ii")
    return recorded("debian12_fresh").replace(st.SECTION + "packages\n", st.SECTION + "packages\n" + "\n".join(rows) + "\n")


NOBLE_FM = "".join(f"Inst {p} (580.196.07-0ubuntu0.24.04.1 Ubuntu:24.04/noble-updates [amd64])\n"
                   for p in ("nvidia-dkms-580-server", "nvidia-headless-580-server", "nvidia-utils-580-server"))


def test_fabric_manager_of_the_drivers_version_is_installed_held_and_enabled(monkeypatch, tmp_path, plan):
    v = "580.196.07-0ubuntu0.24.04.1"
    sim = NOBLE_FM + f"Inst nvidia-fabricmanager-580 ({v} Ubuntu:24.04/noble-updates/multiverse [amd64])\n"
    fake = FakeBox([recorded("debian12_fresh"), ubuntu_state(v)], simulate=(0, sim))
    assert run_main(monkeypatch, tmp_path, ubuntu_plan(plan), fake, "install") == 0
    install = next(c for c in fake.calls if c[:2] == ["apt-get", "-y"])
    assert "nvidia-fabricmanager-580=580.196.07-0ubuntu0.24.04.1" in install
    assert ["systemctl", "enable", "nvidia-fabricmanager.service"] in fake.calls
    pin = st.parse_pin(Path(plan["pin"]).read_text())
    assert pin["stanzas"][1] == {"packages": ["nvidia-fabricmanager-580"], "version": v}
    hold = next(c for c in fake.calls if is_hold(c))
    assert "nvidia-fabricmanager-580" in held_names(hold)


def test_fabric_manager_of_another_version_is_refused(monkeypatch, tmp_path, plan, capsys):
    sim = NOBLE_FM + "Inst nvidia-fabricmanager-580 (580.95.05-0ubuntu0.24.04.2 Ubuntu:24.04/noble-updates [amd64])\n"
    fake = FakeBox(recorded("debian12_fresh"), simulate=(0, sim))
    assert run_main(monkeypatch, tmp_path, ubuntu_plan(plan), fake, "install") == 1
    assert not [c for c in fake.calls if c[:2] == ["apt-get", "-y"]]
    assert "Fabric Manager 580.95.05-0ubuntu0.24.04.2 is not the driver's version" in capsys.readouterr().err


def test_on_an_nvswitch_box_the_proof_is_cuinit(monkeypatch, tmp_path, plan, capsys):
    """nvidia-smi answers on an HGX box without a working fabric; CUDA does not (error 802)."""
    smi = (0, "0, NVIDIA H100 80GB HBM3, 580.196.07\n")
    state = loaded_state("580.196.07").replace("535.261.03-1", "580.196.07-0ubuntu0.24.04.1")
    p = ubuntu_plan(plan, module_package="nvidia-kernel-dkms")
    monkeypatch.setattr(box, "cuda_init", lambda: 802)
    assert run_main(monkeypatch, tmp_path, p, FakeBox(state, smi=smi), "prove") == 1
    err = capsys.readouterr().err
    assert "cuInit failed (802: system not ready" in err and "nvidia-fabricmanager.service" in err
    monkeypatch.setattr(box, "cuda_init", lambda: 0)
    assert run_main(monkeypatch, tmp_path, p, FakeBox(state, smi=smi), "prove") == 0
    assert "ok    cuInit" in capsys.readouterr().err
    fake = FakeBox(state)
    assert run_main(monkeypatch, tmp_path, p, fake, "load") == 0
    assert fake.calls[-1] == ["systemctl", "start", "nvidia-fabricmanager.service"]


# ---------------------------------------------------------------- the candidate's own supported-gpus.json


@pytest.fixture(scope="module")
def debian_535():
    """The real nvidia-driver 535.261.03-1 of Debian 12 (fetched and sha256-checked into the tests'
    cache: tests/fixtures/driver/debian_package.py)."""
    from tests.fixtures.driver.debian_package import debian_nvidia_driver, supported_gpus_json

    return debian_nvidia_driver(), apt.supported_chips(supported_gpus_json())


def test_the_real_debian_535_list_by_pci_device_id(debian_535):
    _, chips = debian_535
    ok = [{"name": "Tesla P40", "device": "1b38"}, {"name": "GeForce RTX 4080", "device": "2704"},
          {"name": "H100 SXM5 80GB", "device": "2330"}, {"name": "A100-SXM4-80GB", "device": "20b2"}]
    assert apt.unsupported(chips, ok, "535.261.03-1") == []
    # NVIDIA's list leaves the T4 out (files/drivers.toml [[unlisted]]): spared by the table's exception only
    t4 = [{"name": "TU104GL [Tesla T4]", "device": "1eb8"}]
    assert apt.unsupported(chips, t4, "535.261.03-1") == [
        "TU104GL [Tesla T4] (PCI 10de:1eb8): not in the supported-GPU list of 535.261.03-1"]
    from tasks.driver import load_table
    assert apt.unsupported(chips, t4, "535.261.03-1", list(load_table().unlisted)) == []
    newer = {"2335": "H200", "2685": "RTX 4090 D", "2702": "RTX 4080 SUPER", "28b0": "RTX 2000 Ada",
             "25b0": "RTX A1000", "25b2": "RTX A400"}
    bad = apt.unsupported(chips, [{"name": n, "device": d} for d, n in newer.items()], "535.261.03-1")
    assert len(bad) == len(newer) and all("not in the supported-GPU list of 535.261.03-1" in b for b in bad)
    kepler = apt.unsupported(chips, [{"name": "Tesla K80", "device": "102d"}], "535.261.03-1")
    assert kepler == ["Tesla K80 (PCI 10de:102d): listed by 535.261.03-1 for the legacy branch 470.xx only"]
    # no PCI ID read (a container): nvidia-smi's exact name, never a word of it
    assert apt.unsupported(chips, [{"name": "NVIDIA GeForce RTX 4080", "device": None}], "v") == []
    assert apt.unsupported(chips, [{"name": "NVIDIA GeForce RTX 4080 SUPER", "device": None}], "v")


def test_the_install_reads_the_list_from_the_package_apt_would_install(monkeypatch, tmp_path, plan, capsys, debian_535):
    deb, _ = debian_535
    checked = dict(plan, supported_gpus={"package": "nvidia-driver"},
                   gpus=[{"name": "GP102GL [Tesla P40]", "device": "1b38"}, {"name": "AD103 [RTX 4080 SUPER]", "device": "2702"}])
    fake = FakeBox(recorded("debian12_fresh"), download=deb)
    assert run_main(monkeypatch, tmp_path, checked, fake, "install", gpu_list=True) == 1
    assert ["apt-get", "download", "nvidia-driver=535.261.03-1"] in fake.calls       # the simulation's candidate
    assert not [c for c in fake.calls if c[:2] == ["apt-get", "-y"]]
    err = capsys.readouterr().err
    assert ("the candidate driver's own list (nvidia-driver 535.261.03-1: usr/share/doc/nvidia-driver/"
            "supported-gpus.json.gz) does not support this box's GPUs: AD103 [RTX 4080 SUPER] (PCI 10de:2702)") in err
    fake = FakeBox([recorded("debian12_fresh"), recorded("debian12_held_no_module")], download=deb)
    assert run_main(monkeypatch, tmp_path, dict(checked, gpus=checked["gpus"][:1]), fake, "install", gpu_list=True) == 0
    assert "ok    every GPU here is in nvidia-driver 535.261.03-1" in capsys.readouterr().out


def test_an_update_moves_every_package_of_the_branch_and_then_the_pin(monkeypatch, tmp_path, plan):
    write_old_pin(plan)
    newer = recorded("debian12_held_no_module").replace("535.261.03-1", "535.309.01-0+deb12u1")
    fake = FakeBox([held_state(), newer], simulate=(0, UPDATE))
    assert run_main(monkeypatch, tmp_path, dict(plan, update=True), fake, "install") == 0
    install = next(c for c in fake.calls if c[:2] == ["apt-get", "-y"])
    assert {"nvidia-driver", "nvidia-kernel-dkms", "firmware-nvidia-gsp", "libnvidia-ml1"} <= {
        a.split("=")[0] for a in install}
    assert st.parse_pin(Path(plan["pin"]).read_text())["version"] == "535.309.01-0+deb12u1"


def test_the_unattended_upgrades_check_fails_when_it_checked_nothing():
    """The e2e reads unattended-upgrades' dry run with this; before, a run that printed no "will be
    upgraded" line passed with nothing checked. The lines are unattended-upgrades 2.9.1's own
    (Debian 12) messages."""
    from tests.fixtures.driver.unattended import would_upgrade

    checked = ("Allowed origins are: origin=Debian,codename=bookworm,label=Debian, "
               "origin=Debian,codename=bookworm-security,label=Debian-Security\n"
               "pkgs that look like they should be upgraded: libc-bin\nlibc6\n"
               "Packages that will be upgraded: libc-bin libc6\n")
    assert would_upgrade(checked) == {"libc-bin", "libc6"}
    for nothing in ("Allowed origins are: origin=Debian,codename=bookworm,label=Debian\n"
                    "No packages found that can be upgraded unattended and no pending auto-removals\n", ""):
        with pytest.raises(AssertionError, match="checked nothing"):
            would_upgrade(nothing)


def test_a_missing_package_is_installed_under_the_pin(monkeypatch, tmp_path, plan):
    """An install that is not an update (a held package removed by hand) keeps the pin in place:
    apt brings the package back at the pinned version, not the archive's newer build."""
    pin = write_old_pin(plan)
    back = "Inst nvidia-smi (535.261.03-1 Debian:12.12/oldstable [amd64])\n"
    fake = FakeBox(held_state(), simulate=(0, back), install_rc=100)
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 1
    sim = next(c for c in apt_calls(fake) if "--simulate" in c)
    assert not any(o.startswith("Dir::Etc::PreferencesParts=") for o in sim)       # the pin is read
    assert ["apt-mark", "-o", "DPkg::Lock::Timeout=300", "unhold", "nvidia-smi"] in fake.calls
    assert Path(plan["pin"]).read_text() == pin
    last = [c for c in fake.calls if c[0] == "apt-mark"][-1]
    assert is_hold(last) and held_names(last) == ["nvidia-smi"]                         # put back after the failure


# ---------------------------------------------------------------- the holds that are not the stage's


class QuietLog:
    """apt-mark answering 0; what the hold says, kept."""

    def __init__(self):
        self.calls, self.said = [], []

    def run(self, argv, check=True, env=None, cwd=None):
        import subprocess
        self.calls.append(list(argv))
        return subprocess.CompletedProcess(argv, 0, "", "")

    def say(self, text, stream=None):
        self.said.append(text)


def test_a_hold_placed_before_the_stages_is_named_in_its_pin_and_its_own_are_not(tmp_path, plan):
    """The box as the stage's install left it (23 held, its pin naming them): holding again names none as
    another's. Mutation: ``theirs`` not taking the pin's packages as the stage's: all 23 named. The pin gone and
    nvidia-smi held by hand: the new pin names it. Mutation: do_hold writing the pin without ``kept``. A pin that
    named it already: carried. Mutation: ``theirs`` not reading the pin's THEIRS line."""
    state = st.parse_fact_output(held_state())
    ours = sorted(state["pin"]["packages"])

    def hold(state):
        box.hold.do_hold(plan, QuietLog(), lambda: state)
        return st.parse_pin(Path(plan["pin"]).read_text())

    assert hold(state)["theirs"] == [] and sorted(hold(state)["packages"]) == ours
    by_hand = {**state, "pin": None, "packages": [{**p, "held": p["name"] == "nvidia-smi"} for p in state["packages"]]}
    assert hold(by_hand)["theirs"] == ["nvidia-smi"]
    again = {**state, "pin": {**state["pin"], "theirs": ["nvidia-smi"]}}       # all held: the stage's and the user's
    assert hold(again)["theirs"] == ["nvidia-smi"]


def test_the_hold_and_the_pin_name_each_architecture(tmp_path, plan):
    """The multiarch box the stage held before the fix (libcuda1:i386 unheld; the lab's Debian 12 rootfs, recorded):
    apt-mark holds the i386 library by its own name, and the pin names it. Mutation: ``package_name`` dropping the
    architecture: the hold names libcuda1 alone."""
    state = st.parse_fact_output(recorded("debian12_multiarch_old_hold"))
    log = QuietLog()
    box.hold.do_hold(plan, log, lambda: state)
    (hold,) = [c for c in log.calls if is_hold(c)]
    assert held_names(hold) == ["libcuda1", "libcuda1:i386", "nvidia-driver", "nvidia-kernel-dkms", "nvidia-smi"]
    pin = st.parse_pin(Path(plan["pin"]).read_text())
    assert pin["packages"] == held_names(hold) and pin["theirs"] == []


def test_an_install_keeps_naming_the_holds_it_found_that_were_not_its_own(monkeypatch, tmp_path, plan):
    """A driver installed and held by hand (no pin of the stage's), then driver = "install" with driver_update: the
    install releases those holds for apt and holds everything after; its pin names them as held before it, so
    driver = "check" leaves them held. Mutation: the install not passing what it read before apt to do_hold (it
    then reads the box after its own hold and names none)."""
    newer = recorded("debian12_held_no_module").replace("535.261.03-1", "535.309.01-0+deb12u1")
    fake = FakeBox([held_state(), newer], simulate=(0, UPDATE))
    assert run_main(monkeypatch, tmp_path, dict(plan, update=True), fake, "install") == 0
    pin = st.parse_pin(Path(plan["pin"]).read_text())
    assert pin["version"] == "535.309.01-0+deb12u1" and pin["theirs"] == sorted(pin["packages"])


def test_a_failure_past_apt_keeps_naming_them(tmp_path, plan):
    """A change that failed after apt moved a package: the pin the failure writes names the holds the install found
    that were not the stage's. Mutation: ``secure`` writing its pin without ``before["theirs"]``."""
    before = {"pin": "", "held": [], "versions": {"nvidia-driver": ["535.216.01-1", "ii"]}, "target": {},
              "theirs": ["nvidia-smi", "not-installed"]}
    said = box.hold.secure(plan, before, QuietLog(), lambda: st.parse_fact_output(held_state()))
    assert said.startswith("apt finished the install") and \
        st.parse_pin(Path(plan["pin"]).read_text())["theirs"] == ["nvidia-smi"]
