"""The driver stage (driver = "install") on lab-in-a-box Debian 12 hosts, against Debian's real archive.

Real here: pyinfra over SSH, the stage's choice from each box's GPUs (stand-in nvidia-smi), apt's own
resolver and a real install of Debian 12's non-free nvidia-driver (535.x, with its DKMS package,
firmware and user-space libraries, ~200 MB from deb.debian.org), apt-mark hold and the apt
preferences pin judged by apt itself and by unattended-upgrades' own dry run, the refusals; the
install run by systemd as a transient unit, the training and Ray units (unit files at their real
paths with the training unit's Restart=on-failure / RestartSec=30) masked, stopped and judged by real
systemd; a real DKMS build failure inside Debian's nvidia-kernel-dkms postinst; real list refreshes
from Debian's security archive; a controller killed with every SSH session it had in the box.
Stand-ins (tests/fixtures/standins/driver.py): the headers package of the test machine's kernel
(no archive has them; one variant's build tree fails so DKMS really fails), mokutil reporting Secure
Boot on, the traces of NVIDIA's .run installer, an unknown distro's /etc/os-release, and for timing
a wrapper apt-get that runs a script once right after the stage's first simulation (the refresh,
the unit start, the process opening a GPU land there), update-initramfs and apt-mark hold failing
as the real ones do.

What cannot run here: a kernel module. The boxes share the test machine's kernel, so DKMS builds
nothing for it and nothing can be loaded; the stage therefore ends each install with its own
"no nvidia kernel module ... for the running kernel" failure (asserted below). The reboot step runs
for real on boxes of its own (tests/e2e/test_driver_reboot.py), its "reboot" verdict given by a
stand-in program; a reboot onto a new driver and the proof after it (/proc/driver/nvidia/version,
nvidia-smi) are proven only at the unit level (tests/unit/test_driver.py and test_driver_box*.py:
verdicts on recorded box states, the proof's checks).
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from tasks.doctor import diagnose
from tests.fixtures.driver.unattended import would_upgrade
from tests.fixtures.standins import driver as standin
from tests.lab import BoxSpec
from tests.lab.listing import box_listing, listing_diff
from verl_lab_box.nvidia_driver_state import THEIRS

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
SECURITY_FILE = "/etc/apt/sources.list.d/security.sources"
TRAIN, RAY, JOB = "verl-lab-train.service", "verl-lab-ray.service", "verl-lab-driver-apt.service"
LOG = "/opt/verl-lab/logs/driver.log"
STATUS = f"{LIBEXEC}/driver-job.json"
BOOKWORM = "535.261.03-1"                    # bookworm/non-free's nvidia-driver (files/drivers.toml)
# apt-daily's refresh, landing right after the stage's first simulation: Debian's security suite, with
# its newer 535 build, appears in the lists (written as a one-shot script run by the apt-get wrapper)
REFRESH = f"cat > {SECURITY_FILE} <<'EOF'\n{SECURITY}EOF\n/usr/bin/apt-get update -q >/dev/null 2>&1; echo refreshed $?\n"


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
        BoxSpec("byhand", gpu="p40", driver="470.256.02"),   # deb12's driver installed by hand, never by the stage
    ])
    standin.install_headers(lab.box("deb12"), standin.kernel_headers_deb(lab.dir))
    standin.install_headers(lab.box("byhand"), standin.kernel_headers_deb(lab.dir))
    standin.after_first_simulation(lab.box("deb12"), REFRESH)          # the first install meets a list refresh
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


def approved(box) -> dict[str, str]:
    """The versions the last driver change's simulation approved (its log line), by package."""
    line = [x for x in box.read_text(LOG).splitlines() if x.startswith("ok    apt's simulation approved: ")][-1]
    return dict(p.split("=", 1) for p in line.split(": ", 1)[1].split())


