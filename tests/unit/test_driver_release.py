"""driver = "check" on a box the driver stage managed (tasks/driver/release.py), on plain values: the box's packages
and pin as a lab box printed them after the stage's install (tests/fixtures/facts/driver.DriverState/
debian12_held_no_module.json), changed one way per case. The e2e (tests/e2e/test_driver.py
``test_driver_check_releases_the_hold_and_pin_and_keeps_the_driver``) runs it on a lab box with Debian's real
packages; each protection here fails a test when removed (named in the test)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tasks.doctor import diagnose
from tasks.driver.plan import BLACKLIST_FILE, PIN_FILE, SOURCES_FILE, driver_want
from tasks.driver.release import plan_release, stage_paths
from tasks.facts.driver import DriverLeft
from tasks.settings import load_settings
from verl_lab_box.nvidia_driver_state import PROC_VERSION, RUNFILE_UNINSTALLER
from verl_lab_box.nvidia_driver_units import RECORD

FACTS = Path(__file__).resolve().parents[1] / "fixtures" / "facts"
FIXTURE = FACTS / "driver.DriverState" / "debian12_held_no_module.json"
STATE = json.loads(FIXTURE.read_text())["fact"]
WANT = driver_want(load_settings("box1", {"driver": "check"}))
FILE = {"kind": "file", "mode": "644", "user": "root", "group": "root"}
DIR = {"kind": "dir", "mode": "700", "user": "root", "group": "root"}
VERSION = "535.261.03-1"
OURS = sorted(STATE["pin"]["packages"])          # the 23 packages of nvidia-graphics-drivers the stage held


def left(**changes) -> dict:
    """What DriverLeft answers on the lab box after the stage's install (no job, no masks), with ``changes``."""
    base = {"packages": copy.deepcopy(STATE["packages"]), "pin": copy.deepcopy(STATE["pin"]), "job": "inactive",
            "masks": [], "recorded": [], "dpkg_updates": []}
    return {**base, **changes}


def managed_paths() -> dict:
    return {PIN_FILE: FILE, WANT.libexec: DIR, WANT.marker: FILE, BLACKLIST_FILE: FILE, SOURCES_FILE: FILE,
            WANT.log: FILE}


def package(state: dict, name: str) -> dict:
    return next(p for p in state["packages"] if p["name"] == name)


def test_the_hold_and_pin_are_released_and_the_driver_kept():
    """Mutations: unhold every held package (not the pin's): the user's hold below goes; no check after the
    unhold: the showhold line is missing."""
    state = left()
    package(state, "nvidia-modprobe")["held"] = True         # a hold of the user's own: not in the pin
    release = plan_release("box1", WANT, state, managed_paths())
    assert not release.refusal
    (step,) = release.steps
    assert step.name == (f"NVIDIA driver: hold and pin released (driver = 'check': the driver stage no longer manages "
                         f"the driver): apt-mark unhold of its 23 packages, {PIN_FILE} removed, {WANT.libexec} "
                         f"removed, {WANT.marker} removed")
    unhold = step.commands[0].split()
    assert unhold[:4] == ["apt-mark", "-o", "DPkg::Lock::Timeout=300", "unhold"]
    assert sorted(unhold[4:unhold.index(">/dev/null")]) == OURS and "nvidia-modprobe" not in unhold
    assert step.commands[1] == f"rm -rf {PIN_FILE} {WANT.libexec} {WANT.marker}"
    assert step.commands[2] == "[ ! -d /opt/verl-lab/libexec ] || rmdir --ignore-fail-on-non-empty /opt/verl-lab/libexec"
    assert step.commands[3].startswith("if apt-mark showhold | grep -qxF -e firmware-nvidia-gsp -e libcuda1 ")
    # kept, said so: the driver, the blacklist and the sources while its packages remain, the stage's log
    assert release.kept.startswith(f"kept the installed NVIDIA driver (23 packages at {VERSION}), the nouveau "
                                   f"blacklist {BLACKLIST_FILE}, {SOURCES_FILE} (the apt components its packages "
                                   f"update from), the stage's log {WANT.log}: driver = 'check'")
    assert "rm" not in " ".join(c for c in step.commands if BLACKLIST_FILE in c or SOURCES_FILE in c)


