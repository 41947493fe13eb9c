"""Stage: the NVIDIA driver, before CUDA. ``driver = "check"`` (the default) leaves it to the CUDA
stage's check (a driver older than CUDA 11.8 needs is refused there) and asks the box nothing;
``driver = "install"`` chooses, installs, holds and proves it.

The choice (``choose_branch``, pure): the newest branch of the box's distro (files/drivers.toml)
that supports every GPU of the box and CUDA 11.8: never past R580 for Maxwell, Pascal and Volta;
a GPU the pinned stack cannot run at all (Kepler: R470 is its last; Blackwell) is refused in
tasks/gpu_support.py's words, the architectures and their last branches being its table. The GPUs
come from the host's GPU fact (nvidia-smi), else from the PCI bus (lspci's chip codes: a box
without a working driver), else from ``gpu_override``.

The install (``verl_lab_box/nvidia_driver.py``, run on the box): the distro's own packages
(Debian 12: non-free ``nvidia-driver``; Ubuntu 22.04/24.04: the headless members of the
``nvidia-driver-NNN-server`` family) with the running kernel's headers for DKMS, after apt's
``--simulate`` resolved them and showed only the chosen branch; the packages built from the
driver's source package held (``apt-mark hold``) and pinned at the installed version
(``/etc/apt/preferences.d/verl-lab-nvidia-driver``, priority 1001), so unattended upgrades
cannot replace the user-space libraries under the loaded module; nouveau blacklisted.

Then the installed module must run: loaded already, or loaded now by modprobe when nothing holds
the GPU, or after a reboot (another nvidia module or nouveau holds it). A reboot happens only with
``driver_reboot = true``, one box at a time (``_serial``), never while the training unit is active;
the stage waits for the box to come back. The proof (``nvidia_driver.py prove``):
/proc/driver/nvidia/version and nvidia-smi say the installed version; only then is
``markers/driver.done`` written. A box that needs a reboot without ``driver_reboot`` fails with
that reason (the packages are installed and held; a re-run after the reboot proves it).

Refused before anything changes: an unknown distro, Secure Boot on (DKMS's module is unsigned),
a GPU no allowed branch supports, a driver from NVIDIA's .run installer, driver packages of
another branch held by someone else.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, deploy, operation
from pyinfra.facts.server import LinuxDistribution
from pyinfra.operations import server

from tasks.catalog import REPO_ROOT, tomllib
from tasks.failure import fail_host
from tasks.facts.bundle import ask
from tasks.facts.driver import DriverState
from tasks.facts.files import Marker, PathStates
from tasks.facts.gpu import GpuInventory, parse_compute_capability
from tasks.gpu_support import ARCHITECTURES, architecture, min_driver, refusal
from tasks.placed import OnBox, marker_command, place, wanted_dir, wanted_file
from tasks.settings import TRAIN_UNIT, LabSettings
from tasks.target import HostTarget
from verl_lab_box.nvidia_driver import installed_from, upstream, verdict

DRIVERS_PATH = REPO_ROOT / "files" / "drivers.toml"
BOX_PACKAGE = REPO_ROOT / "verl_lab_box"
SOURCES_FILE = "/etc/apt/sources.list.d/verl-lab-nvidia.sources"
PIN_FILE = "/etc/apt/preferences.d/verl-lab-nvidia-driver"
BLACKLIST_FILE = "/etc/modprobe.d/verl-lab-blacklist-nouveau.conf"
BLACKLIST = ("# verl-lab driver stage: the NVIDIA driver owns the GPUs; nouveau must not bind them first.\n"
             "blacklist nouveau\noptions nouveau modeset=0\n")
SECURE_BOOT_FIX = (
    "Either turn Secure Boot off in the firmware setup, or enrol a Machine Owner Key and let DKMS sign "
    "the module with it (`mokutil --import /var/lib/dkms/mok.pub` on Debian, "
    "/var/lib/shim-signed/mok/MOK.der on Ubuntu; confirm the enrolment at the next boot's MOK manager) and "
    "install the driver yourself; or, on Ubuntu, install Canonical's signed prebuilt modules "
    "(linux-modules-nvidia-NNN-server-generic). Then keep driver = 'check' for this box")
REBOOT_WAIT_S = 900


# ---------------------------------------------------------------- the table (files/drivers.toml)


@dataclass(frozen=True)
class DistroBranch:
    branch: int
    packages: tuple[str, ...]
    module_package: str                     # its version is the kernel module's
    source: str                             # the source package every held binary comes from


@dataclass(frozen=True)
class Distro:
    id: str
    version: str
    name: str
    components: tuple[str, ...]
    branches: tuple[DistroBranch, ...]


@dataclass(frozen=True)
class DriverTable:
    chips: Mapping[str, str]                # lspci's chip code -> architecture (tasks/gpu_support.py's names)
    products: tuple[tuple[str, int], ...]   # (a word of the GPU's name, its first branch)
    distros: tuple[Distro, ...]

    def distro(self, os_release: Mapping[str, str]) -> Distro | None:
        return next((d for d in self.distros if (d.id, d.version) ==
                     (os_release.get("ID"), os_release.get("VERSION_ID"))), None)

    def chip_cc(self, pci_name: str) -> str | None:
        """The lowest compute capability of the architecture lspci's chip code names ("GP102GL" ->
        Pascal -> "6.0"), or None where the code is not known."""
        m = re.match(r"^([A-Z]{2})\d", pci_name or "")
        arch = self.chips.get(m.group(1)) if m else None
        return next((f"{cc[0]}.{cc[1]}" for cc, name, _ in ARCHITECTURES if name == arch), None)


def load_table(path: Path = DRIVERS_PATH) -> DriverTable:
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    return DriverTable(
        chips=dict(raw["chips"]),
        products=tuple((p["match"], p["first_branch"]) for p in raw.get("product", [])),
        distros=tuple(Distro(d["id"], d["version"], d["name"], tuple(d["components"]),
                             tuple(DistroBranch(b["branch"], tuple(b["packages"]), b["module_package"], b["source"])
                                   for b in d["branch"])) for d in raw["distro"]),
    )


# ---------------------------------------------------------------- the branch choice (pure)


@dataclass(frozen=True)
class GpuSeen:
    """One GPU as the choice sees it."""

    name: str
    compute_capability: str | None = None   # nvidia-smi / gpu_override
    pci_name: str | None = None             # lspci: "GP102GL [Tesla P40]"

    @property
    def label(self) -> str:
        return f"{self.name} ({self.compute_capability})" if self.compute_capability else self.name


def gpus_seen(inventory: GpuInventory | None, pci: Sequence[Mapping], override: Mapping | None
              ) -> tuple[tuple[GpuSeen, ...], str]:
    """The box's GPUs and where they were read: nvidia-smi, else the PCI bus, else gpu_override."""
    if inventory is not None and inventory.gpus:
        return tuple(GpuSeen(g.name, g.compute_capability) for g in inventory.gpus), "nvidia-smi"
    if pci:
        return tuple(GpuSeen(f"{p.get('name') or 'Device'} (PCI 10de:{p.get('device')})", None, p.get("name") or "")
                     for p in pci), "lspci"
    if override:
        return (GpuSeen(override["name"], override["compute_capability"]),) * int(override.get("count", 1)), \
            "gpu_override"
    return (), "none"