def test_a_list_refresh_between_simulation_and_install_installs_the_simulated_versions(lab, converged):
    """apt-daily's refresh landed right after the simulation and made bookworm-security's newer 535
    build the candidate: the install took the simulated bookworm build all the same (before, the
    install named packages only, so apt installed whatever the lists said by then)."""
    box = lab.box("deb12")
    assert "refreshed 0" in standin.hook_log(box), standin.hook_log(box)
    ok = approved(box)
    assert ok["nvidia-driver"] == BOOKWORM and ok["libcuda1"] == BOOKWORM
    for package in ("nvidia-driver", "nvidia-kernel-dkms", "libcuda1", "libnvidia-ml1", "nvidia-smi"):
        assert installed_version(box, package) == ok[package] == BOOKWORM, package
    policy = box.ssh("apt-cache policy nvidia-driver").stdout
    newer = [v for v in re.findall(r"^\s+(?:\*\*\* )?(535\.\S+) \d+\s*$", policy, re.M) if v != BOOKWORM]
    assert newer, f"the refresh brought no newer build: the test proves nothing\n{policy}"
    log = box.read_text(LOG)
    install = [x for x in log.splitlines() if x.startswith("+ apt-get -y install")][-1]
    assert f"nvidia-driver={BOOKWORM}" in install and f"linux-headers-{KERNEL}=1.0" in install
    standin.remove_standins(box)


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


# ---------------------------------------------------------------- back to driver = "check" (tasks/driver/release.py)


def check(lab, hosts=("deb12",)):
    """deploy/driver.py with driver = "check", in text mode: the operations' names as a user sees them."""
    return lab.deploy("deploy/driver.py", hosts=list(hosts), data={"driver": "check"}, mode="text", timeout=900)


def untouched_since(box, pin: str, holds: set[str]) -> None:
    assert box.read_text(PIN) == pin and held(box) == holds and box.exists(LIBEXEC)


@pytest.mark.parametrize("kind", ["running", "unpacked"])
def test_driver_check_is_refused_while_a_change_runs_or_stopped_part_way(lab, converged, kind):
    """A driver change running (here a stand-in job under the job unit's name: real systemd says it is active), or
    one that stopped part-way (nvidia-smi unpacked again by dpkg, not configured): nothing is released, the box is
    refused with what was found and the doctor's words for it. Mutations: the job's state not read (running);
    unconfigured packages not looked for (unpacked)."""
    box = lab.box("deb12")
    pin, holds = box.read_text(PIN), held(box)
    if kind == "running":
        box.ssh(f"systemd-run --unit={JOB} --quiet sleep 300")
    else:
        box.ssh("dpkg --unpack --force-hold /var/cache/apt/archives/nvidia-smi_*.deb >/dev/null 2>&1")
    try:
        res = check(lab)
    finally:
        # dpkg's unpack set nvidia-smi's selection to install: configured and held again as the stage left it
        box.ssh(f"systemctl stop {JOB} 2>/dev/null; dpkg --configure -a >/dev/null 2>&1; apt-mark hold nvidia-smi "
                ">/dev/null", check=False)
    assert res.failed_hosts == ["deb12"] and res.changed_by_host.get("deb12", 0) == 0, res.tail(40)
    said = ({"running": f"a driver change is still running here ({JOB}): it is active",
             "unpacked": "dpkg left nvidia-smi (iU) not configured"}[kind])
    assert ("verl-lab driver: deb12: driver = 'check' releases the driver stage's hold and pin, but not now (nothing "
            f"was changed): {said}") in res.output, res.tail(40)
    rule = {"running": "driver-change-running", "unpacked": "driver-dpkg-half-configured"}[kind]
    assert f"The doctor ({rule}): " in res.output
    assert rule in [f.rule for f in diagnose("deb12", {"deploy": res.output}).findings]
    untouched_since(box, pin, holds)


MASK = f"/run/systemd/system.control/{TRAIN}"


