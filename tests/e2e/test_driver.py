"""The driver stage (driver = "install") on lab-in-a-box Debian 12 hosts, against Debian's real archive.

Real here: pyinfra over SSH, the stage's choice from each box's GPUs (stand-in nvidia-smi), apt's own
resolver and a real install of Debian 12's non-free nvidia-driver (535.x, with its DKMS package,
firmware and user-space libraries, ~200 MB from deb.debian.org), apt-mark hold and the apt
preferences pin judged by apt itself and by unattended-upgrades' own dry run, the refusals.
Stand-ins (tests/fixtures/standins/driver.py): the headers package of the test machine's kernel
(no archive has them), mokutil reporting Secure Boot on, the traces of NVIDIA's .run installer, an
unknown distro's /etc/os-release.

What cannot run here: a kernel module. The boxes share the test machine's kernel, so DKMS builds
nothing for it and nothing can be loaded; the stage therefore ends each install with its own
"no nvidia kernel module ... for the running kernel" failure (asserted below). The reboot step runs
for real on boxes of its own (systemd's reboot inside the box, the lab starting it again as
systemd-nspawn@.service would, the stage waiting for the new boot, one box at a time, never a box
whose training unit is active), its "reboot" verdict given by a stand-in program; a reboot onto a
new driver and the proof after it (/proc/driver/nvidia/version, nvidia-smi) are proven only at the
unit level (tests/unit/test_driver.py and test_driver_box.py: verdicts on recorded box states, the
proof's checks).
"""

from __future__ import annotations

import os
import re

import pytest

from tests.fixtures.driver.unattended import would_upgrade
from tests.fixtures.standins import driver as standin
from tests.lab import BoxSpec

SOURCES = "/etc/apt/sources.list.d/verl-lab-nvidia.sources"
PIN = "/etc/apt/preferences.d/verl-lab-nvidia-driver"
BLACKLIST = "/etc/modprobe.d/verl-lab-blacklist-nouveau.conf"
MARKER = "/opt/verl-lab/markers/driver.done"
LIBEXEC = "/opt/verl-lab/libexec/driver"
KERNEL = os.uname().release
REFUSED = ["sb", "runfile", "rocky", "k80", "h200"]
DRIVER_BOXES = ["deb12", "nohdr", "p590", *REFUSED]
HELD_AT_LEAST = {"nvidia-driver", "nvidia-kernel-dkms", "libcuda1", "nvidia-smi", "libnvidia-ml1", "firmware-nvidia-gsp"}
SECURITY = ("Types: deb\nURIs: http://security.debian.org/debian-security\nSuites: bookworm-security\n"
            "Components: main contrib non-free non-free-firmware\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")


@pytest.fixture(scope="module")
def lab(lab_factory):
    lab = lab_factory([
        BoxSpec("deb12", gpu="p40", driver="470.256.02"),    # too old for CUDA 11.8: gets R535
        BoxSpec("nohdr", gpu="p40", driver="470.256.02"),    # no headers for the kernel: apt says so
        BoxSpec("sb", gpu="t4"),
        BoxSpec("runfile", gpu="t4"),
        BoxSpec("rocky", gpu="t4"),
        BoxSpec("k80", gpu="k80", driver="470.256.02"),
        BoxSpec("h200", gpu="h200"),                         # R535 does not list the H200
        BoxSpec("p590", gpu="p40", driver="590.44.01"),      # NVIDIA's CUDA repository's 590 on a Pascal box
        BoxSpec("plain", gpu="t4"),                          # driver = "check"
    ])
    standin.install_headers(lab.box("deb12"), standin.kernel_headers_deb(lab.dir))
    standin.secure_boot_on(lab.box("sb"))
    standin.runfile_traces(lab.box("runfile"))
    standin.unknown_distro(lab.box("rocky"))
    standin.nvidia_590_from_cuda_repo(lab.box("p590"), lab.dir)
    return lab


def deploy(lab, hosts=DRIVER_BOXES, **data):
    return lab.deploy("deploy/driver.py", hosts=hosts, data={"driver": "install", **data})


