"""vLLM 0.8.5's ``gpu_memory_utilization`` (the share): the KV cache a share gives under each
engine's own accounting, and the smallest share that gives a wanted KV cache.

The one place this arithmetic lives: the plan sizes the share with it (``tasks/memory/generate.py``
``vllm_memory``, before anything runs, for a GPU with nothing else on it), and the training
launcher's preflight sizes it again at start (``preflight.py``, shipped beside it as
``verl_lab_vllm_share.py``) for the GPU as it is then: what other processes hold, and the memory
CUDA counts. Standard library only.

How the release turns the share into a KV cache (read in the vllm-0.8.5 wheel):

* V1 (``VLLM_USE_V1=1``; the plan's engine on compute capability >= 8.0),
  ``vllm/v1/worker/gpu_worker.py`` ``Worker.determine_available_memory``: KV cache =
  ``total x share - (torch's allocated peak of the process during profile_run + (total - free) -
  torch's allocated bytes)``, with ``total, free = torch.cuda.mem_get_info()``. The peak counts
  every tensor of the process (verl builds the actor and critic in it before vLLM), ``total - free``
  is the whole device's memory in use: every other process's memory counts against the share.
* V0 (``VLLM_USE_V1=0``; compute capability 7.x), ``vllm/worker/worker.py``
  ``Worker.determine_num_available_blocks`` with ``vllm/utils.py`` ``memory_profiling``: KV cache =
  ``total x share - (weights + torch's peak increase during profile_run + the increase of non-torch
  memory since the worker's first snapshot)``. Memory other processes hold the whole time cancels
  out of the increase: only vLLM's own need counts.
* ``total`` is CUDA's: on drivers that report reserved memory apart (nvidia-smi's
  ``memory.reserved``), ``memory.total`` less it, which is ``memory.used + memory.free`` (an idle
  H200: nvidia-smi 143771 total, 0 used, 143156 free; torch's total 143155 MiB, measured). And
  ``total - free`` as CUDA counts it is nvidia-smi's ``memory.used``.
* ``vllm/config.py`` ``CacheConfig._verify_args`` refuses a share above 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("v0", "v1")
SHARE_LIMIT = 1.0          # vLLM refuses more (CacheConfig._verify_args)


def counted_mib(engine: str, own_mib: float, held_mib: float = 0.0, others_mib: float = 0.0) -> float:
    """What ``engine`` takes off ``total x share`` before its KV cache: vLLM's own (weights,
    profiling activations, non-torch memory), and under V1 also what the process held when vLLM
    started and what other processes hold on the GPU."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    return own_mib + (held_mib + others_mib if engine == "v1" else 0.0)


def kv_cache_mib(engine: str, share: float, total_mib: float, own_mib: float, held_mib: float = 0.0,
                 others_mib: float = 0.0) -> float:
    """The KV cache ``share`` gives (negative: vLLM stops with "No available memory for the cache blocks")."""
    return share * total_mib - counted_mib(engine, own_mib, held_mib, others_mib)


def smallest_share(engine: str, total_mib: float, own_mib: float, kv_mib: float, held_mib: float = 0.0,
                   others_mib: float = 0.0) -> float:
    """The smallest share, in 0.01 steps, whose KV cache holds ``kv_mib``."""
    need = counted_mib(engine, own_mib, held_mib, others_mib) + kv_mib
    return -(-round(need * 100 * 1000) // round(total_mib * 1000)) / 100


@dataclass(frozen=True)
class GpuAtLaunch:
    """One GPU as the launcher finds it before training starts (nvidia-smi)."""

    index: int
    cuda_total_mib: int          # memory.used + memory.free: the total vLLM multiplies the share by
    in_use_mib: int              # memory.used: what other processes (and the driver) hold now
    processes: tuple[tuple[int, str, int | None], ...] = ()    # (pid, name, MiB) nvidia-smi lists


@dataclass(frozen=True)
class LaunchShare:
    """The share the launcher passes, and why."""

    engine: str
    planned: float
    share: float                                 # max(planned, the largest per-GPU need)
    needed: tuple[tuple[int, float], ...]        # (GPU index, smallest share that holds the plan's KV cache there)

    @property
    def fits(self) -> bool:
        return self.share <= SHARE_LIMIT

    @property
    def changed(self) -> bool:
        return self.share != self.planned


def launch_share(plan_vllm: dict, gpus: list[GpuAtLaunch]) -> LaunchShare:
    """The share that still gives the plan's KV cache (``kv_wanted_mib``: one step's sequences)
    on each of ``gpus`` as they are now, under the plan's engine; never less than the plan's.

    ``plan_vllm`` is plan.json's ``vllm`` section: ``engine``, ``share``, ``own_mib``,
    ``held_at_start_mib``, ``kv_wanted_mib``."""
    engine = plan_vllm["engine"]
    needed = tuple((g.index, smallest_share(engine, g.cuda_total_mib, plan_vllm["own_mib"],
                                            plan_vllm["kv_wanted_mib"], plan_vllm["held_at_start_mib"],
                                            g.in_use_mib)) for g in gpus)
    planned = float(plan_vllm["share"])
    return LaunchShare(engine=engine, planned=planned, share=max([planned] + [s for _, s in needed]), needed=needed)