def test_driver_check_releases_the_hold_and_pin_and_keeps_the_driver(lab, converged):
    """driver = "install" converged (as far as a lab box goes: installed, held, pinned; no module loads), then
    driver = "check": the pin and the hold of its packages released, the stage's programs, plan and marker removed,
    a mask it left removed, each said; the driver, the blacklist, the sources file and the stage's log kept. The box
    is then the listing of ``byhand`` (the same packages installed by hand with apt, from the .deb files deb12's
    apt downloaded; never a driver stage there) but the log, kept on purpose; a hold of the user's own stays on both.
    A second run changes nothing. Stand-ins: the marker (written as the stage writes it after its proof, which no
    lab box reaches) and the mask with its record (as a job killed with its ExecStopPost leaves them)."""
    box, hand = lab.box("deb12"), lab.box("byhand")
    standin.remove_standins(box)                   # the converge's apt-get wrapper (its own test removes it too)
    version = installed_version(box, "nvidia-driver")
    assert check(lab, ["byhand"]).ok                # the base layout deb12 has from its converge, nothing else
    debs = sorted((box.root / "var/cache/apt/archives").glob("*.deb"))
    assert any(d.name.startswith("nvidia-driver_") for d in debs), debs
    hand.ssh("mkdir -p /var/tmp/debs")
    for deb in debs:
        (hand.root / "var/tmp/debs" / deb.name).write_bytes(deb.read_bytes())
    hand.ssh("cd /var/tmp/debs && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
             "./*.deb >/dev/null 2>&1 && rm -rf /var/tmp/debs", timeout=900)
    assert installed_version(hand, "nvidia-driver") == version
    for each in (box, hand):                       # the user's own hold, of a package the stage does not pin
        each.ssh("apt-mark hold nvidia-modprobe >/dev/null")
    box.ssh(f"printf 'stage=driver\\nbranch=535\\nversion={version.split('-')[0]}\\n' > {MARKER}")
    box.ssh(f"mkdir -p /run/systemd/system.control && ln -sfn /dev/null {MASK} && echo {TRAIN} > "
            "/run/verl-lab-driver-masked && systemctl daemon-reload")
    assert standin.unit_state(box, TRAIN)["UnitFileState"] == "masked-runtime"
    ours, sources, blacklist = set(re.search(r"^Package: (.*)$", box.read_text(PIN), re.M).group(1).split()), \
        box.read_text(SOURCES), box.read_text(BLACKLIST)

    res = check(lab)
    assert res.ok and res.changed_by_host["deb12"] == 2, res.tail(40)
    out = res.output
    assert (f"NVIDIA driver: hold and pin released (driver = 'check': the driver stage no longer manages the driver): "
            f"apt-mark unhold of its {len(ours)} packages, {PIN} removed, {LIBEXEC} removed, {MARKER} removed") \
        in out, res.tail(40)
    assert f"NVIDIA driver: unmask {TRAIN} (masked by a driver change that did not end, and none runs;" in out
    assert (f"verl-lab: kept the installed NVIDIA driver ({len(ours)} packages at {version}), the nouveau blacklist "
            f"{BLACKLIST}, {SOURCES} (the apt components its packages update from), the stage's log {LOG}") in out
    assert held(box) == {"nvidia-modprobe"} and not box.exists(PIN) and not box.exists(LIBEXEC)
    assert standin.unmasked(box) and not box.exists("/run/verl-lab-driver-masked")
    # kept: the driver, working as it was; the blacklist; the sources its updates come from (apt now offers them)
    assert installed_version(box, "nvidia-driver") == version
    assert box.read_text(SOURCES) == sources and box.read_text(BLACKLIST) == blacklist
    upgrade = set(re.findall(r"^Inst (\S+)", box.ssh("apt-get -s dist-upgrade").stdout, re.M))
    assert {"nvidia-driver", "libcuda1"} <= upgrade, upgrade      # no longer held back from bookworm-security's build

    mine, theirs = box_listing(box), box_listing(hand)
    diff = listing_diff({**theirs, "hosts": ""}, {**mine, "hosts": ""})   # two boxes: each its own hostname line
    assert diff == [f"+ /opt/verl-lab/logs ({mine['paths']['/opt/verl-lab/logs']})",
                    f"+ {LOG} ({mine['paths'][LOG]})"], json.dumps(diff, indent=1)
    assert theirs["holds"] == mine["holds"] == ["nvidia-modprobe"]

    again = check(lab)
    assert again.ok and again.changed_by_host["deb12"] == 0, again.tail(40)
    assert "NVIDIA driver" not in again.output and "kept the installed" not in again.output


