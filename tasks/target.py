"""The target of a host: its GPU and its host compiler, decided once, before any stage, and read
by every stage that depends on them (the CUDA stage's driver check and nvcc's host compiler, the
env stage's vLLM/xformers/Apex choices, its Apex build compiler and its compose proof, the
training plan).

It comes from the box's one GPU fact (``tasks.facts.gpu.NvidiaGpus``: GPUs and driver in one
command) or, where host data sets ``gpu_override``, from that (a build box without a GPU, or a
box whose nvidia-smi cannot tell). The host compiler comes from the box's default gcc
(``CudaHostCompiler``, or the distro's default where gcc is missing): nvcc 11.8 accepts gcc <= 11,
so a newer default gets gcc-11/g++-11, installed once by the base stage. ``decide_gpu`` and
``decide_compiler`` are pure; the base stage asks both facts in its own bundle (tasks/base.py),
so a whole deploy reads them once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tasks.facts.gpu import GpuInventory, driver_view
from tasks.facts.nvidia import version_tuple
from tasks.plan import GpuTarget, PlanError
from tasks.settings import LabSettings

DISTRO_DEFAULT_GCC = {
    ("debian", "11"): 10, ("debian", "12"): 12,
    ("ubuntu", "20.04"): 9, ("ubuntu", "22.04"): 11, ("ubuntu", "24.04"): 13,
}  # (ID, VERSION_ID) from /etc/os-release -> the distro's default gcc major (the supported distros)
NVCC_MAX_GCC = 11          # nvcc 11.8 rejects gcc > 11
HOST_COMPILER_PACKAGES = ("gcc-11", "g++-11")

OVERRIDE_HINT = ('set host data gpu_override = {"name": ..., "compute_capability": ..., "memory_mib": ..., '
                 '"count": 1}')


@dataclass(frozen=True)
class HostCompiler:
    """The C/C++ compiler nvcc 11.8 (``-ccbin``) and Apex's CUDA build use on this host."""

    cc: str
    cxx: str
    needed: bool                 # the default gcc is too new for nvcc 11.8: gcc-11 is used
    install: bool                # ...and gcc-11/g++-11 are not there yet (the base stage installs them)
    reason: str


DEFAULT_COMPILER = HostCompiler("gcc", "g++", False, False, "the default gcc")


def decide_compiler(os_release: Mapping[str, str], compiler: Mapping[str, str | None] | None) -> HostCompiler:
    """``compiler``: the ``CudaHostCompiler`` fact (default gcc version, paths of gcc-11/g++-11)."""
    compiler = compiler or {}
    gcc = compiler.get("gcc")
    if gcc:
        major, seen = version_tuple(gcc.split("-")[0])[0], f"gcc {gcc}"
    else:
        major = DISTRO_DEFAULT_GCC.get((os_release.get("ID"), os_release.get("VERSION_ID")), NVCC_MAX_GCC + 1)
        seen = f"no gcc yet (the distro's default: gcc {major})"
    if major <= NVCC_MAX_GCC:
        return HostCompiler("gcc", "g++", False, False, f"{seen}: nvcc 11.8 accepts it")
    have = bool(compiler.get("gcc-11") and compiler.get("g++-11"))
    return HostCompiler(compiler.get("gcc-11") or "/usr/bin/gcc-11", compiler.get("g++-11") or "/usr/bin/g++-11",
                        True, not have,
                        f"{seen} is newer than nvcc 11.8 accepts (<= {NVCC_MAX_GCC}): gcc-11/g++-11"
                        + ("" if have else ", installed by the base stage"))


@dataclass(frozen=True)
class HostTarget:
    """What a host's stages plan for: its GPU target and its host compiler."""

    inventory: GpuInventory             # what the box's nvidia-smi said (also without an override)
    target: GpuTarget | None            # None: nothing to plan for (``problem`` says why)
    source: str                         # "nvidia-smi" | "gpu_override" | "none"
    problem: str | None = None
    compiler: HostCompiler = DEFAULT_COMPILER
    # why this box cannot train (tasks/validation.py), decided at the first fact pass: the base
    # stage queued only its failure, and no stage after it may queue anything
    refused: str | None = None
    # set by the driver stage (driver = "install"): it installs and proves the driver before the
    # CUDA stage's operations run, so that stage does not judge the driver the box had before
    driver_stage: str | None = None

    @property
    def compute_capability(self) -> str | None:
        return self.target.compute_capability if self.target else None

    @property
    def driver(self) -> dict | None:
        """The box's driver for the CUDA stage (``tasks.facts.gpu.driver_view``)."""
        return driver_view(self.inventory)


def decide_gpu(settings: LabSettings, inventory: GpuInventory | None) -> HostTarget:
    inventory = inventory or GpuInventory(problem="the GPU fact returned nothing")
    if settings.gpu_override:
        o = settings.gpu_override
        return HostTarget(inventory, GpuTarget(o["name"], o["compute_capability"], o["memory_mib"], o.get("count", 1)),
                       "gpu_override")
    try:
        return HostTarget(inventory, GpuTarget.from_inventory(inventory), "nvidia-smi")
    except PlanError as exc:
        return HostTarget(inventory, None, "none",
                       f"{exc}. Nothing to plan for on this box; to plan for a GPU it does not have, {OVERRIDE_HINT}")
