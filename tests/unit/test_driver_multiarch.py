"""The driver stage's hold, pin and release on a multiarch box (``dpkg --add-architecture i386``, as Debian's and
Ubuntu's driver guides do for the 32-bit libraries), on real dpkg and apt: the cached Debian 12 rootfs of the lab
(tests/lab/rootfs.py) as a chroot on an overlay (tests/lab/chroot.py), no box booted.

There, ``libcuda1`` installed for amd64 and i386 is two packages to dpkg and apt. What runs is the stage's own: its
plan (tasks/driver/plan.py) on the state its fact command reads in the chroot, its box program
(verl_lab_box/nvidia_driver.py ``hold``, shipped as the stage ships it) and the release's commands
(tasks/driver/release.py, run as pyinfra would run them). Judged by apt itself: ``apt-mark showhold``, ``apt-cache
policy`` and a simulated ``apt-get dist-upgrade`` against a newer build of every package in the box's repository.

Stand-ins (tests/fixtures/standins/driver.py): control-only packages under Debian's driver package names (libcuda1
``Multi-Arch: same`` for amd64 and i386, as Debian's is; nvidia-driver, nvidia-smi, nvidia-kernel-dkms), at the
archive's 535.261.03-1 and a newer 535.300.01-1, in a local repository; the headers of the machine's kernel. They
prove what dpkg and apt do with the names, holds and pins of such packages, not a driver: no file, no module.

Mutations: the state's names without the foreign architecture, as ``${Package}`` read them (``package_name``
returning the bare name: the fix undone): 4 of the 5 fail (the state names no ``libcuda1:i386``; the plan says "hold"
again on the second run; the user's hold of it is not named in the pin; dpkg's selections get the ambiguous bare
name). ``selections`` naming the native package bare: the last fails ("ambiguous package name 'libcuda1'")."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tasks.driver.choice import GpuSeen
from tasks.driver.plan import PIN_FILE, DriverFacts, driver_want, plan_driver
from tasks.driver.release import plan_release, stage_paths
from tasks.driver.stage import BOX_MODULES, BOX_PACKAGE
from tasks.facts.driver import DriverLeft, DriverState
from tasks.settings import load_settings
from tests.fixtures.standins.driver import (
    failing_apt_mark_hold,
    kernel_headers_deb,
    package_deb,
    remove_standins,
    serve_from_local_repo,
)
from tests.lab.rootfs import cached_rootfs, is_complete

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("chroot", "dpkg-deb", "mount"))
    or not (is_complete(cached_rootfs()) or shutil.which("debootstrap")),
    reason="needs root, chroot, dpkg-deb and mount (an overlay on the lab's cached rootfs), and debootstrap where "
           "that rootfs is not built yet")

VERSION, NEWER = "535.261.03-1", "535.300.01-1"
SOURCE = "nvidia-graphics-drivers"
BOOKWORM = {"ID": "debian", "VERSION_ID": "12", "PRETTY_NAME": "Debian GNU/Linux 12 (bookworm)"}
WANT = driver_want(load_settings("box1", {"driver": "install"}))
CHECK = driver_want(load_settings("box1", {"driver": "check"}))
# what apt-mark showhold prints once the stage held them: the i386 library qualified, the native packages bare
HELD = {"libcuda1", "libcuda1:i386", "nvidia-driver", "nvidia-kernel-dkms", "nvidia-smi"}


def build_debs(out) -> list:
    debs = [kernel_headers_deb(out)]
    for version in (VERSION, NEWER):
        debs += [package_deb(out, "libcuda1", version, SOURCE, arch=arch, multi_arch="same") for arch in ("amd64", "i386")]
        debs += [package_deb(out, "nvidia-kernel-dkms", version, SOURCE),
                 package_deb(out, "nvidia-smi", version, SOURCE),
                 package_deb(out, "nvidia-driver", version, SOURCE,
                             depends=f"nvidia-kernel-dkms (= {version}), nvidia-smi (= {version})")]
    return debs


def apt_update(box) -> None:
    """The local repository alone (the rootfs's Debian mirror is not reached: no network here)."""
    box.ssh("mv /etc/apt/sources.list /etc/apt/sources.list.off && apt-get update -q; rc=$?; "
            "mv /etc/apt/sources.list.off /etc/apt/sources.list; exit $rc")


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    from tests.lab.chroot import Chroot

    work = tmp_path_factory.mktemp("multiarch")
    chroot = Chroot(work / "box")
    try:
        install(chroot, work)
        yield chroot
    finally:
        chroot.close()


def install(box, work) -> None:
    """The i386 architecture added, the driver's packages at VERSION installed by apt, libcuda1 for both."""
    serve_from_local_repo(box, build_debs(work))
    box.ssh("dpkg --add-architecture i386")
    apt_update(box)
    box.ssh(f"apt-get install -y -q --no-install-recommends nvidia-driver={VERSION} nvidia-smi={VERSION} "
            f"nvidia-kernel-dkms={VERSION} libcuda1={VERSION} libcuda1:i386={VERSION} "
            f"linux-headers-{os.uname().release}")


def read_state(box) -> dict:
    fact = DriverState()
    return fact.process(box.ssh(fact.command(PIN_FILE, WANT.units)).stdout.splitlines())


def plan(box):
    return plan_driver(WANT, DriverFacts(BOOKWORM, read_state(box), (GpuSeen("Tesla P40", "6.1"),), "nvidia-smi",
                                         None))


def hold(box, driver_plan) -> None:
    """The box program run as the stage runs it: shipped beside its modules (the release removes them)."""
    box.write_text(WANT.program, (BOX_PACKAGE / "nvidia_driver.py").read_text(), mode="700")
    box.write_text(f"{WANT.libexec}/verl_lab_gpu.py", (BOX_PACKAGE / "gpu.py").read_text())
    for name in BOX_MODULES:
        box.write_text(f"{WANT.libexec}/{name}", (BOX_PACKAGE / name).read_text())
    box.write_text(WANT.plan_path, json.dumps(driver_plan.box_plan), mode="600")
    box.ssh(f"python3 {WANT.program} hold --plan {WANT.plan_path}")


def showhold(box) -> set[str]:
    return set(box.ssh("apt-mark showhold").stdout.split())


def candidate(box, package: str) -> str:
    policy = box.ssh(f"apt-cache policy {package}").stdout
    return next(line.split(":", 1)[1].strip() for line in policy.splitlines() if line.strip().startswith("Candidate:"))


def upgrades(box) -> dict[str, str]:
    """What a simulated ``apt-get dist-upgrade`` would install: {package as apt names it: version}."""
    sim = box.ssh("apt-get -s -q dist-upgrade").stdout
    return {line.split()[1]: line.split("(", 1)[1].split()[0] for line in sim.splitlines() if line.startswith("Inst ")}


def test_the_hold_and_pin_take_both_architectures(box):
    before = plan(box)
    names = {p["name"] for p in read_state(box)["packages"]}
    assert {"libcuda1", "libcuda1:i386"} <= names, names          # two packages to dpkg, named as apt names them
    assert before.action == "hold", before
    assert upgrades(box) == {"libcuda1": NEWER, "libcuda1:i386": NEWER, "nvidia-driver": NEWER,
                             "nvidia-kernel-dkms": NEWER, "nvidia-smi": NEWER}        # the newer build is there
    hold(box, before)
    assert showhold(box) == HELD
    pin = box.read_text(PIN_FILE)
    assert f"Package: libcuda1 libcuda1:i386 nvidia-driver nvidia-kernel-dkms nvidia-smi\nPin: version {VERSION}\n" in pin
    # apt's own answer: each architecture's candidate is the pinned build, and an upgrade takes none of them
    assert candidate(box, "libcuda1:i386") == VERSION and candidate(box, "libcuda1:amd64") == VERSION
    assert upgrades(box) == {}


def test_a_second_run_changes_nothing(box):
    again = plan(box)
    assert again.action == "settle", again          # held and pinned: the stage does not hold again
    pin, held, selections = box.read_text(PIN_FILE), showhold(box), box.ssh("dpkg --get-selections").stdout
    hold(box, again)                                # even run by hand, the hold changes nothing
    assert (box.read_text(PIN_FILE), showhold(box), box.ssh("dpkg --get-selections").stdout) == (pin, held, selections)
    assert plan(box).action == "settle"


def release(box) -> None:
    fact = DriverLeft()
    left = fact.process(box.ssh(fact.command(PIN_FILE, CHECK.units)).stdout.splitlines())
    paths = {p: ({} if box.exists(p) else None) for p in stage_paths(CHECK)}
    planned = plan_release("box1", CHECK, left, paths)
    assert not planned.refusal, planned.refusal
    for step in planned.steps:
        for command in step.commands:
            box.ssh(command)


def test_the_release_unholds_both_architectures_and_keeps_the_driver(box):
    release(box)
    assert showhold(box) == set() and not box.exists(PIN_FILE)
    assert candidate(box, "libcuda1:i386") == NEWER
    assert upgrades(box) == {"libcuda1": NEWER, "libcuda1:i386": NEWER, "nvidia-driver": NEWER,
                             "nvidia-kernel-dkms": NEWER, "nvidia-smi": NEWER}
    installed = box.ssh("dpkg-query -W -f='${binary:Package} ${Version} ${db:Status-Abbrev}\\n' libcuda1 nvidia-driver")
    assert set(installed.stdout.splitlines()) == {f"libcuda1:amd64 {VERSION} ii ", f"libcuda1:i386 {VERSION} ii ",
                                                  f"nvidia-driver {VERSION} ii "}       # the driver stays


def test_a_users_own_hold_of_the_i386_library_stays_theirs(box):
    box.ssh("apt-mark hold libcuda1:i386")
    again = plan(box)
    assert again.action == "hold", again
    hold(box, again)
    assert showhold(box) == HELD
    assert "# held before the driver stage held them (driver = 'check' keeps these held): libcuda1:i386\n" in \
        box.read_text(PIN_FILE)
    release(box)
    assert showhold(box) == {"libcuda1:i386"} and not box.exists(PIN_FILE)
    assert "libcuda1:i386" not in upgrades(box)     # the user's hold keeps it where it is


def test_where_apt_mark_fails_dpkgs_selections_hold_each_architecture(box):
    """apt-mark hold failing (a stand-in refusing it as apt does under another's dpkg lock): dpkg's own selections,
    which refuse a bare name of a package installed twice. Mutation: ``selections`` naming the native one bare:
    dpkg says "ambiguous package name 'libcuda1'", nothing is held, the hold fails."""
    box.ssh("apt-mark unhold libcuda1:i386")
    failing_apt_mark_hold(box)
    try:
        again = plan(box)
        assert again.action == "hold", again
        hold(box, again)
        assert "apt-mark hold failed (exit 100): holding through `dpkg --set-selections`" in box.read_text(WANT.log)
    finally:
        remove_standins(box)
    assert showhold(box) == HELD
    assert upgrades(box) == {}