def test_driver_install_again_holds_and_pins_it_as_before(lab, converged):
    """Back to driver = "install": the stage holds and pins the installed driver again (its "hold" plan), with the
    pin it had; the tests below start from there. First with a hold of the user's own on nvidia-smi, placed while
    driver = "check": the pin names it as held before the stage held it, and driver = "check" again releases every
    hold but that one, and says it stays (mutation: the release not leaving out the pin's THEIRS line: nvidia-smi
    is released too)."""
    box = lab.box("deb12")
    box.ssh("apt-mark unhold nvidia-modprobe >/dev/null && apt-mark hold nvidia-smi >/dev/null")
    res = deploy(lab, hosts=["deb12"])
    assert "holding and pinning it" in res.output, res.tail(40)
    assert f"\n{THEIRS}nvidia-smi\nPackage: " in box.read_text(PIN) and "nvidia-smi" in held(box)
    res = check(lab)
    assert res.ok and held(box) == {"nvidia-smi"} and not box.exists(PIN), res.tail(40)
    assert ("a working driver stays; 1 of its packages stays held, by holds that are not the stage's (placed before "
            "it held them, or with its pin gone the stage cannot tell): nvidia-smi;") in res.output, res.tail(40)
    box.ssh("apt-mark unhold nvidia-smi >/dev/null")
    res = deploy(lab, hosts=["deb12"])
    assert "holding and pinning it" in res.output, res.tail(40)
    names = set(re.search(r"^Package: (.*)$", box.read_text(PIN), re.M).group(1).split())
    assert f"\nPin: version {BOOKWORM}\nPin-Priority: 1001\n" in box.read_text(PIN)
    assert names == source_packages(box) and held(box) == names and box.exists(f"{LIBEXEC}/nvidia_driver.py")
    assert THEIRS not in box.read_text(PIN)


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


@pytest.mark.parametrize("kind,said", [
    ("auto-restart", f"{TRAIN} is activating (auto-restart)"),      # crashed, restarting within 30 s
    ("running", f"{TRAIN} is active (running)"),
    ("ray", f"{RAY} is active (running)"),                          # a cluster member's Ray node
])
def test_a_driver_update_while_a_unit_is_busy_changes_nothing_and_says_why(lab, converged, kind, said):
    """Before: only exactly "active" of the training unit stopped the stage (and `systemctl is-active`
    the reboot); a unit restarting after a crash passed, and the Ray unit was named by no check."""
    box = lab.box("deb12")
    version, pin, holds, log = installed_version(box, "nvidia-driver"), pinned(box), held(box), box.read_text(LOG)
    unit = standin.start_unit(box, kind)
    try:
        before = standin.unit_state(box, unit)
        res = deploy(lab, hosts=["deb12"], driver_update=True)
        after = standin.unit_state(box, unit)
    finally:
        standin.remove_units(box)
    assert res.failed_hosts == ["deb12"]
    assert f"{said}: the driver stage changes no driver package under a running job" in res.output, res.tail(40)
    assert "set train_unit_state = 'stopped'" in res.output and "driver_busy = 'stop'" in res.output
    assert res.changed_by_host.get("deb12", 0) == 0, res.changed_ops
    assert (installed_version(box, "nvidia-driver"), pinned(box), held(box)) == (version, pin, holds)
    assert box.read_text(LOG) == log                                  # the box program never ran
    assert (after["ActiveState"], after["SubState"]) == (before["ActiveState"], before["SubState"])
    assert after["UnitFileState"] != "masked-runtime"


GPU_HOLDER = "verl-lab-test-gpu-holder.service"


def test_a_process_that_opens_the_gpu_during_the_change_stops_it_before_apt_get_install(lab, converged):
    """The units are masked for the change, but any process may open /dev/nvidia*: the check right
    before apt-get install finds it (here one opening a stand-in device node right after apt's
    simulation), and nothing is installed."""
    box = lab.box("deb12")
    version, pin, holds = installed_version(box, "nvidia-driver"), pinned(box), held(box)
    standin.after_first_simulation(box, f": > /dev/nvidia0; systemd-run --unit={GPU_HOLDER} --quiet "
                                        "sh -c 'exec sleep 600 < /dev/nvidia0'; echo holder $?\n")
    try:
        res = deploy(lab, hosts=["deb12"], driver_update=True)
    finally:
        box.ssh(f"systemctl stop {GPU_HOLDER}; rm -f /dev/nvidia0", check=False)
        standin.remove_standins(box)
    assert "holder 0" in standin.hook_log(box)
    assert res.failed_hosts == ["deb12"]
    assert re.search(r"processes hold /dev/nvidia\* \(\d+ \(sleep, in verl-lab-test-gpu-holder\.service\)\) "
                     r"\(right before apt-get install\): no driver package is changed under a running job; nothing "
                     r"was installed", res.output), res.tail(40)
    assert (installed_version(box, "nvidia-driver"), pinned(box), held(box)) == (version, pin, holds)
    assert standin.unmasked(box)


