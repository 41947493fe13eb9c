"""The GPU target of a host: decided once, before any stage, and read by every stage that
depends on it (the CUDA stage's driver check, the env stage's vLLM/xformers/Apex choices and its
compose proof, the training plan).

It comes from the box's one GPU fact (``tasks.facts.gpu.NvidiaGpus``: GPUs and driver in one
command) or, where host data sets ``gpu_override``, from that (a build box without a GPU, or a
box whose nvidia-smi cannot tell). ``decide_gpu`` is pure; ``read_gpu`` asks the fact; the base
stage asks it in its own bundle (tasks/base.py) so a whole deploy reads the GPUs once.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.facts.gpu import GpuInventory, driver_view
from tasks.plan import GpuTarget, PlanError
from tasks.settings import LabSettings

OVERRIDE_HINT = ('set host data gpu_override = {"name": ..., "compute_capability": ..., "memory_mib": ..., '
                 '"count": 1}')


@dataclass(frozen=True)
class HostGpu:
    """What a host's stages plan for."""

    inventory: GpuInventory             # what the box's nvidia-smi said (also without an override)
    target: GpuTarget | None            # None: nothing to plan for (``problem`` says why)
    source: str                         # "nvidia-smi" | "gpu_override" | "none"
    problem: str | None = None

    @property
    def compute_capability(self) -> str | None:
        return self.target.compute_capability if self.target else None

    @property
    def driver(self) -> dict | None:
        """The box's driver for the CUDA stage (``tasks.facts.gpu.driver_view``)."""
        return driver_view(self.inventory)


def decide_gpu(settings: LabSettings, inventory: GpuInventory | None) -> HostGpu:
    inventory = inventory or GpuInventory(problem="the GPU fact returned nothing")
    if settings.gpu_override:
        o = settings.gpu_override
        return HostGpu(inventory, GpuTarget(o["name"], o["compute_capability"], o["memory_mib"], o.get("count", 1)),
                       "gpu_override")
    try:
        return HostGpu(inventory, GpuTarget.from_inventory(inventory), "nvidia-smi")
    except PlanError as exc:
        return HostGpu(inventory, None, "none",
                       f"{exc}. Nothing to plan for on this box; to plan for a GPU it does not have, {OVERRIDE_HINT}")


def read_gpu(settings: LabSettings) -> HostGpu:
    """Ask this host's GPU fact (one command) and decide its target: for a deploy that does not
    start with the base stage (deploy/cuda.py)."""
    from pyinfra import host

    from tasks.facts.gpu import NvidiaGpus

    return decide_gpu(settings, host.get_fact(NvidiaGpus))
