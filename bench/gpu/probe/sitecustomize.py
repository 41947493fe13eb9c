"""verl-lab GPU harness probe: loaded by every Python process of a bench run (driver, Ray's
TaskRunner and WorkerDict processes) because bench/gpu/run_profile.py puts this folder on
PYTHONPATH. Measurement only; it changes no training behaviour except the memory cap.

* ``VERL_LAB_GPU_CAP_MIB``: caps PyTorch's caching allocator of each process at that many MiB
  (``torch.cuda.set_per_process_memory_fraction`` at first CUDA use), so an allocation past it
  raises torch.OutOfMemoryError as on a card of that size.
* ``VERL_LAB_PROBE_DIR``: each process appends JSON lines to ``probe-<pid>.jsonl`` there:
  - one line per verl worker call (``phase``: generate_sequences, compute_log_prob,
    compute_values, update_critic, update_actor, init_model, ...) with torch's peak allocated
    and reserved bytes during the call (peaks reset at its start), what the process holds
    outside torch (NVML, per process), the seconds it took, and the OOM message if it ran out;
  - one line per HF ``generate()`` chunk (prompts, new tokens, seconds);
  - on ``compute_log_prob``, the largest gap between the rollout's own log-probs of the tokens
    it sampled (recorded from the probability rows the sampler drew from) and the actor's
    log-probs of the same tokens (``logprob_gap_max``), over the response mask.

The rollout's log-probs are attached to the HF rollout's output as ``rollout_log_probs``, the
key verl 0.5.0's trainer already compares (``training/rollout_probs_diff_max``).
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import sys
import threading
import time

_PROBE_DIR = os.environ.get("VERL_LAB_PROBE_DIR")
_CAP_MIB = os.environ.get("VERL_LAB_GPU_CAP_MIB")
_LOCK = threading.Lock()
_MIB = 1024 * 1024


def _write(record: dict) -> None:
    if not _PROBE_DIR:
        return
    record = {"pid": os.getpid(), "t": round(time.time(), 3), **record}
    try:
        os.makedirs(_PROBE_DIR, exist_ok=True)
        with _LOCK, open(os.path.join(_PROBE_DIR, f"probe-{os.getpid()}.jsonl"), "a") as fh:
            fh.write(json.dumps(record) + "\n")
    except OSError as exc:  # a probe never breaks the run
        print(f"verl-lab probe: cannot write: {exc}", file=sys.stderr)


# ------------------------------------------------------------------ after-import hooks

class _Loader(importlib.abc.Loader):
    def __init__(self, inner, after):
        self._inner, self._after = inner, after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            self._after(module)
        except Exception as exc:  # noqa: BLE001 - report, never break the import
            print(f"verl-lab probe: hook for {module.__name__} failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, hooks):
        self._hooks = hooks

    def find_spec(self, fullname, path, target=None):
        after = self._hooks.get(fullname)
        if after is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, after)
                return spec
        return None


# ------------------------------------------------------------------ memory cap

def _cap_torch(torch) -> None:
    if not _CAP_MIB:
        return
    cap = int(_CAP_MIB) * _MIB
    cuda = torch.cuda
    original = cuda._lazy_init
    done = {"capped": False}

    def lazy_init():
        original()
        if not done["capped"]:
            done["capped"] = True
            for i in range(cuda.device_count()):
                total = cuda.get_device_properties(i).total_memory
                cuda.set_per_process_memory_fraction(min(1.0, cap / total), i)
            _write({"event": "cap", "cap_mib": int(_CAP_MIB), "devices": cuda.device_count()})

    cuda._lazy_init = lazy_init


# ------------------------------------------------------------------ per-phase memory

def _outside_torch_mib(torch) -> float | None:
    """GPU memory this process holds that torch's allocator did not reserve (CUDA context,
    NCCL, cuBLAS), from NVML's per-process accounting; None where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return round((proc.usedGpuMemory - torch.cuda.memory_reserved()) / _MIB, 1)
    except Exception:  # noqa: BLE001
        return None
    return None


_CENSUS_CALLS = {"update_actor": 2, "update_critic": 1}     # census at the start of the first calls


def _census(torch, label: str) -> dict:
    """The live CUDA tensors of 64 MiB or more (shape, dtype, MiB), summed: what holds the
    memory at an out-of-memory error, or at the start of an update."""
    import gc

    seen, big = set(), []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                storage = obj.untyped_storage()
                key = storage.data_ptr()
                if key in seen:
                    continue
                seen.add(key)
                size = storage.nbytes()
                if size >= 64 * _MIB:
                    big.append((round(size / _MIB, 1), list(obj.shape), str(obj.dtype).replace("torch.", "")))
        except Exception:  # noqa: BLE001 - odd objects in gc
            continue
    big.sort(reverse=True)
    return {"event": "census", "label": label, "big_tensors_mib": round(sum(b[0] for b in big), 1),
            "allocated_mib": round(torch.cuda.memory_allocated() / _MIB, 1), "tensors": big[:40]}