@pytest.fixture(scope="module")
def converged(lab):
    return deploy(lab)


def untouched(box) -> None:
    for path in (SOURCES, PIN, BLACKLIST, MARKER, LIBEXEC):
        assert not box.exists(path), f"{box.name}: {path} was written"
    assert not box.ssh("dpkg-query -W -f='${Status}' nvidia-driver 2>/dev/null", check=False).stdout.startswith(
        "install ok installed")


def held(box) -> set[str]:
    return set(box.ssh("apt-mark showhold").stdout.split())


def installed_version(box, package: str) -> str:
    return box.ssh(f"dpkg-query -W -f='${{Version}}' {package}").stdout.strip()


@pytest.mark.parametrize("name,said", [
    ("sb", ["Secure Boot is on (SecureBoot enabled)", "mokutil --import", "Key was rejected by service"]),
    ("runfile", ["NVIDIA's .run installer", "/usr/bin/nvidia-uninstall exists",
                 "installer version 550.107.02", "libcuda.so.550.107.02 belongs to no package"]),
    ("rocky", ["does not know 'Rocky Linux 9.4 (Blue Onyx)'", "ID=rocky"]),
    ("k80", ["Tesla K80 (3.7): the pinned stack (torch 2.6.0+cu118, CUDA 11.8) cannot run this GPU",
             "NVIDIA's last driver branch for Kepler GPUs is R470"]),
    ("h200", ["Debian 12 (bookworm) ships R535; this box needs R550 or newer", "the NVIDIA H200 needs R550"]),
])
def test_refusals_fire_before_any_change(lab, converged, name, said):
    assert name in converged.failed_hosts, converged
    out = converged.output
    assert f"verl-lab driver: {name}: nothing was changed by the driver stage:" in out
    for words in said:
        assert words in out, f"{name}: {words!r} not in the output:\n{converged.tail(80)}"
    untouched(lab.box(name))


def test_missing_kernel_headers_stop_before_installing(lab, converged):
    """The real archive has no headers for this machine's kernel: apt's own resolver says so, the
    stage names the package, and no driver package was installed."""
    assert "nohdr" in converged.failed_hosts
    out = converged.output
    assert f"Unable to locate package linux-headers-{KERNEL}" in out
    assert "nothing was installed" in out
    box = lab.box("nohdr")
    assert not box.ssh("dpkg-query -W -f='${Status}' nvidia-driver 2>/dev/null", check=False).stdout
    assert not box.exists(PIN) and not box.exists(MARKER) and not held(box)


def test_debian_packages_resolve_install_and_are_held_and_pinned(lab, converged):
    box = lab.box("deb12")
    version = installed_version(box, "nvidia-driver")
    assert re.fullmatch(r"535\.\d+\.\d+-\S+", version), version
    for package in ("nvidia-kernel-dkms", "libcuda1", "nvidia-smi", "firmware-nvidia-gsp"):
        assert installed_version(box, package) == version
    assert box.ssh(f"dpkg-query -W -f='${{Status}}' linux-headers-{KERNEL}").stdout.endswith("installed")
    pinned = box.read_text(PIN)
    names = set(re.search(r"^Package: (.*)$", pinned, re.M).group(1).split())
    assert f"\nPin: version {version}\nPin-Priority: 1001\n" in pinned
    from_source = set(box.ssh("dpkg-query -W -f='${Package} ${source:Package}\\n' | "
                              "awk '$2 == \"nvidia-graphics-drivers\" {print $1}'").stdout.split())
    assert names == from_source and HELD_AT_LEAST <= names
    assert names <= held(box)
    policy = box.ssh("apt-cache policy nvidia-driver").stdout
    assert f"Installed: {version}" in policy and f"Candidate: {version}" in policy
    assert re.search(rf"\*\*\* {re.escape(version)} 1001", policy), policy
    assert "Components: contrib non-free non-free-firmware" in box.read_text(SOURCES)
    assert "blacklist nouveau" in box.read_text(BLACKLIST).splitlines()
    assert "apt-get" in box.read_text("/opt/verl-lab/logs/driver.log")