def test_a_failed_simulation_keeps_the_hold_and_the_pin(lab, converged):
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


def test_a_missing_package_comes_back_at_the_held_version_not_the_newer_build(lab, converged):
    """The same box, the headers now installable (a local repository): the install puts nvidia-smi
    back at the pinned version although the security suite carries a newer build."""
    box = lab.box("deb12")
    version, pin = installed_version(box, "nvidia-driver"), pinned(box)
    standin.serve_from_local_repo(box, [standin.kernel_headers_deb(lab.dir)])
    res = deploy(lab, hosts=["deb12"])
    assert installed_version(box, "nvidia-smi") == version and installed_version(box, "nvidia-driver") == version
    assert pinned(box) == pin and "nvidia-smi" in held(box), res.tail(40)


def test_headers_alone_leave_the_driver_and_its_hold_and_a_vanished_version_stops_them(lab, converged):
    """A new kernel (here: its headers removed) gets its headers alone: before, the install released
    the hold and apt upgraded the driver itself to the security suite's build. The first run meets a
    list refresh that takes the simulated headers (1.0) out of the archive for 1.1: it stops,
    installing nothing; the next run installs 1.1 alone."""
    box = lab.box("deb12")
    version, pin, holds = installed_version(box, "nvidia-driver"), pinned(box), held(box)
    box.ssh(f"dpkg -r linux-headers-{KERNEL} >/dev/null")
    standin.serve_from_local_repo(box, [standin.kernel_headers_deb(lab.dir, version="1.1")], index="Packages.next")
    standin.after_first_simulation(box, f"mv {standin.LOCAL_REPO}/Packages.next {standin.LOCAL_REPO}/Packages && "
                                        "/usr/bin/apt-get update -q >/dev/null 2>&1; echo refreshed $?\n")
    try:
        stopped = deploy(lab, hosts=["deb12"])
    finally:
        standin.remove_standins(box)
    assert "refreshed 0" in standin.hook_log(box)
    assert (f"the archive changed between apt's simulation and the install (a list refresh, such as apt-daily's): the "
            f"approved versions are gone (E: Version '1.0' for 'linux-headers-{KERNEL}' was not found") \
        in stopped.output, stopped.tail(40)
    assert not box.ssh(f"dpkg-query -W -f='${{Status}}' linux-headers-{KERNEL}", check=False).stdout.endswith("installed")
    res = deploy(lab, hosts=["deb12"])
    assert "the headers alone are installed, the driver and its hold stay as they are" in res.output, res.tail(40)
    assert installed_version(box, f"linux-headers-{KERNEL}") == "1.1"
    assert (installed_version(box, "nvidia-driver"), pinned(box), held(box)) == (version, pin, holds)
    log = box.read_text(LOG)
    assert "apt-mark" not in log[log.rindex("+ apt-get update"):]          # no hold released, none set


# ---------------------------------------------------------------- every failure after apt leaves the hold and pin


def back_to_bookworm(box) -> None:
    """The driver back at bookworm's build, held and pinned by the stage's own `hold` (a newer build in
    the archive again, for the next test's update)."""
    box.ssh(f"rm -f {PIN} && apt-mark showhold | xargs -r apt-mark unhold >/dev/null && "
            "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --allow-downgrades --no-install-recommends "
            f"$(dpkg-query -W -f='${{Package}} ${{source:Package}}\\n' | awk '$2 == \"nvidia-graphics-drivers\" "
            f"{{print $1 \"={BOOKWORM}\"}}') >/dev/null 2>&1", timeout=900)
    box.ssh(f"/usr/bin/python3 {LIBEXEC}/nvidia_driver.py hold --plan {LIBEXEC}/driver-plan.json >/dev/null")
    assert installed_version(box, "nvidia-driver") == BOOKWORM and f"Pin: version {BOOKWORM}" in pinned(box)


def source_packages(box) -> set[str]:
    return set(box.ssh("dpkg-query -W -f='${Package} ${source:Package}\\n' | "
                       "awk '$2 == \"nvidia-graphics-drivers\" {print $1}'").stdout.split())


def unconfigured(box) -> list[str]:
    return box.ssh("dpkg -l | awk '$1 ~ /^.[UFH]/ {print $2}'").stdout.split()


