"""The burn-in's eyes inside verl: placed as ``<train_dir>/burnin-probe/sitecustomize.py``, which every Python
process of a burn-in imports at start (the burn-in's driver, verl_lab_box/burnin_driver.py, puts that folder on
``PYTHONPATH`` for itself and, through Ray's runtime environment, for verl's TaskRunner and workers on every node).

Inert unless ``VERL_LAB_BURNIN_RECORDS`` names a folder (the burn-in's own, under its run folder). Then, as verl's
modules are imported, it

* registers the burn-in's reward manager (verl_lab_box/burnin_reward.py, beside this file as
  ``verl_lab_burnin_reward.py``) under its name in verl's registry (``verl.workers.reward_manager.register``);
* times each call of the FSDP workers' phases (rollout, log-probs, values, updates, saves and loads) and, on a
  GPU, its peak memory: torch's allocated and reserved peaks over the call (reset at its start) and what the
  process holds on the GPU by NVML (CUDA context and allocator together), one JSON line a call in
  ``phases-<pid>.jsonl``, with the error of a call that raised (an out-of-memory error among them);
* copies each step's metrics as verl's trainer logs them (``Tracking.log``) into ``metrics-<pid>.jsonl``,
  a value that is NaN or infinite as the string ``"nan"``/``"inf"``.

It changes nothing verl computes. A hook that fails says so on stderr and leaves the import as it was. The next
``sitecustomize.py`` on the path runs after this one (``next_sitecustomize``), and another finder's hooks of the
same modules run too (``AfterImport`` asks the finders after it first). Standard library only at import.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import json
import math
import os
import sys
import threading
import time

RECORDS = os.environ.get("VERL_LAB_BURNIN_RECORDS")
REWARD_MODULES = ("verl_lab_burnin_reward.py", "burnin_reward.py")   # placed name, then its name in the repo
PHASES = {"ActorRolloutRefWorker": ("generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor",
                                    "save_checkpoint", "load_checkpoint"),
          "CriticWorker": ("compute_values", "update_critic", "save_checkpoint", "load_checkpoint")}
MIB = 1024 * 1024
_lock = threading.Lock()


def record(kind: str, line: dict) -> None:
    """One JSON line in ``<records>/<kind>-<pid>.jsonl``; a record that cannot be written is said, never raised."""
    try:
        os.makedirs(RECORDS, exist_ok=True)
        text = json.dumps({"pid": os.getpid(), "t": round(time.time(), 3), **line})
        with _lock, open(os.path.join(RECORDS, f"{kind}-{os.getpid()}.jsonl"), "a") as fh:
            fh.write(text + "\n")
    except (OSError, TypeError, ValueError) as exc:
        print(f"verl-lab burn-in probe: cannot record {kind}: {exc}", file=sys.stderr, flush=True)


def number(value):
    """A metric as JSON takes it: a float, or "nan"/"inf"/"-inf"; None for what is not a number."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))


def process_gpu_mib() -> float | None:
    """What this process holds on its GPUs by NVML's per-process accounting (context, allocator, libraries)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        held = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            held += sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                        if p.pid == os.getpid())
        return round(held / MIB, 1) if held else None
    except Exception:  # noqa: BLE001 - no NVML, no figure
        return None


def timed(phase: str, method):
    """``method`` recording its seconds and (on a GPU) its memory peaks; verl's dispatch attributes kept."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        torch = sys.modules.get("torch")
        gpu = bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, error = time.monotonic(), None
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"[:600]
            raise
        finally:
            line = {"phase": phase, "seconds": round(time.monotonic() - start, 3), "rank": os.environ.get("RANK")}
            if gpu:
                torch.cuda.synchronize()
                line.update(peak_allocated_mib=round(torch.cuda.max_memory_allocated() / MIB, 1),
                            peak_reserved_mib=round(torch.cuda.max_memory_reserved() / MIB, 1),
                            process_mib=process_gpu_mib())
            if error:
                line["error"] = error
            record("phases", line)
    return call


def on_workers(module) -> None:
    for cls_name, methods in PHASES.items():
        cls = getattr(module, cls_name, None)
        for name in methods if cls is not None else ():
            if name in cls.__dict__:
                setattr(cls, name, timed(name, cls.__dict__[name]))


def on_tracking(module) -> None:
    log = module.Tracking.log

    @functools.wraps(log)
    def logged(self, data, step, *args, **kwargs):
        record("metrics", {"step": int(step), "data": {str(k): number(v) for k, v in dict(data).items()}})
        return log(self, data, step, *args, **kwargs)

    module.Tracking.log = logged


def on_reward_managers(module) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = next(os.path.join(here, n) for n in REWARD_MODULES if os.path.isfile(os.path.join(here, n)))
    spec = importlib.util.spec_from_file_location("verl_lab_burnin_reward", path)
    reward = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = reward
    spec.loader.exec_module(reward)
    module.register(reward.MANAGER)(reward.BurninReward)


HOOKS = {"verl.workers.fsdp_workers": on_workers, "verl.utils.tracking": on_tracking,
         "verl.workers.reward_manager": on_reward_managers}


class AfterImport:
    """A meta-path finder that asks the finders after it for each hooked module (another probe's hook, then the
    path finder), then runs its hook once the module's own code (and the other's hook) has run."""

    finding: set = set()         # names being found now: a finder that asks this one back gets None

    def find_spec(self, name, path=None, target=None):
        hook = HOOKS.get(name)
        if hook is None or name in self.finding:
            return None
        later = sys.meta_path[sys.meta_path.index(self) + 1:] if self in sys.meta_path else []
        self.finding.add(name)
        try:
            spec = next((s for s in (f.find_spec(name, path, target) for f in later if hasattr(f, "find_spec"))
                         if s is not None), None) or importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            self.finding.discard(name)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            try:
                hook(module)
            except Exception as exc:  # noqa: BLE001 - a hook never breaks verl's import
                print(f"verl-lab burn-in probe: the hook of {name} failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module
        return spec

    def invalidate_caches(self):
        pass


def next_sitecustomize() -> None:
    """This file shadows any other ``sitecustomize`` (Python imports the first on its path): the next one on
    ``sys.path`` (the env's own, a harness's) runs after it, as it would have without this one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or os.curdir), "sitecustomize.py")
        if os.path.dirname(candidate) != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("verl_lab_next_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # noqa: BLE001 - as site.py treats a failing sitecustomize
                print(f"verl-lab burn-in probe: {candidate} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return


if RECORDS and not any(isinstance(f, AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, AfterImport())
next_sitecustomize()