def test_no_module_can_load_in_a_container_and_the_stage_says_so(lab, converged):
    """DKMS (Debian's own) built nothing for the test machine's kernel: the stage stops there,
    without a marker, naming the kernel and DKMS's status."""
    assert "deb12" in converged.failed_hosts
    version = installed_version(lab.box("deb12"), "nvidia-driver").split("-")[0]
    out = converged.output
    assert f"no nvidia kernel module {version} exists for the running kernel {KERNEL}" in out, converged.tail(80)
    assert f"nvidia-current/{version}: added" in out
    assert not lab.box("deb12").exists(MARKER)


def test_a_rerun_changes_nothing(lab, converged):
    again = deploy(lab)
    assert sorted(again.failed_hosts) == sorted(converged.failed_hosts)
    assert all(again.changed_by_host.get(h, 0) == 0 for h in DRIVER_BOXES), again.changed_ops


def test_unattended_upgrades_cannot_replace_the_held_driver(lab, converged):
    """With Debian's security suite (it carries a newer 535 build), apt's candidate stays the
    installed version and unattended-upgrades' own dry run upgrades no driver package."""
    box = lab.box("deb12")
    version = installed_version(box, "nvidia-driver")
    box.write_text("/etc/apt/sources.list.d/security.sources", SECURITY)
    box.ssh("apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "
            "--no-install-recommends unattended-upgrades >/dev/null", timeout=600)
    policy = box.ssh("apt-cache policy nvidia-driver").stdout
    newer = re.findall(r"^\s+(535\.\S+) 500\s*$", policy, re.M)
    assert newer and all(v != version for v in newer), f"no newer build to hold back:\n{policy}"
    assert f"Candidate: {version}" in policy
    dry = box.ssh("unattended-upgrade --dry-run --debug 2>&1", timeout=600).stdout
    upgraded = would_upgrade(dry)           # fails when the dry run upgraded nothing: then it checked nothing
    assert not upgraded & (held(box) | HELD_AT_LEAST), upgraded
    dist = box.ssh("apt-get -s dist-upgrade").stdout
    assert re.search(r"^Inst ", dist, re.M), "the security suite brings nothing to upgrade: the check proves nothing"
    assert not set(re.findall(r"^Inst (\S+)", dist, re.M)) & held(box), dist
    rerun = deploy(lab, hosts=["deb12"])
    assert rerun.changed_by_host.get("deb12", 0) == 0, rerun.changed_ops
    assert installed_version(box, "nvidia-driver") == version


def test_a_590_driver_on_a_pascal_box_is_refused(lab, converged):
    """NVIDIA's CUDA repository's 590 carries Debian's package and source names: before, the plan
    said "hold" and marked R535 on a box running a branch that no longer supports Pascal."""
    assert "p590" in converged.failed_hosts
    out = converged.output
    assert ("verl-lab driver: p590: nothing was changed by the driver stage:" in out
            and "the installed NVIDIA kernel module is nvidia-kernel-dkms 590.44.01-1 (R590, from no archive this box "
                "lists" in out), converged.tail(60)
    assert "R535 was chosen" in out and "R590 is outside what the GPUs here run (R520 .. R580)" in out
    box = lab.box("p590")
    for path in (SOURCES, PIN, BLACKLIST, MARKER, LIBEXEC):
        assert not box.exists(path), path
    assert installed_version(box, "nvidia-driver") == "590.44.01-1" and not held(box)


# ---------------------------------------------------------------- a working box is never broken
# (on deb12, after the security suite was added above: a newer 535 build is in its archive)


def pinned(box) -> str:
    return box.read_text(PIN)


