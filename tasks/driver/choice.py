"""The driver stage's branch choice (pure): files/drivers.toml read into a table, the box's GPUs as
the choice sees them (nvidia-smi, the PCI bus, gpu_override), and the newest branch of the box's
distro that runs every GPU and CUDA 11.8 (docs/driver.md, "The choice")."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tasks.catalog import REPO_ROOT, tomllib
from tasks.facts.gpu import GpuInventory, parse_compute_capability
from tasks.gpu_support import ARCHITECTURES, architecture, refusal

DRIVERS_PATH = REPO_ROOT / "files" / "drivers.toml"


# ---------------------------------------------------------------- the table (files/drivers.toml)


@dataclass(frozen=True)
class DistroBranch:
    branch: int
    packages: tuple[str, ...]
    module_package: str                     # its version is the kernel module's
    source: str                             # the source package every held binary comes from
    fabricmanager: str | None = None        # NVIDIA Fabric Manager of this branch (NVSwitch boxes); None: not shipped
    supported_gpus: str | None = None       # the package whose supported-gpus.json the install checks the GPUs against
    end_of_life: str | None = None          # "2026-06": NVIDIA's end of the branch's support


@dataclass(frozen=True)
class Distro:
    id: str
    version: str
    name: str
    components: tuple[str, ...]
    branches: tuple[DistroBranch, ...]
    origin: str = ""                        # the Origin its archive's Release files carry ("Debian")

    @property
    def codename(self) -> str:
        """"bookworm" of "Debian 12 (bookworm)"."""
        m = re.search(r"\((\w+)\)", self.name)
        return m.group(1) if m else ""


@dataclass(frozen=True)
class DriverTable:
    chips: Mapping[str, str]                # lspci's chip code -> architecture (tasks/gpu_support.py's names)
    products: tuple[tuple[frozenset, tuple, int], ...]   # (PCI device IDs, nvidia-smi's exact names, first branch)
    distros: tuple[Distro, ...]
    unlisted: tuple[Mapping, ...] = ()      # supported GPUs NVIDIA's supported-gpus.json leaves out

    def distro(self, os_release: Mapping[str, str]) -> Distro | None:
        return next((d for d in self.distros if (d.id, d.version) ==
                     (os_release.get("ID"), os_release.get("VERSION_ID"))), None)

    def watch(self) -> list[str]:
        """The module packages of every branch the table knows: their archive versions are read."""
        return sorted({b.module_package for d in self.distros for b in d.branches})

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
        products=tuple((frozenset(d.lower() for d in p["devices"]), tuple(p["names"]),
                        p["first_branch"]) for p in raw.get("product", [])),
        unlisted=tuple(dict(u) for u in raw.get("unlisted", [])),
        distros=tuple(Distro(d["id"], d["version"], d["name"], tuple(d["components"]),
                             tuple(DistroBranch(b["branch"], tuple(b["packages"]), b["module_package"], b["source"],
                                                b.get("fabricmanager"), b.get("supported_gpus"),
                                                b.get("end_of_life"))
                                   for b in d["branch"]), d.get("origin", "")) for d in raw["distro"]),
    )


# ---------------------------------------------------------------- the branch choice (pure)


@dataclass(frozen=True)
class GpuSeen:
    """One GPU as the choice sees it."""

    name: str
    compute_capability: str | None = None   # nvidia-smi / gpu_override
    pci_name: str | None = None             # lspci: "GP102GL [Tesla P40]"
    device: str | None = None               # lspci: the PCI device ID, "1b38"

    @property
    def label(self) -> str:
        return f"{self.name} ({self.compute_capability})" if self.compute_capability else self.name


def gpus_seen(inventory: GpuInventory | None, pci: Sequence[Mapping], override: Mapping | None
              ) -> tuple[tuple[GpuSeen, ...], str]:
    """The box's GPUs and where they were read: gpu_override where it is set (the user's word wins:
    the refusal "architecture cannot be told" tells them to set it), else nvidia-smi, else the PCI bus."""
    if override:
        return (GpuSeen(override["name"], override["compute_capability"]),) * int(override.get("count", 1)), \
            "gpu_override"
    if inventory is not None and inventory.gpus:
        return tuple(GpuSeen(g.name, g.compute_capability) for g in inventory.gpus), "nvidia-smi"
    if pci:
        return tuple(GpuSeen(f"{p.get('name') or 'Device'} (PCI 10de:{p.get('device')})", None, p.get("name") or "",
                             p.get("device")) for p in pci), "lspci"
    return (), "none"


@dataclass(frozen=True)
class BranchChoice:
    branch: DistroBranch | None
    reason: str
    problems: tuple[str, ...] = ()
    low: int = 0                            # the branches every GPU here runs: low .. high (None: no end)
    high: int | None = None


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
    for devices, names, first in table.products:
        known = gpu.device.lower() in devices if gpu.device else gpu.name.strip().lower() in {n.lower() for n in names}
        if known and first > low:
            low, why = first, f"{arch}, the {names[0] if names else gpu.name} needs R{first} or newer"
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
                              f"and every GPU here ({per_gpu})", low=low, high=high)