def test_a_dkms_failure_midway_leaves_everything_held_and_pinned_and_a_rerun_finishes(lab, converged):
    """The update meets a real DKMS build failure (headers whose build tree fails): Debian's
    nvidia-kernel-dkms postinst fails, dpkg stops part-way with the new user-space libraries
    unpacked. Before, nothing was held after that and nothing said what the box was left with."""
    box = lab.box("deb12")
    standin.install_headers(box, standin.kernel_headers_deb(lab.dir, version="2.0", broken=True))
    newer = re.findall(r"^\s+(535\.\S+) 500\s*$", box.ssh("apt-cache policy nvidia-driver").stdout, re.M)[0]
    res = deploy(lab, hosts=["deb12"], driver_update=True)
    assert res.failed_hosts == ["deb12"]
    out = res.output
    assert f"Error! Bad return status for module build on kernel: {KERNEL}" in out, res.tail(60)
    assert "installed nvidia-kernel-dkms package post-installation script subprocess returned error exit status" in out
    assert "apt stopped part-way: the driver's packages are held, and pinned at the versions the install was taking" \
        in out and "nvidia-kernel-dkms (iF) not configured" in out
    assert "nvidia-kernel-dkms" in unconfigured(box)
    assert source_packages(box) <= held(box) and f"\nPin: version {newer}\nPin-Priority: 1001\n" in pinned(box)
    assert standin.unmasked(box)
    found = [f.rule for f in diagnose("deb12", {"driver.log": box.read_text(LOG)}).findings]
    assert "driver-dpkg-half-configured" in found, found
    # the fix: headers that build (here: the stand-in that DKMS skips), then a re-run finishes the install
    box.ssh(f"dpkg -i /var/tmp/verl-lab-test/linux-headers-{KERNEL}_1.0_amd64.deb >/dev/null 2>&1")
    again = deploy(lab, hosts=["deb12"])
    assert unconfigured(box) == [], again.tail(40)
    assert installed_version(box, "nvidia-driver") == installed_version(box, "nvidia-kernel-dkms") == newer
    assert source_packages(box) <= held(box) and f"\nPin: version {newer}\nPin-Priority: 1001\n" in pinned(box)


def log_size(box) -> int:
    return int(box.ssh(f"stat -c %s {LOG}").stdout)


def apt_installing(box, since: int) -> bool:
    """The stage log says, past byte ``since``, that apt-get install of the driver change runs."""
    return box.ssh(f"tail -c +{since + 1} {LOG} | grep -q '^+ apt-get -y install'", check=False).returncode == 0


def throttled(check, every: float = 2.0):
    state = {"at": 0.0}

    def trigger(_line):
        if time.monotonic() - state["at"] < every:
            return False
        state["at"] = time.monotonic()
        return check()
    return trigger


def test_a_dropped_connection_does_not_stop_apt_and_a_rerun_follows_it(lab, converged):
    """The controller dies with every SSH session it had in the box (killed with all they run) while
    apt installs: apt runs in the job's own unit, so it goes on; a re-run finds the job running and
    follows it to its end (before, apt ran inside the session: killed with it, dpkg half-way)."""
    from tests.e2e.test_drills import Killed
    from tests.e2e.test_drills import run as drill_run

    box = lab.box("deb12")
    back_to_bookworm(box)
    newer = re.findall(r"^\s+(535\.\S+) 500\s*$", box.ssh("apt-cache policy nvidia-driver").stdout, re.M)[0]
    # the job stays in apt-get 60 s after its install: the re-run below finds it running
    standin.after_first_simulation(box, "sleep 60\n", word="-y")
    since = log_size(box)
    try:
        killed = drill_run(lab, ["deploy/driver.py"], ["deb12"], {"driver": "install", "driver_update": True},
                           trigger=throttled(lambda: apt_installing(box, since)), timeout=900)
        assert isinstance(killed, Killed), "the run ended before apt started: nothing was dropped"
        assert box.ssh(f"systemctl is-active {JOB}", check=False).stdout.strip() == "active"
        res = deploy(lab, hosts=["deb12"], driver_update=True)
    finally:
        standin.remove_standins(box)
    assert f"NVIDIA driver: a driver change started earlier is still running on the box ({JOB}): following it to " \
           "its end" in res.output, res.tail(40)
    status = json.loads(box.read_text(STATUS))
    assert status["state"] == "done" and status["rc"] == 0 and status["reported"], status
    assert unconfigured(box) == [] and installed_version(box, "nvidia-driver") == newer
    assert source_packages(box) <= held(box) and f"\nPin: version {newer}\nPin-Priority: 1001\n" in pinned(box)
    assert standin.unmasked(box)