@dataclass(frozen=True)
class BranchChoice:
    branch: DistroBranch | None
    reason: str
    problems: tuple[str, ...] = ()


def _window(gpu: GpuSeen, table: DriverTable, min_branch: int, catalog=None) -> tuple[int, int | None, str] | str:
    """(lowest, highest or None, why) of the branches that run this GPU and CUDA 11.8, or a problem."""
    cc = gpu.compute_capability or table.chip_cc(gpu.pci_name or "")
    if cc is None:
        return (f"{gpu.name}: its architecture cannot be told (lspci calls it {gpu.pci_name or 'nothing'!r}, and no "
                "driver answers nvidia-smi). Set gpu_override (its compute_capability decides), or install the "
                "driver yourself and keep driver = 'check'")
    refused = refusal([cc], catalog)        # the words every plan refuses this GPU with
    if refused:
        return f"{gpu.label}: {refused[0]} {refused[1]}"
    arch, last = architecture(parse_compute_capability(cc))
    low, why = min_branch, arch
    for word, first in table.products:
        if re.search(rf"\b{re.escape(word)}\b", f"{gpu.name} {gpu.pci_name or ''}", re.I) and first > low:
            low, why = first, f"{arch}, the {word} needs R{first} or newer"
    if last is not None:
        why += f", supported up to R{last}"
    return low, last, why