def test_a_box_the_stage_never_managed_gets_nothing_and_a_second_run_nothing():
    """A driver installed by hand (no pin, no files of the stage), held by its user: nothing is released.
    After a release (the pin and the files gone, the hold released): nothing again."""
    state = left(pin=None)
    assert plan_release("box1", WANT, state, {BLACKLIST_FILE: None}) == plan_release("box1", WANT, left(), {})
    assert plan_release("box1", WANT, state, {}).steps == () and not plan_release("box1", WANT, state, {}).refusal
    after = left(pin=None, packages=[{**p, "held": False} for p in STATE["packages"]])
    assert plan_release("box1", WANT, after, {BLACKLIST_FILE: FILE, SOURCES_FILE: FILE, WANT.log: FILE}).steps == ()


def test_only_the_packages_still_held_are_unheld_and_a_missing_pin_unholds_none():
    state = left()
    for name in ("nvidia-smi", "libcuda1"):
        package(state, name)["held"] = False
    (step,) = plan_release("box1", WANT, state, managed_paths()).steps
    assert "nvidia-smi" not in step.commands[0] and "libcuda1" not in step.commands[0]
    assert "apt-mark unhold of its 21 packages" in step.name
    # the pin removed by hand: the stage cannot tell its hold from a user's; its files go, no package is unheld,
    # and the kept line says they stay held (mutation: no line of what stays held: it claims apt may update them)
    release = plan_release("box1", WANT, left(pin=None), {WANT.libexec: DIR, WANT.marker: FILE})
    (step,) = release.steps
    assert not any("apt-mark" in c for c in step.commands) and step.commands[0] == \
        f"rm -rf {WANT.libexec} {WANT.marker}"
    assert (f"stays; 23 of its packages stay held, by holds that are not the stage's (placed before it held them, or "
            f"with its pin gone the stage cannot tell): {' '.join(OURS)}; apt updates the driver only once those are "
            f"released too (`apt-mark unhold {' '.join(OURS)}`). apt and unattended-upgrades may now update the rest "
            "like any package") in release.kept


def test_a_hold_the_user_placed_before_the_stages_hold_stays():
    """Recorded on a Debian 12 rootfs with real dpkg and apt-mark (tests/fixtures/facts/driver.DriverLeft/
    user_hold.json): nvidia-driver held by hand, then the stage's hold of all three; its pin names nvidia-driver as
    held before it. The release unholds the other two only and says nvidia-driver stays held; run there, apt-mark
    showhold then printed nvidia-driver alone. Mutation: ``released`` not leaving out the pin's THEIRS line: the
    user's hold is released too. Re-run after a release stopped past its unhold (the pin still there): no unhold."""
    state = DriverLeft().process(json.loads((FACTS / "driver.DriverLeft" / "user_hold.json").read_text())["output"])
    release = plan_release("box1", WANT, state, {PIN_FILE: FILE})
    (step,) = release.steps
    assert step.commands[0] == "apt-mark -o DPkg::Lock::Timeout=300 unhold firmware-nvidia-gsp libcuda1 >/dev/null"
    assert "apt-mark unhold of its 2 packages" in step.name and "grep -qxF -e firmware-nvidia-gsp -e libcuda1;" in \
        step.commands[-1]
    assert "stays; 1 of its packages stays held, by holds that are not the stage's" in release.kept
    assert "(`apt-mark unhold nvidia-driver`). apt and unattended-upgrades may now update the rest" in release.kept
    stopped = {**state, "packages": [{**p, "held": p["name"] == "nvidia-driver"} for p in state["packages"]]}
    (step,) = plan_release("box1", WANT, stopped, {PIN_FILE: FILE}).steps
    assert step.commands[0] == f"rm -rf {PIN_FILE}" and not any("apt-mark" in c for c in step.commands)