def test_a_killed_job_leaves_the_hold_and_pin_and_unmasks(lab, converged):
    """The job's main process is killed (SIGKILL, as the OOM killer would) while apt installs: its
    unit's ExecStopPost holds and pins the driver's packages where apt was taking them and unmasks the
    units; a re-run finishes the install."""
    box = lab.box("deb12")
    back_to_bookworm(box)
    newer = re.findall(r"^\s+(535\.\S+) 500\s*$", box.ssh("apt-cache policy nvidia-driver").stdout, re.M)[0]
    from tests.e2e.test_drills import run as drill_run

    done, since = [], log_size(box)

    def kill_main():                                         # once; the deploy itself goes on to its end
        if not done and apt_installing(box, since):
            time.sleep(3)
            box.ssh(f"systemctl kill --signal=KILL --kill-whom=main {JOB}")
            done.append(True)
        return False

    res = drill_run(lab, ["deploy/driver.py"], ["deb12"], {"driver": "install", "driver_update": True},
                    trigger=throttled(kill_main, every=1.0), timeout=900)
    assert done, "apt never ran: nothing was killed"
    assert "the driver job ended before it finished (signal (killed KILL))" in res.output, res.tail(40)
    status = json.loads(box.read_text(STATUS))
    assert status["state"] == "done" and status["rc"] == 1
    assert standin.unmasked(box)
    assert source_packages(box) <= held(box) and f"Pin: version {newer}" in pinned(box)
    found = [f.rule for f in diagnose("deb12", {"driver.log": box.read_text(LOG)}).findings]
    assert "driver-job-killed" in found, found
    if box.ssh("ls /var/lib/dpkg/updates", check=False).stdout.split():
        box.ssh("dpkg --configure -a >/dev/null 2>&1", check=False)   # the doctor's fix for an interrupted dpkg
    again = deploy(lab, hosts=["deb12"])
    assert unconfigured(box) == [] and installed_version(box, "nvidia-driver") == newer, \
        box.ssh("dpkg -l | awk '$1 !~ /^[ih]i/ && /nvidia/'", check=False).stdout + again.tail(60)
    assert source_packages(box) <= held(box) and f"\nPin: version {newer}\nPin-Priority: 1001\n" in pinned(box)


def set_dpkg_status(box, package: str, status: str) -> None:
    """``package``'s Status line in dpkg's database set to ``status``, as dpkg writes it."""
    box.ssh("python3 - <<'EOF'\nimport re\npath = '/var/lib/dpkg/status'\nstanzas = open(path).read().split('\\n\\n')\n"
            f"stanzas = [re.sub(r'^Status: .*$', 'Status: {status}', s, flags=re.M) "
            f"if s.startswith('Package: {package}\\n') else s for s in stanzas]\n"
            "open(path, 'w').write('\\n\\n'.join(stanzas))\nEOF")


def test_a_package_whose_unpack_was_cut_is_unpacked_again_and_configured(lab, converged):
    """dpkg killed while it unpacks a package marks it reinst-required (`dpkg -l`: hUR; CI's killed job above left
    xserver-xorg-video-nvidia so at the version apt was taking it to). dpkg refuses to configure it ("a very bad
    inconsistent state") and apt, naming it at that version, only asks dpkg to configure it: every re-run stopped
    there again. The stage now has dpkg unpack such a package again from the archive's file before apt installs. The kill's
    moment cannot be chosen, so the state is written into dpkg's database as dpkg writes it; apt, dpkg and the
    archive's package are real."""
    box = lab.box("deb12")
    version = installed_version(box, "xserver-xorg-video-nvidia")
    if unconfigured(box) or f"Pin: version {version}" not in pinned(box):    # the test above left it otherwise
        back_to_bookworm(box)
        version = BOOKWORM
    set_dpkg_status(box, "xserver-xorg-video-nvidia", "hold reinstreq unpacked")
    assert "hUR" in box.ssh("dpkg -l xserver-xorg-video-nvidia | tail -1").stdout
    since = log_size(box)
    res = deploy(lab, hosts=["deb12"])
    log = box.ssh(f"tail -c +{since + 1} {LOG}").stdout.splitlines()
    assert "dpkg must unpack xserver-xorg-video-nvidia again (its unpack was cut: dpkg refuses to configure it): " \
           "unpacking the archive's file of the same version" in log, res.tail(60)
    unpack = [x for x in log if x.startswith("+ dpkg --unpack")][-1]
    assert unpack.endswith(f"/xserver-xorg-video-nvidia_{version.replace(':', '%3a')}_amd64.deb"), unpack  # it alone
    assert log.index(unpack) < max(i for i, x in enumerate(log) if x.startswith("+ apt-get -y install"))
    assert unconfigured(box) == [] and installed_version(box, "xserver-xorg-video-nvidia") == version, res.tail(60)
    assert source_packages(box) <= held(box) and f"\nPin: version {version}\nPin-Priority: 1001\n" in pinned(box)