def choose_branch(gpus: Sequence[GpuSeen], distro: Distro, table: DriverTable, min_branch: int,
                  catalog=None) -> BranchChoice:
    """The newest branch ``distro`` ships that runs every GPU and CUDA 11.8 (>= ``min_branch``); a GPU
    the pinned stack cannot run at all (tasks/gpu_support.py: Kepler, Blackwell) is refused."""
    if not gpus:
        return BranchChoice(None, "", ("no GPU to choose a driver for: nvidia-smi lists none and lspci shows no "
                                       "NVIDIA display controller. Set gpu_override to name the GPU",))
    windows, problems = [], []
    for gpu in gpus:
        w = _window(gpu, table, min_branch, catalog)
        (problems.append(w) if isinstance(w, str) else windows.append((gpu, w)))
    if problems:
        return BranchChoice(None, "", tuple(dict.fromkeys(problems)))
    low = max(w[0] for _, w in windows)
    highs = [w[1] for _, w in windows if w[1] is not None]
    high = min(highs) if highs else None
    fits = [b for b in distro.branches if b.branch >= low and (high is None or b.branch <= high)]
    per_gpu = "; ".join(dict.fromkeys(f"{g.label}: {w[2]}" for g, w in windows))
    if not fits:
        shipped = ", ".join(f"R{b.branch}" for b in distro.branches)
        want = f"R{low} .. R{high}" if high else f"R{low} or newer"
        return BranchChoice(None, "", (f"{distro.name} ships {shipped}; this box needs {want} ({per_gpu}). Use a "
                                       "distro that ships such a branch, or install the driver yourself and keep "
                                       "driver = 'check'",))
    best = max(fits, key=lambda b: b.branch)
    return BranchChoice(best, f"R{best.branch}: the newest branch {distro.name} ships that runs CUDA 11.8 (R{min_branch}+) "
                              f"and every GPU here ({per_gpu})")


# ---------------------------------------------------------------- apt sources (pure)


def parse_sources(files: Mapping[str, str]) -> list[dict]:
    """apt sources (one-line ``.list`` and deb822 ``.sources``) -> [{"uris", "suites", "components",
    "signed_by"}] of the enabled ``deb`` entries."""
    entries = []
    for path, text in sorted(files.items()):
        if path.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields: dict[str, str] = {}
                key = None
                for line in stanza.splitlines():
                    if line.startswith("#"):
                        continue
                    if line[:1] in (" ", "\t") and key:
                        fields[key] += " " + line.strip()
                    elif ":" in line:
                        key, _, value = line.partition(":")
                        key = key.strip().lower()
                        fields[key] = value.strip()
                if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes").lower() != "no":
                    entries.append({"uris": fields.get("uris", "").split(), "suites": fields.get("suites", "").split(),
                                    "components": fields.get("components", "").split(),
                                    "signed_by": fields.get("signed-by", "").split()[0] if fields.get("signed-by") else ""})
            continue
        for line in text.splitlines():
            m = re.match(r"^\s*deb\s+(?:\[(?P<opts>[^\]]*)\]\s+)?(?P<uri>\S+)\s+(?P<suite>\S+)\s*(?P<comps>.*)$", line)
            if m:
                opts = dict(o.split("=", 1) for o in (m.group("opts") or "").split() if "=" in o)
                entries.append({"uris": [m.group("uri")], "suites": [m.group("suite")],
                                "components": m.group("comps").split("#")[0].split(),
                                "signed_by": opts.get("signed-by", "")})
    return entries


def sources_to_add(entries: Sequence[Mapping], components: Sequence[str]) -> str:
    """The deb822 text that adds ``components`` to every (URI, suite) whose entries carry ``main``
    without them; "" when nothing is missing."""
    have: dict[tuple[str, str], set[str]] = {}
    signed: dict[str, str] = {}
    for e in entries:
        for uri in e["uris"]:
            for suite in e["suites"]:
                have.setdefault((uri, suite), set()).update(e["components"])
                signed.setdefault(uri, e.get("signed_by") or "")
    missing: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for (uri, suite), comps in have.items():
        lack = tuple(c for c in components if c not in comps)
        if "main" in comps and lack:
            missing.setdefault((uri, lack), []).append(suite)
    stanzas = []
    for (uri, lack), suites in sorted(missing.items()):
        lines = ["Types: deb", f"URIs: {uri}", f"Suites: {' '.join(suites)}", f"Components: {' '.join(lack)}"]
        if signed.get(uri):
            lines.append(f"Signed-By: {signed[uri]}")
        stanzas.append("\n".join(lines) + "\n")
    if not stanzas:
        return ""
    return ("# verl-lab driver stage: the archive components the NVIDIA driver packages live in, for this box's\n"
            "# own mirrors and suites.\n\n" + "\n".join(stanzas))