def test_a_driver_no_package_brought_keeps_the_blacklist():
    """The Debian driver purged by hand and NVIDIA's .run installer's driver in its place (the packages and the
    uninstaller as tests/fixtures/facts/driver.DriverState/runfile_driver.json recorded them), or any nvidia module
    loaded: the blacklist (and the sources file) stay, said so once with the stage's files; the initramfs is not
    rebuilt without it. Mutation: the signs of another driver not read: the blacklist goes."""
    runfile = json.loads((FACTS / "driver.DriverState" / "runfile_driver.json").read_text())["output"]
    state = DriverLeft().process(runfile)
    assert state["packages"] == [] and "uninstaller /usr/bin/nvidia-uninstall" in runfile
    for sign in (RUNFILE_UNINSTALLER, PROC_VERSION):
        paths = {BLACKLIST_FILE: FILE, SOURCES_FILE: FILE, sign: {"kind": "link"}}
        assert plan_release("box1", WANT, state, paths) == plan_release("box1", WANT, {}, {})
        release = plan_release("box1", WANT, state, {**paths, WANT.marker: FILE})
        assert [s.name.split(":")[1] for s in release.steps] == [" hold and pin released (driver = 'check'"]
        assert release.kept == (f"kept {BLACKLIST_FILE} and {SOURCES_FILE}: no NVIDIA driver package is installed, "
                                f"but a driver no package brought is here ({sign} exists), and it needs nouveau kept "
                                "away as much; remove them by hand (then `update-initramfs -u`) once that driver is "
                                "gone")
    # none: they go (the test above with no driver package)
    assert plan_release("box1", WANT, state, {BLACKLIST_FILE: FILE}).steps[0].commands[0] == f"rm -f {BLACKLIST_FILE}"


def test_with_no_driver_package_left_the_blacklist_and_sources_go_with_the_initramfs():
    """Mutation: the blacklist removed while driver packages remain: the first test's commands hold none."""
    purged = left(packages=[{**p, "installed": False, "status": "rc"} for p in STATE["packages"]
                            if p["source"] == "nvidia-graphics-drivers"])
    release = plan_release("box1", WANT, purged, managed_paths())
    hold, files = release.steps
    assert hold.name.startswith("NVIDIA driver: hold and pin released") and not release.kept
    assert files.name == (f"NVIDIA driver: {BLACKLIST_FILE} and {SOURCES_FILE} removed (driver = 'check': the "
                          "driver stage no longer manages the driver, and no NVIDIA driver package is installed; the "
                          "initramfs rebuilt without the blacklist)")
    assert files.commands == (f"rm -f {BLACKLIST_FILE} {SOURCES_FILE}",
                              "if command -v update-initramfs >/dev/null; then update-initramfs -u; fi")
    # later, with the pin and files gone already: the blacklist alone
    (alone,) = plan_release("box1", WANT, {**purged, "pin": None}, {BLACKLIST_FILE: FILE}).steps
    assert alone.commands[0] == f"rm -f {BLACKLIST_FILE}"


def test_the_stages_own_masks_are_removed_where_no_change_runs():
    """Mutation: every mask removed (not only the recorded): the user's ray mask below is named."""
    state = left(masks=["verl-lab-train.service", "verl-lab-ray.service"], recorded=["verl-lab-train.service"])
    unmask, hold = plan_release("box1", WANT, state, managed_paths()).steps
    assert unmask.name.startswith("NVIDIA driver: unmask verl-lab-train.service (masked by a driver change that did "
                                  "not end, and none runs;")
    assert unmask.commands == (
        '[ "$(readlink /run/systemd/system.control/verl-lab-train.service)" != /dev/null ] || '
        "rm -f /run/systemd/system.control/verl-lab-train.service", "systemctl daemon-reload", f"rm -f {RECORD}")
    assert hold.name.startswith("NVIDIA driver: hold and pin released")
    # the masks alone (the stage's files gone by hand): still removed
    (alone,) = plan_release("box1", WANT, {**state, "pin": None}, {}).steps
    assert alone is not None and alone.name.startswith("NVIDIA driver: unmask")