def test_an_install_is_refused_while_the_training_unit_runs(lab):
    box = lab.box("deb12")
    version, pin, holds = installed_version(box, "nvidia-driver"), pinned(box), held(box)
    box.ssh("systemd-run --unit=verl-lab-train.service --description='stand-in training' sleep infinity")
    try:
        res = deploy(lab, hosts=["deb12"], driver_update=True)
    finally:
        box.ssh("systemctl stop verl-lab-train.service", check=False)
    assert res.failed_hosts == ["deb12"]
    assert "verl-lab-train.service is active: the driver stage changes no driver package under a running job" \
        in res.output and "set train_unit_state = 'stopped'" in res.output, res.tail(40)
    assert (installed_version(box, "nvidia-driver"), pinned(box), held(box)) == (version, pin, holds)
    assert res.changed_by_host.get("deb12", 0) == 0, res.changed_ops


def test_a_failed_simulation_keeps_the_hold_and_the_pin(lab):
    """nvidia-smi removed and the kernel's headers gone: the stage plans an install, apt's
    simulation fails (no archive has the headers), and the hold and the pin are as they were
    (before: both were released before apt-get update and never put back)."""
    box = lab.box("deb12")
    pin, holds = pinned(box), held(box)
    box.ssh(f"dpkg -r --force-hold,depends nvidia-smi linux-headers-{KERNEL} >/dev/null")
    res = deploy(lab, hosts=["deb12"])
    assert res.failed_hosts == ["deb12"]
    assert f"Unable to locate package linux-headers-{KERNEL}" in res.output
    assert "nothing was installed (the hold and the pin are as they were)" in res.output, res.tail(40)
    assert pinned(box) == pin and holds - {"nvidia-smi"} <= held(box)


def test_a_missing_package_comes_back_at_the_held_version_not_the_newer_build(lab):
    """The same box, the headers now installable (a local repository): the install puts nvidia-smi
    back at the pinned version although the security suite carries a newer build."""
    box = lab.box("deb12")
    version, pin = installed_version(box, "nvidia-driver"), pinned(box)
    standin.serve_from_local_repo(box, [standin.kernel_headers_deb(lab.dir)])
    res = deploy(lab, hosts=["deb12"])
    assert installed_version(box, "nvidia-smi") == version and installed_version(box, "nvidia-driver") == version
    assert pinned(box) == pin and "nvidia-smi" in held(box), res.tail(40)


def test_headers_alone_leave_the_driver_and_its_hold(lab):
    """A new kernel (here: its headers removed) gets its headers alone: before, the install released
    the hold and apt upgraded the driver itself to the security suite's build."""
    box = lab.box("deb12")
    version, pin, holds = installed_version(box, "nvidia-driver"), pinned(box), held(box)
    box.ssh(f"dpkg -r linux-headers-{KERNEL} >/dev/null")
    res = deploy(lab, hosts=["deb12"])
    assert "the headers alone are installed, the driver and its hold stay as they are" in res.output, res.tail(40)
    assert box.ssh(f"dpkg-query -W -f='${{Status}}' linux-headers-{KERNEL}").stdout.endswith("installed")
    assert (installed_version(box, "nvidia-driver"), pinned(box), held(box)) == (version, pin, holds)
    log = box.read_text("/opt/verl-lab/logs/driver.log")
    assert "apt-mark" not in log[log.rindex("+ apt-get update"):]          # no hold released, none set


def test_a_security_update_taken_on_purpose_moves_the_pin_and_a_rerun_changes_nothing(lab):
    box = lab.box("deb12")
    before = installed_version(box, "nvidia-driver")
    newest = re.findall(r"^\s+(535\.\S+) 500\s*$", box.ssh("apt-cache policy nvidia-driver").stdout, re.M)[0]
    assert newest != before
    res = deploy(lab, hosts=["deb12"], driver_update=True)
    after = installed_version(box, "nvidia-driver")
    assert after == newest, res.tail(60)
    assert installed_version(box, "nvidia-kernel-dkms") == after and installed_version(box, "libcuda1") == after
    assert f"\nPin: version {after}\nPin-Priority: 1001\n" in pinned(box)
    assert HELD_AT_LEAST <= held(box)
    assert f"no nvidia kernel module {after.split('-')[0]} exists for the running kernel" in res.output
    again = deploy(lab, hosts=["deb12"], driver_update=True)
    assert again.changed_by_host.get("deb12", 0) == 0, again.changed_ops
    assert installed_version(box, "nvidia-driver") == after