def headers_packages(distro: Distro, kernel: str) -> tuple[str, ...]:
    """The running kernel's headers (DKMS builds the module against them) and, on Debian, the
    flavour's headers metapackage, so the next kernel the archive brings gets its headers too
    (Ubuntu's linux-generic already depends on linux-headers-generic)."""
    out = [f"linux-headers-{kernel}"]
    m = re.match(r"^\d+\.\d+\.\d+-\d+-(?P<flavour>[a-z0-9-]+)$", kernel)
    if distro.id == "debian" and m:
        out.append(f"linux-headers-{m.group('flavour')}")
    return tuple(out)


# ---------------------------------------------------------------- the plan (pure)


@dataclass(frozen=True)
class DriverWant:
    reboot: bool
    lab_root: str
    marker: str
    python: str
    min_branch: int
    table: DriverTable
    unit: str = TRAIN_UNIT
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


def driver_want(settings: LabSettings) -> DriverWant:
    return DriverWant(reboot=settings.driver_reboot, lab_root=settings.lab_root, marker=settings.marker("driver"),
                      python=settings.launcher_python, min_branch=int(min_driver(settings.catalog).split(".")[0]),
                      table=load_table(), catalog=settings.catalog)


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
    action: str                             # refuse | done | install | hold | settle
    reason: str
    problems: tuple[str, ...] = ()
    choice: BranchChoice | None = None
    distro: Distro | None = None
    box_plan: Mapping | None = None         # driver-plan.json for the box-side program
    sources: str = ""                       # the deb822 text to place ("" : nothing to add)


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
    held_elsewhere = sorted(p["name"] for p in state.get("packages", ()) if p["held"] and p["installed"]
                            and p["source"] != branch.source and p["name"] not in ours
                            and p["source"].startswith("nvidia-graphics-drivers"))
    if held_elsewhere:
        return DriverPlan("refuse", "pre-checks failed", (
            f"NVIDIA driver packages of another branch are held, not by verl-lab: {', '.join(held_elsewhere)}. "
            f"Installing R{branch.branch} would have to replace them: `apt-mark unhold` them first, or keep "
            "driver = 'check'",), choice, distro)
    entries = parse_sources(state.get("sources") or {})
    if not any("main" in e["components"] for e in entries):
        return DriverPlan("refuse", "pre-checks failed", (
            "no enabled apt source with the 'main' component was found (/etc/apt/sources.list, "
            "/etc/apt/sources.list.d/): the driver stage installs from the box's own archive",), choice, distro)
    chosen_for = ", ".join(dict.fromkeys(g.label for g in facts.gpus))
    box_plan = {"branch": branch.branch, "packages": list(branch.packages), "module_package": branch.module_package,
                "source": branch.source, "headers": list(headers_packages(distro, state.get("kernel") or "")),
                "distro": distro.name, "pin": PIN_FILE, "log": want.log, "unit": want.unit,
                "chosen_for": f"{chosen_for} (read by {facts.gpus_from})", "reason": choice.reason}
    common = dict(choice=choice, distro=distro, box_plan=box_plan,
                  sources=sources_to_add(entries, distro.components))

    pkgs = installed_from(state, branch.source)
    module = next((p for p in pkgs if p["name"] == branch.module_package), None)
    names = {p["name"] for p in pkgs}
    if module is None or not set(branch.packages) <= names or {p["version"] for p in pkgs} != {module["version"]}:
        have = module["version"] if module else "none"
        return DriverPlan("install", f"R{branch.branch} from {distro.name}'s {branch.source} (installed now: {have})",
                          **common)
    if not state.get("headers_installed"):
        return DriverPlan("install", f"{branch.source} {module['version']} is installed, not the running kernel's "
                                     f"headers ({box_plan['headers'][0]}) DKMS builds its module with", **common)
    version = module["version"]
    pin = state.get("pin") or {}
    if not all(p["held"] for p in pkgs) or pin.get("version") != version or set(pin.get("packages") or ()) != names:
        return DriverPlan("hold", f"{branch.source} {version} is installed; holding and pinning it", **common)
    v = verdict(dict(state), branch.module_package)
    marker = facts.marker or {}
    if (v["verdict"] == "loaded" and marker.get("branch") == str(branch.branch)
            and marker.get("version") == upstream(version)):
        return DriverPlan("done", f"NVIDIA driver {upstream(version)} (R{branch.branch}) installed, held, loaded "
                                  "and proven", **common)
    return DriverPlan("settle", f"{branch.source} {version} is installed and held; {v['reason']}", **common)