def test_the_stop_policy_masks_and_stops_the_units_and_each_failure_after_apt_leaves_the_hold_and_pin(lab, converged):
    """driver_busy = 'stop' with the training and Ray units running: both are masked and stopped; a
    start of the training unit while apt works is refused by systemd ("masked"); apt-mark hold fails
    (dpkg's lock held past the wait): dpkg's selections hold the packages; update-initramfs fails: the
    stage stops there, the update installed, held and pinned, the units unmasked."""
    box = lab.box("deb12")
    back_to_bookworm(box)
    newer = re.findall(r"^\s+(535\.\S+) 500\s*$", box.ssh("apt-cache policy nvidia-driver").stdout, re.M)[0]
    standin.start_unit(box, "running")
    standin.start_unit(box, "ray")
    standin.after_first_simulation(box, f"systemctl start {TRAIN}; echo start $?\n")
    standin.failing_apt_mark_hold(box)
    standin.failing_update_initramfs(box)
    try:
        res = deploy(lab, hosts=["deb12"], driver_update=True, driver_busy="stop")
        units = {u: standin.unit_state(box, u) for u in (TRAIN, RAY)}
    finally:
        standin.remove_standins(box)
        standin.remove_units(box)
    assert res.failed_hosts == ["deb12"]
    out = res.output
    assert f"Failed to start {TRAIN}: Unit {TRAIN} is masked." in standin.hook_log(box)
    assert "start 1" in standin.hook_log(box)
    assert all(u["ActiveState"] == "inactive" and u["UnitFileState"] != "masked-runtime" for u in units.values()), units
    assert "apt-mark hold failed (exit 100): holding through `dpkg --set-selections`" in out, res.tail(60)
    assert f"update-initramfs: failed for /boot/initrd.img-{KERNEL} with 1." in out
    assert "update-initramfs -u failed (exit 1" in out and "the stage does not reboot onto it" in out
    assert f"apt finished the install: the driver's packages are held and pinned at {newer}" in out
    assert installed_version(box, "nvidia-driver") == newer and unconfigured(box) == []
    assert source_packages(box) <= held(box) and f"\nPin: version {newer}\nPin-Priority: 1001\n" in pinned(box)


def test_with_nothing_newer_an_update_on_purpose_changes_nothing(lab, converged):
    box = lab.box("deb12")
    after = installed_version(box, "nvidia-driver")
    deploy(lab, hosts=["deb12"], driver_update=True)          # the plan file follows this run's settings
    again = deploy(lab, hosts=["deb12"], driver_update=True)
    assert again.changed_by_host.get("deb12", 0) == 0, again.changed_ops
    assert installed_version(box, "nvidia-driver") == after
    assert f"no nvidia kernel module {after.split('-')[0]} exists for the running kernel" in again.output


def test_check_mode_asks_and_changes_nothing(lab):
    """driver = "check" (the default): deploy/driver.py runs the base stage only."""
    first = lab.deploy("deploy/driver.py", hosts=["plain"]).assert_ok()
    assert first.changed_ops and all(op.startswith("verl-lab base layout |") for _, op in first.changed_ops)
    lab.deploy("deploy/driver.py", hosts=["plain"]).assert_idempotent()
    assert "NVIDIA driver" not in first.output
    untouched(lab.box("plain"))