def _phase_wrapper(role: str, name: str, method):
    calls = {"n": 0}

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        import torch

        ok = torch.cuda.is_available() and torch.cuda.is_initialized()
        calls["n"] += 1
        if ok and calls["n"] <= _CENSUS_CALLS.get(name, 0):
            _write(_census(torch, f"{role}.{name} start {calls['n']}"))
        if ok:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.time()
        oom = None
        try:
            return method(self, *args, **kwargs)
        except torch.OutOfMemoryError as exc:
            oom = str(exc).splitlines()[0][:400]
            try:
                _write(_census(torch, f"{role}.{name} out of memory"))
            except Exception:  # noqa: BLE001
                pass
            raise
        finally:
            record = {"event": "phase", "role": role, "phase": name, "seconds": round(time.time() - start, 3)}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001 - after an OOM the stream may be unusable
                    pass
                record.update({
                    "allocated_before_mib": round(before / _MIB, 1) if ok else None,
                    "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / _MIB, 1),
                    "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / _MIB, 1),
                    "allocated_after_mib": round(torch.cuda.memory_allocated() / _MIB, 1),
                    "outside_torch_mib": _outside_torch_mib(torch),
                })
            if oom:
                record["oom"] = oom
            _write(record)

    return wrapper


_PHASES = {
    "ActorRolloutRefWorker": ("init_model", "generate_sequences", "compute_log_prob", "compute_ref_log_prob",
                              "update_actor", "save_checkpoint"),
    "CriticWorker": ("init_model", "compute_values", "update_critic", "save_checkpoint"),
}


def _patch_workers(module) -> None:
    for cls_name, methods in _PHASES.items():
        cls = getattr(module, cls_name, None)
        if cls is None:
            continue
        for name in methods:
            if name in cls.__dict__:
                setattr(cls, name, _phase_wrapper(cls_name, name, cls.__dict__[name]))
    original = module.ActorRolloutRefWorker.compute_log_prob

    @functools.wraps(original)
    def compute_log_prob(self, data, *args, **kwargs):
        out = original(self, data, *args, **kwargs)
        try:
            _logprob_gap(data, out)
        except Exception as exc:  # noqa: BLE001
            _write({"event": "logprob_gap_error", "error": f"{type(exc).__name__}: {exc}"})
        return out

    module.ActorRolloutRefWorker.compute_log_prob = compute_log_prob


def _logprob_gap(data, out) -> None:
    if data.batch is None or "rollout_log_probs" not in data.batch.keys():
        return
    rollout = data.batch["rollout_log_probs"].detach().float().cpu()
    actor = out.batch["old_log_probs"].detach().float().cpu()
    mask = data.batch["attention_mask"][:, -rollout.shape[1]:].bool().cpu()
    gap = (rollout - actor).abs()[mask]
    prob_gap = (rollout.exp() - actor.exp()).abs()[mask]
    _write({"event": "logprob_gap", "tokens": int(mask.sum()),
            "logprob_gap_max": round(float(gap.max()), 6), "logprob_gap_mean": round(float(gap.mean()), 6),
            "prob_gap_max": round(float(prob_gap.max()), 6),
            "rollout_logprob_mean": round(float(rollout[mask].mean()), 4),
            "actor_logprob_mean": round(float(actor[mask].mean()), 4)})


# ------------------------------------------------------------------ HF rollout

def _patch_hf_rollout(module) -> None:
    cls = module.HFRollout
    original = cls._generate_minibatch

    @functools.wraps(original)
    def generate_minibatch(self, prompts):
        import torch

        picked: list = []
        multinomial = torch.multinomial

        def recording_multinomial(probs, num_samples, *args, **kwargs):
            tokens = multinomial(probs, num_samples, *args, **kwargs)
            picked.append(torch.gather(probs, -1, tokens[:, :1]).squeeze(-1).float().clamp_min(1e-38).log())
            return tokens

        torch.multinomial = recording_multinomial
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.time()
        try:
            out = original(self, prompts)
        finally:
            torch.multinomial = multinomial
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.time() - start
        responses = out.batch["responses"]
        _write({"event": "generate", "prompts": int(responses.shape[0]), "new_tokens": len(picked) or None,
                "response_length": int(responses.shape[1]), "seconds": round(seconds, 3),
                "sampled": bool(picked)})
        if picked:
            logp = torch.stack(picked, dim=1)
            full = torch.zeros(responses.shape, dtype=torch.float32, device=logp.device)
            steps = min(logp.shape[1], responses.shape[1])
            full[:, :steps] = logp[:, :steps]
            out.batch["rollout_log_probs"] = full.to(responses.device)
        return out

    cls._generate_minibatch = generate_minibatch


def _install() -> None:
    hooks = {"verl.workers.fsdp_workers": _patch_workers,
             "verl.workers.rollout.hf_rollout": _patch_hf_rollout}
    if _CAP_MIB:
        hooks["torch"] = _cap_torch
    sys.meta_path.insert(0, _AfterImport(hooks))


if _PROBE_DIR or _CAP_MIB:
    _install()