def refusal_text(host_name: str, problems: Sequence[str]) -> str:
    return "\n".join([f"verl-lab driver: {host_name}: nothing was changed by the driver stage:"]
                     + [f"  - {p}" for p in problems])


# ---------------------------------------------------------------- pyinfra


def placed_files(want: DriverWant, plan: DriverPlan) -> list:
    files = [wanted_dir(f"{want.lab_root}/libexec"), wanted_dir(want.libexec, mode="700"),
             wanted_file(f"{want.libexec}/nvidia_driver.py", "driver stage program",
                         (BOX_PACKAGE / "nvidia_driver.py").read_bytes(), mode="700"),
             wanted_file(f"{want.libexec}/verl_lab_gpu.py", "GPU reader beside it",
                         (BOX_PACKAGE / "gpu.py").read_bytes()),
             wanted_file(want.plan_path, "driver plan", json.dumps(plan.box_plan, indent=1, sort_keys=True) + "\n",
                         mode="600"),
             wanted_file(BLACKLIST_FILE, "nouveau blacklisted", BLACKLIST)]
    if plan.sources:
        files.append(wanted_file(SOURCES_FILE, "apt components of the NVIDIA driver", plan.sources))
    return files


def gather_facts(settings: LabSettings, want: DriverWant, gpu: HostTarget) -> DriverFacts:
    """One command: the distro, the driver fact, the marker and the placed files' states."""
    paths = [f"{want.lab_root}/libexec", want.libexec, f"{want.libexec}/nvidia_driver.py",
             f"{want.libexec}/verl_lab_gpu.py", want.plan_path, BLACKLIST_FILE, SOURCES_FILE]
    distro, state, marker, states = ask(
        (LinuxDistribution, {}), (DriverState, {"pin": PIN_FILE, "unit": want.unit, "skip_sources": SOURCES_FILE}),
        (Marker, {"path": want.marker}), (PathStates, {"paths": paths}))
    state = state or DriverState.default()
    gpus, source = gpus_seen(gpu.inventory, state.get("pci") or (), settings.gpu_override)
    return DriverFacts(os_release=(distro or {}).get("release_meta") or {}, state=state, gpus=gpus, gpus_from=source,
                       marker=marker, paths=states or {})


def _say(target, message: str) -> None:
    target.log_styled(message, fg="red", log_func=logger.error)


def _run(target, command: str):
    """(ok, output) of a shell command on ``target`` (the stage connects as root)."""
    return target.run_shell_command(StringCommand(command))


def _settle(state, host, python: str, program: str, plan_path: str, reboot: bool, unit: str, wait_s: int):
    """At execute time: load the installed module, or reboot the box for it (when allowed), or stop."""
    q = shlex.quote
    cmd = f"{q(python)} {q(program)} verdict --plan {q(plan_path)}"
    ok, out = _run(host, cmd)
    try:
        v = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        _say(host, f"verl-lab driver: {host.name}: `{cmd}` gave no verdict: {out.output[-400:]}")
        return False
    if v["verdict"] == "loaded":
        return True
    if v["verdict"] == "load":
        ok, out = _run(host, f"{q(python)} {q(program)} load --plan {q(plan_path)}")
        if not ok:
            _say(host, f"verl-lab driver: {host.name}: modprobe nvidia failed: {out.output[-600:]}")
        return ok
    if v["verdict"] != "reboot":
        _say(host, f"verl-lab driver: {host.name}: the driver {v['installed']} is installed and held, but {v['reason']}")
        return False
    if not reboot:
        _say(host, f"verl-lab driver: {host.name}: reboot needed: the driver {v['installed']} is installed and held, but "
             f"{v['reason']}. Reboot the box and re-run, or set driver_reboot = True to let the stage reboot it "
             "(one box at a time, never while training runs)")
        return False
    ok, _ = _run(host, f"systemctl is-active --quiet {q(unit)}")
    if ok:
        _say(host, f"verl-lab driver: {host.name}: reboot needed for the driver {v['installed']}, but {unit} is active: "
             "not rebooting a box that trains. Stop it (or let it finish) and re-run")
        return False
    return reboot_and_wait(host, wait_s)


REBOOT_TOKEN = "/run/verl-lab-driver-reboot"   # /run is emptied by every boot