@pytest.mark.parametrize("change,said,rule", [
    ({"job": "active"}, "a driver change is still running here (verl-lab-driver-apt.service): it is active",
     "driver-change-running"),
    ({"job": "deactivating"}, "a driver change is still running here (verl-lab-driver-apt.service): it is deactivating",
     "driver-change-running"),
    ({"dpkg_updates": ["0001"]}, "dpkg was interrupted (/var/lib/dpkg/updates holds 1 files;",
     "driver-dpkg-interrupted"),
    ({"unconfigured": "iF"}, "dpkg left nvidia-kernel-dkms (iF) not configured", "driver-dpkg-half-configured"),
    ({"unconfigured": "iU"}, "dpkg left nvidia-kernel-dkms (iU) not configured", "driver-dpkg-half-configured"),
    ({"moved": "535.309.01-1"}, "a driver change did not finish: the pin holds 23 packages at 535.261.03-1, and dpkg "
                                "has nvidia-driver 535.309.01-1", ""),
])
def test_a_change_running_or_stopped_part_way_is_refused_with_the_doctors_reason(change, said, rule):
    """Mutations, each failing its case: the job's state not read (running); /var/lib/dpkg/updates not read
    (interrupted); unconfigured packages not looked for (iF, iU); versions against the pin not compared (moved).
    The refusal's words are the doctor's: its rule finds them."""
    state = left(masks=["verl-lab-train.service"], recorded=["verl-lab-train.service"])
    if "unconfigured" in change:
        package(state, "nvidia-kernel-dkms").update(status=change.pop("unconfigured"), installed=False)
    if "moved" in change:
        package(state, "nvidia-driver")["version"] = change.pop("moved")
    state.update(change)
    release = plan_release("box1", WANT, state, managed_paths())
    assert release.steps == () and release.refusal.startswith(
        "verl-lab driver: box1: driver = 'check' releases the driver stage's hold and pin, but not now (nothing was "
        f"changed): {said}")
    found = [f.rule for f in diagnose("box1", {"deploy": release.refusal}).findings]
    if rule:
        assert rule in found and f"The doctor ({rule}): " in release.refusal, found
    finishes = "The driver stage finishes a change only with driver = 'install'"
    assert (finishes in release.refusal) == (rule != "driver-change-running")
    assert ("`pyinfra -y <inventory> deploy/driver.py --limit box1 --data driver=install`" in release.refusal
            or rule == "driver-change-running")


def test_the_paths_asked_are_those_released_and_kept():
    assert stage_paths(WANT) == [PIN_FILE, "/opt/verl-lab/libexec/driver", "/opt/verl-lab/markers/driver.done",
                                 BLACKLIST_FILE, SOURCES_FILE, "/opt/verl-lab/logs/driver.log",
                                 "/usr/bin/nvidia-uninstall", "/proc/driver/nvidia/version"]


def test_a_multiarch_box_releases_each_architecture():
    """What DriverLeft read on the multiarch box the stage held (the lab's Debian 12 rootfs, recorded: libcuda1 for
    amd64 and i386): the unhold and its check name the i386 library by its own name, as apt-mark showhold prints
    it. Mutation: ``package_name`` dropping the architecture: libcuda1:i386 is not unheld."""
    left = DriverLeft().process(json.loads((FACTS / "driver.DriverLeft" / "multiarch_held.json").read_text())["output"])
    (step,) = plan_release("box1", WANT, left, {PIN_FILE: FILE}).steps
    assert step.commands[0] == ("apt-mark -o DPkg::Lock::Timeout=300 unhold libcuda1 libcuda1:i386 nvidia-driver "
                                "nvidia-kernel-dkms nvidia-smi >/dev/null")
    assert step.commands[-1].startswith("if apt-mark showhold | grep -qxF -e libcuda1 -e libcuda1:i386 -e ")