def test_check_mode_asks_and_changes_nothing(lab):
    """driver = "check" (the default): deploy/driver.py runs the base stage only."""
    first = lab.deploy("deploy/driver.py", hosts=["plain"]).assert_ok()
    assert first.changed_ops and all(op.startswith("verl-lab base layout |") for _, op in first.changed_ops)
    lab.deploy("deploy/driver.py", hosts=["plain"]).assert_idempotent()
    assert "NVIDIA driver" not in first.output
    untouched(lab.box("plain"))


# ---------------------------------------------------------------- the reboot step, on boxes of its own

SETTLE = "tests/fixtures/driver/settle_deploy.py"
STANDIN_VERDICT = """#!/usr/bin/python3
# STAND-IN for nvidia_driver.py verdict (tests/e2e/test_driver.py): what a box with the new driver
# installed under an old loaded module answers; a container never holds a kernel module.
import json
print(json.dumps({"verdict": "reboot", "installed": "535.261.03",
                  "reason": "the running kernel still has the nvidia module 535.104.05 loaded: a reboot loads 535.261.03"}))
"""


@pytest.fixture(scope="module")
def rebooting(lab_factory):
    lab = lab_factory([BoxSpec("rb1", gpu="p40"), BoxSpec("rb2", gpu="t4")])
    for box in lab.boxes.values():
        box.write_text("/opt/verl-lab-test/verdict.py", STANDIN_VERDICT, mode="755")
    return lab


def booted_at(box) -> int:
    """When the box's PID 1 (its systemd) started: a new value after every boot."""
    return int(box.ssh("stat -c %Y /proc/1").stdout)


def test_reboot_needs_driver_reboot(rebooting):
    before = {name: booted_at(b) for name, b in rebooting.boxes.items()}
    res = rebooting.deploy(SETTLE, data={"driver": "install"})
    assert sorted(res.failed_hosts) == ["rb1", "rb2"]
    assert "rb1: reboot needed: the driver 535.261.03 is installed and held, but the running kernel still has the " \
           "nvidia module 535.104.05 loaded" in res.output and "set driver_reboot = True" in res.output
    assert {name: booted_at(b) for name, b in rebooting.boxes.items()} == before


def test_a_box_whose_training_unit_is_active_is_not_rebooted(rebooting):
    trains, idle = rebooting.box("rb1"), rebooting.box("rb2")
    trains.ssh("systemd-run --unit=verl-lab-train.service --description='stand-in training' sleep infinity")
    before = {b.name: booted_at(b) for b in (trains, idle)}
    res = rebooting.deploy(SETTLE, data={"driver": "install", "driver_reboot": True})
    assert res.failed_hosts == ["rb1"], res
    assert "rb1: reboot needed for the driver 535.261.03, but verl-lab-train.service is active: not rebooting" \
        in res.output
    assert booted_at(trains) == before["rb1"]
    assert booted_at(idle) > before["rb2"] and idle.reboots == 1          # came back, and the stage waited for it
    assert idle.ssh("systemctl is-system-running").stdout.strip() in ("running", "degraded")


def test_boxes_reboot_one_at_a_time(rebooting):
    rebooting.box("rb1").ssh("systemctl stop verl-lab-train.service", check=False)
    before = {name: booted_at(b) for name, b in rebooting.boxes.items()}
    res = rebooting.deploy(SETTLE, data={"driver": "install", "driver_reboot": True})
    res.assert_ok()
    after = {name: booted_at(b) for name, b in rebooting.boxes.items()}
    assert all(after[n] > before[n] for n in after)
    # each reboot waits at least 5 s before the box is polled: run side by side, both boxes would
    # have booted within the same second or two
    assert abs(after["rb1"] - after["rb2"]) >= 5, after