def reboot_and_wait(host, wait_s: int) -> bool:
    """Reboot the box and wait until it answers again with a new boot (the token under /run gone) and
    systemd has finished starting."""
    import time

    ok, _ = _run(host, f"touch {REBOOT_TOKEN} && ( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")
    if not ok:
        _say(host, f"verl-lab driver: {host.name}: could not start the reboot")
        return False
    logger.info(f"[{host.name}] verl-lab driver: rebooting to load the installed driver")
    time.sleep(5)
    host.disconnect()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        host.connect(show_errors=False)
        if host.connected:
            ok, _ = _run(host, f"test ! -e {REBOOT_TOKEN} && "
                                           "timeout 120 systemctl is-system-running --wait >/dev/null; "
                                           f"test ! -e {REBOOT_TOKEN}")
            if ok:
                return True
            host.disconnect()
        time.sleep(3)
    _say(host, f"verl-lab driver: {host.name}: the box did not come back within {wait_s} s of its reboot")
    return False


@operation(is_idempotent=False)
def settle_driver(python: str, program: str, plan_path: str, reboot: bool, unit: str, wait_s: int = REBOOT_WAIT_S):
    """Load the installed NVIDIA module: modprobe where nothing holds the GPU; a reboot where another
    module or nouveau does (only with ``reboot``, never while ``unit`` is active; run with
    ``_serial=True`` so boxes reboot one at a time); else fail the host with the reason.

    .. code:: python

        settle_driver(name="Load the driver", python="/usr/bin/python3", program=".../nvidia_driver.py",
                      plan_path=".../driver-plan.json", reboot=False, unit="verl-lab-train.service",
                      _serial=True)
    """
    yield FunctionCommand(_settle, (python, program, plan_path, reboot, unit, wait_s), {})


@deploy("NVIDIA driver")
def install_driver(settings: LabSettings, gpu: HostTarget) -> HostTarget:
    """With ``driver = "install"``: choose, install, hold and prove the NVIDIA driver; return the
    host's target with the driver stage's result (the CUDA stage then trusts the proven driver)."""
    if settings.driver != "install":
        return gpu
    want = driver_want(settings)
    facts = gather_facts(settings, want, gpu)
    plan = plan_driver(want, facts)
    if plan.action == "refuse":
        text = refusal_text(settings.host, plan.problems)
        fail_host(name="NVIDIA driver pre-checks failed (nothing changed)", message=text)
        return replace(gpu, refused=text)          # deploy/full.py queues nothing after it
    managed = replace(gpu, driver_stage=f"R{plan.choice.branch.branch}, installed and proven by the driver stage "
                                        "before this stage runs")
    place(placed_files(want, plan), dict(facts.paths))     # a proven box too: a removed blacklist comes back
    if plan.action == "done":
        host.noop(plan.reason)
        return managed
    q = shlex.quote
    run = f"{q(want.python)} {q(want.program)} {{}} --plan {q(want.plan_path)}"
    if plan.action == "install":
        server.shell(name=f"NVIDIA driver: install {plan.choice.reason}", commands=[run.format("install")])
    elif plan.action == "hold":
        server.shell(name=f"NVIDIA driver: {plan.reason}", commands=[run.format("hold")])
    settle_driver(name=f"NVIDIA driver: load R{plan.choice.branch.branch} (reboot: "
                       f"{'allowed' if want.reboot else 'not allowed'})",
                  python=want.python, program=want.program, plan_path=want.plan_path, reboot=want.reboot,
                  unit=want.unit, _serial=True)
    marker = marker_command(want.marker, [
        ("stage", "driver"), ("branch", str(plan.choice.branch.branch)), ("version", OnBox("$v")),
        ("source", plan.choice.branch.source), ("distro", plan.distro.name),
        ("written", OnBox("$(date -u +%Y-%m-%dT%H:%M:%SZ)"))])
    server.shell(name="NVIDIA driver: prove (/proc/driver/nvidia/version, nvidia-smi) and mark",
                 commands=[f"v=$({run.format('prove')}) && {marker}"])
    if gpu.target is None:
        text = (f"verl-lab driver: {settings.host}: the NVIDIA driver is installed and proven; the GPU list every "
                "later stage plans for is read once, before the stages, when this box had no working driver: re-run "
                "the deploy to provision the rest for its GPUs")
        fail_host(name="GPUs are read before the stages", message=text)
        return replace(managed, refused=text)
    return managed
