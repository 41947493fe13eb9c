"""The driver stage's plan (pure): refuse, install, hold, settle or done, from the box's driver fact,
its distro and the branch chosen for its GPUs (docs/driver.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tasks.burnin.plan import BURNIN_UNIT
from tasks.driver.choice import BranchChoice, Distro, DriverTable, GpuSeen, choose_branch, load_table
from tasks.driver.sources import headers_packages, parse_sources, sources_to_add
from tasks.driver.status import newer_build
from tasks.gpu_support import min_driver
from tasks.settings import RAY_UNIT, TRAIN_UNIT, LabSettings
from verl_lab_box.nvidia_driver_state import JOB_UNIT, branch_of, installed_from, upstream, verdict
from verl_lab_box.nvidia_driver_units import IDLE, busy_fix, busy_reasons

SOURCES_FILE = "/etc/apt/sources.list.d/verl-lab-nvidia.sources"
PIN_FILE = "/etc/apt/preferences.d/verl-lab-nvidia-driver"
FM_SERVICE = "nvidia-fabricmanager.service"   # the unit NVIDIA's and Ubuntu's Fabric Manager packages ship
BLACKLIST_FILE = "/etc/modprobe.d/verl-lab-blacklist-nouveau.conf"
BLACKLIST = ("# verl-lab driver stage: the NVIDIA driver owns the GPUs; nouveau must not bind them first.\n"
             "blacklist nouveau\noptions nouveau modeset=0\n")
SECURE_BOOT_FIX = (
    "Either turn Secure Boot off in the firmware setup, or enrol a Machine Owner Key and let DKMS sign "
    "the module with it (`mokutil --import /var/lib/dkms/mok.pub` on Debian, "
    "/var/lib/shim-signed/mok/MOK.der on Ubuntu; confirm the enrolment at the next boot's MOK manager) and "
    "install the driver yourself; or, on Ubuntu, install Canonical's signed prebuilt modules "
    "(linux-modules-nvidia-NNN-server-generic). Then keep driver = 'check' for this box")


# ---------------------------------------------------------------- the plan (pure)


@dataclass(frozen=True)
class DriverWant:
    reboot: bool
    lab_root: str
    marker: str
    python: str
    min_branch: int
    table: DriverTable
    # no driver change runs under them (masked for it): training, a cluster member's Ray node, the burn-in
    units: tuple[str, ...] = (TRAIN_UNIT, RAY_UNIT, BURNIN_UNIT)
    update: bool = False                    # driver_update: take a newer build of the held branch
    busy: str = "refuse"                    # driver_busy: refuse, or stop the units for a driver change
    catalog: object = None                  # the host's catalog (torch's archs, CUDA's minimum driver)

    @property
    def libexec(self) -> str:
        return f"{self.lab_root}/libexec/driver"

    @property
    def program(self) -> str:
        return f"{self.libexec}/nvidia_driver.py"

    @property
    def plan_path(self) -> str:
        return f"{self.libexec}/driver-plan.json"

    @property
    def log(self) -> str:
        return f"{self.lab_root}/logs/driver.log"

    @property
    def job_status(self) -> str:
        return f"{self.libexec}/driver-job.json"


def driver_want(settings: LabSettings) -> DriverWant:
    return DriverWant(reboot=settings.driver_reboot, lab_root=settings.lab_root, marker=settings.marker("driver"),
                      python=settings.launcher_python, min_branch=int(min_driver(settings.catalog).split(".")[0]),
                      table=load_table(), catalog=settings.catalog, update=settings.driver_update,
                      busy=settings.driver_busy)


@dataclass(frozen=True)
class DriverFacts:
    os_release: Mapping[str, str]
    state: Mapping                          # DriverState
    gpus: tuple[GpuSeen, ...]
    gpus_from: str
    marker: Mapping[str, str] | None
    paths: Mapping[str, Mapping | None] = field(default_factory=dict)   # PathStates of the placed files


@dataclass(frozen=True)
class DriverPlan:
    action: str                             # refuse | done | install | headers | update | hold | settle | follow
    reason: str
    problems: tuple[str, ...] = ()
    choice: BranchChoice | None = None
    distro: Distro | None = None
    box_plan: Mapping | None = None         # driver-plan.json for the box-side program
    sources: str = ""                       # the deb822 text to place ("" : nothing to add)
    unmask: tuple[str, ...] = ()            # the stage's own masks a run that ended badly left (no job runs)


def refusals(want: DriverWant, facts: DriverFacts, distro: Distro | None) -> list[str]:
    """Why this box cannot get a driver from the stage; checked before anything changes."""
    problems = []
    os_release, state = facts.os_release, facts.state
    if distro is None:
        name = os_release.get("PRETTY_NAME") or f"{os_release.get('ID', 'unknown')} {os_release.get('VERSION_ID', '')}"
        known = ", ".join(d.name for d in want.table.distros)
        problems.append(f"the driver stage does not know {name.strip()!r} (/etc/os-release ID={os_release.get('ID')}, "
                        f"VERSION_ID={os_release.get('VERSION_ID')}): it installs from {known} only. Install the "
                        "driver yourself and keep driver = 'check' for this box")
    sb = state.get("secure_boot") or {}
    if sb.get("state") == "enabled":
        problems.append(f"Secure Boot is on ({sb.get('said')}): the kernel refuses the unsigned module DKMS builds "
                        f"(modprobe: 'Key was rejected by service'). {SECURE_BOOT_FIX}")
    elif sb.get("state") == "unknown":
        problems.append(f"whether Secure Boot is on cannot be told (read: {sb.get('said') or 'nothing'!r}): with it on, "
                        "the kernel refuses the unsigned module DKMS builds. Install mokutil (`apt-get install "
                        "mokutil`; `mokutil --sb-state` answers) and re-run")
    lockdown = state.get("lockdown")
    if lockdown in ("integrity", "confidentiality") and sb.get("state") != "enabled":
        problems.append(f"the kernel is locked down ({lockdown}, /sys/kernel/security/lockdown) although Secure Boot "
                        "is not on: a locked-down kernel loads no unsigned module ('Loading of unsigned module is "
                        "rejected'), and DKMS's is unsigned. Boot without lockdown (the kernel command line's "
                        "lockdown= or module.sig_enforce=1), or sign DKMS's module with an enrolled key and keep "
                        "driver = 'check'")
    run = state.get("runfile") or {}
    unowned = [path for path, owner in (run.get("libs") or {}).items() if owner is None]
    if run.get("uninstaller") or run.get("installer_version") or unowned:
        signs = ([f"{run['uninstaller']} exists"] if run.get("uninstaller") else []) + \
                ([f"/var/log/nvidia-installer.log says installer version {run['installer_version']}"]
                 if run.get("installer_version") else []) + \
                [f"{path} belongs to no package" for path in unowned]
        problems.append(f"this box's NVIDIA driver came from NVIDIA's .run installer ({'; '.join(signs)}): the distro's "
                        "packages would fight it (two libcuda, two kernel modules). verl-lab does not remove it: "
                        "keep driver = 'check', or run `nvidia-uninstall`, reboot, and re-run with driver = 'install'")
    return problems


def busy_problem(state: Mapping, want: DriverWant) -> str | None:
    """Why no driver package may change now: a unit of ``want.units`` in any state but inactive or
    failed ("activating (auto-restart)" restarts the job within its RestartSec), or processes holding
    /dev/nvidia* (new user-space libraries under their loaded module: NVML's "Driver/library version
    mismatch"). With driver_busy = 'stop' only GPU processes outside those units count: the box
    program stops the units."""
    why = busy_reasons(dict(state), want.units, want.busy)
    if not why:
        return None
    return (f"{'; '.join(why)}: the driver stage changes no driver package under a running job (every new process "
            f"would get NVML's 'Driver/library version mismatch'). {busy_fix(want.units, want.busy)}")


def job_running(state: Mapping) -> bool:
    """The stage's apt job (a transient systemd unit) is running: a run that lost its connection."""
    return ((state.get("units") or {}).get(JOB_UNIT) or {}).get("active", "inactive") not in IDLE


def _is_module_package(name: str) -> bool:
    return "nvidia" in name and ("dkms" in name or name.startswith("linux-modules-nvidia"))


def foreign_module(state: Mapping, choice: BranchChoice) -> str | None:
    """An installed NVIDIA kernel module package the stage did not leave there (not its pin's version)
    whose branch is not the chosen one: a 590 from NVIDIA's CUDA repository carries Debian's
    package and source names, and would be planned "hold" on a Pascal box that R590 no longer runs."""
    branch = choice.branch.branch
    pin = state.get("pin") or {}
    for p in state.get("packages", ()):
        got = branch_of(p["version"])
        if not (p["installed"] and _is_module_package(p["name"])) or got is None or got == branch:
            continue
        if p["name"] in (pin.get("packages") or ()) and p["version"] == pin.get("version"):
            continue                        # the stage's own earlier install: it may replace it
        seen = [e["from"] for e in (state.get("archive") or {}).get(p["name"], []) if e["version"] == p["version"]]
        where = seen[0] if seen else "no archive this box lists (a .deb installed by hand, or a repository since removed)"
        window = f"R{choice.low} .. R{choice.high}" if choice.high else f"R{choice.low} or newer"
        outside = "" if choice.low <= got <= (choice.high or got) else \
            f"; R{got} is outside what the GPUs here run ({window})"
        return (f"the installed NVIDIA kernel module is {p['name']} {p['version']} (R{got}, from {where}), but "
                f"R{branch} was chosen ({choice.reason}){outside}. The driver stage does not replace a driver it did "
                f"not install: remove it (`apt-get purge` the packages of {p['source']}, and the repository it "
                "came from), reboot, and re-run; or keep driver = 'check'")
    return None


def gpus_to_check(state: Mapping, gpus: Sequence[GpuSeen]) -> list[dict]:
    """What the install checks against the candidate package's supported-gpus.json: every NVIDIA
    display controller's PCI device ID where the bus is read (a box's truth, whatever named the GPUs
    for the choice), else the GPUs' exact names (a box whose PCI bus shows none: a container)."""
    pci = state.get("pci") or []
    if pci:
        return [{"name": p.get("name") or "Device", "device": p.get("device")} for p in pci]
    return [{"name": g.name, "device": None} for g in dict.fromkeys(gpus)]


def plan_driver(want: DriverWant, facts: DriverFacts) -> DriverPlan:
    distro = want.table.distro(facts.os_release)
    problems = refusals(want, facts, distro)
    choice = None
    if distro is not None:
        choice = choose_branch(facts.gpus, distro, want.table, want.min_branch, want.catalog)
        problems += choice.problems
    if problems:
        return DriverPlan("refuse", "pre-checks failed", tuple(problems), choice, distro)
    branch = choice.branch
    state = facts.state
    ours = set((state.get("pin") or {}).get("packages") or [])
    foreign = foreign_module(state, choice)
    if foreign:
        return DriverPlan("refuse", "pre-checks failed", (foreign,), choice, distro)
    held_elsewhere = sorted(p["name"] for p in state.get("packages", ()) if p["held"] and p["installed"]
                            and p["source"] != branch.source and p["name"] not in ours
                            and p["source"].startswith("nvidia-graphics-drivers"))
    if held_elsewhere:
        return DriverPlan("refuse", "pre-checks failed", (
            f"NVIDIA driver packages of another branch are held, not by verl-lab: {', '.join(held_elsewhere)}. "
            f"Installing R{branch.branch} would have to replace them: `apt-mark unhold` them first, or keep "
            "driver = 'check'",), choice, distro)
    switches = state.get("nvswitches") or []
    if switches and not branch.fabricmanager:
        ids = ", ".join(sorted({f"10de:{s['device']}" for s in switches}))
        return DriverPlan("refuse", "pre-checks failed", (
            f"{len(switches)} NVSwitch(es) on the PCI bus ({ids}): an HGX board, where CUDA needs NVIDIA Fabric "
            f"Manager of the driver's exact version, and {distro.name} ships none (without it the driver loads and "
            "nvidia-smi answers, but CUDA fails with error 802, 'system not ready'). Use Ubuntu 22.04 or 24.04 "
            "(the stage installs nvidia-fabricmanager-NNN there), or install the driver and Fabric Manager of one "
            "version from NVIDIA's CUDA repository yourself (cuda-drivers-fabricmanager-NNN) and keep "
            "driver = 'check'",), choice, distro)
    entries = parse_sources(state.get("sources") or {})
    if not any("main" in e["components"] for e in entries):
        return DriverPlan("refuse", "pre-checks failed", (
            "no enabled apt source with the 'main' component was found (/etc/apt/sources.list, "
            "/etc/apt/sources.list.d/): the driver stage installs from the box's own archive",), choice, distro)
    chosen_for = ", ".join(dict.fromkeys(g.label for g in facts.gpus))
    box_plan = {"branch": branch.branch, "packages": list(branch.packages), "module_package": branch.module_package,
                "source": branch.source, "headers": list(headers_packages(distro, state.get("kernel") or "")),
                "distro": distro.name, "pin": PIN_FILE, "log": want.log, "units": list(want.units), "busy": want.busy,
                "job_status": want.job_status,
                "chosen_for": f"{chosen_for} (read by {facts.gpus_from})", "reason": choice.reason,
                "fabricmanager": {"package": branch.fabricmanager, "service": FM_SERVICE} if switches else None,
                "supported_gpus": {"package": branch.supported_gpus, "unlisted": list(want.table.unlisted)}
                if branch.supported_gpus else None,
                "gpus": gpus_to_check(state, facts.gpus), "update": want.update}
    running = job_running(state)
    common = dict(choice=choice, distro=distro, box_plan=box_plan,
                  sources=sources_to_add(entries, distro.components, state.get("origins") or {}, distro.origin),
                  unmask=() if running else tuple(state.get("masks") or ()))
    if running:                             # an earlier run's apt goes on: follow it, judge nothing under it
        return DriverPlan("follow", f"a driver change started earlier is still running on the box ({JOB_UNIT}): "
                                    "following it to its end", **common)

    pkgs = installed_from(state, branch.source)
    module = next((p for p in pkgs if p["name"] == branch.module_package), None)
    names = {p["name"] for p in pkgs}
    fm = next((p for p in state.get("packages", ()) if switches and p["name"] == branch.fabricmanager
               and p["installed"]), None)
    # a change that stopped part-way (dpkg's maintainer script failed, apt or the job killed): packages
    # of the branch unpacked but not configured; the install finishes it at the versions pinned then
    unfinished = sorted(f"{p['name']} ({p.get('status')})" for p in state.get("packages", ())
                        if (p["source"] == branch.source or p["name"] == branch.fabricmanager)
                        and (p.get("status") or "ii")[1:2] in ("U", "F", "H"))
    if (unfinished or module is None or branch_of(module["version"]) != branch.branch
            or not set(branch.packages) <= names or {p["version"] for p in pkgs} != {module["version"]}
            or (switches and (fm is None or upstream(fm["version"]) != upstream(module["version"])))):
        have = module["version"] if module else "none"
        busy = busy_problem(state, want)
        if busy:
            return DriverPlan("refuse", "the GPUs are in use", (busy,), choice, distro)
        if unfinished:
            return DriverPlan("install", f"dpkg left {', '.join(unfinished)} of {branch.source} not configured (a "
                                         "driver change that stopped part-way): finishing it", **common)
        return DriverPlan("install", f"R{branch.branch} from {distro.name}'s {branch.source} (installed now: {have})",
                          **common)
    if not state.get("headers_installed"):
        return DriverPlan("headers", f"{branch.source} {module['version']} is installed, not the running kernel's "
                                     f"headers ({box_plan['headers'][0]}) DKMS builds its module with: the headers "
                                     "alone are installed, the driver and its hold stay as they are", **common)
    version = module["version"]
    pin = state.get("pin") or {}
    held = [*pkgs, *([fm] if fm else [])]
    if (not all(p["held"] for p in held) or pin.get("version") != version
            or set(pin.get("packages") or ()) != {p["name"] for p in held}):
        return DriverPlan("hold", f"{branch.source} {version} is installed; holding and pinning it", **common)
    newer = newer_build(state, branch, version) if want.update else None
    if newer:
        busy = busy_problem(state, want)
        if busy:
            return DriverPlan("refuse", "the GPUs are in use", (busy,), choice, distro)
        return DriverPlan("update", f"{branch.source} {version} -> {newer}: the held branch's newer build, taken on "
                                    "purpose (driver_update); the pin moves once apt proved it", **common)
    v = verdict(dict(state), branch.module_package)
    marker = facts.marker or {}
    if (v["verdict"] == "loaded" and marker.get("branch") == str(branch.branch)
            and marker.get("version") == upstream(version)):
        return DriverPlan("done", f"NVIDIA driver {upstream(version)} (R{branch.branch}) installed, held, loaded "
                                  "and proven", **common)
    return DriverPlan("settle", f"{branch.source} {version} is installed and held; {v['reason']}", **common)


def initramfs_rebuild(placed: Mapping[str, str | None], action: str) -> bool:
    """The nouveau blacklist was (re)placed this run and no install rebuilds the initramfs after it:
    rebuild it here, or nouveau still binds the GPUs first at the next boot."""
    return bool(placed.get(BLACKLIST_FILE)) and action not in ("install", "update", "follow")


def refusal_text(host_name: str, problems: Sequence[str]) -> str:
    return "\n".join([f"verl-lab driver: {host_name}: nothing was changed by the driver stage:"]
                     + [f"  - {p}" for p in problems])
