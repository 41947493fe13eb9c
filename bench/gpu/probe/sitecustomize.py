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
    outside torch (NVML, per process), the seconds it took, and the OOM message if it ran out,
    the worker's rank (verl's ``RANK``) and the GPU it runs on (``gpu``: NVML's index, the physical
    one, whatever ``CUDA_VISIBLE_DEVICES`` Ray gave the process);
  - once per process, after its first ``init_model``: where it runs (``device``): its rank, local
    rank and world size, ``CUDA_VISIBLE_DEVICES``, the devices torch sees, the GPU NVML finds this
    process on (index and UUID) and the Ray node's address: each worker of a several-GPU run on
    its own GPU, capped there;
  - one line per HF ``generate()`` chunk (prompts, new tokens, seconds);
  - on ``compute_log_prob``, the largest gap between the rollout's own log-probs of the tokens
    it sampled (recorded from the probability rows the sampler drew from) and the actor's
    log-probs of the same tokens (``logprob_gap_max``), over the response mask (not on a LoRA run's ref
    pass, which verl makes through the actor's ``compute_log_prob`` with the adapter disabled).

  - once per process, at its first ``init_model``: torch's CPU threads (intra-op, inter-op),
    ``OMP_NUM_THREADS`` and the CPUs the process may use (the CPU-offload rung's AdamW step and
    gradient accumulation run on them);
  - on every phase record, cheap wall-clock splits of the actor's work inside it (``splits``):
    seconds in ``_forward_micro_batch`` (the forwards, with their FSDP gathers), in ``Tensor.backward``
    (the backward passes, with FSDP's gradient reductions), in ``_optimizer_step`` (gradient clipping
    and the AdamW step) and in ``AdamW.step`` alone, and their counts.
* ``VERL_LAB_PROFILE``: a comma-separated list of ``phase`` or ``phase:N`` (the N-th call, default
  1), each optionally ``@K``, e.g. ``update_actor@4,generate_sequences@6``: that call (with ``@K``: K
  forwards of its model after the first two, and whatever runs between them) runs under
  ``torch.profiler`` (CPU and CUDA activities) and its table of where the time went is written as
  ``profile-<phase>-<N>-<pid>.json`` beside the probe records (``profile_table``): time per
  category (H2D/D2H copies, GPU kernels, FSDP all-gathers and reductions, the optimizer step,
  CPU-only operator time) and the heaviest operators by self CPU and by self device time. A
  profiled call is slower than an unprofiled one: compare its seconds only with the splits of
  other calls.

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
_PROFILE = os.environ.get("VERL_LAB_PROFILE", "")
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
            _write({"event": "cap", "cap_mib": int(_CAP_MIB), "devices": cuda.device_count(),
                    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "rank": os.environ.get("RANK")})

    cuda._lazy_init = lazy_init


# ------------------------------------------------------------------ per-phase memory

def nvml_process() -> dict | None:
    """This process on the GPUs as NVML lists them: the GPU it holds the most memory on, by NVML's
    index (the physical one: torch's device 0 is whichever GPU ``CUDA_VISIBLE_DEVICES`` names first),
    ``{"gpu", "gpu_uuid", "used_bytes"}``; None where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        found = None
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory and (
                        found is None or proc.usedGpuMemory > found["used_bytes"]):
                    uuid = pynvml.nvmlDeviceGetUUID(handle)
                    found = {"gpu": index, "gpu_uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                             "used_bytes": proc.usedGpuMemory}
        return found
    except Exception:  # noqa: BLE001
        return None


def _outside_torch_mib(torch, here: dict | None) -> float | None:
    """GPU memory this process holds that torch's allocator did not reserve (CUDA context,
    NCCL, cuBLAS), from NVML's per-process accounting (``nvml_process``); None where NVML cannot say."""
    if not here:
        return None
    return round((here["used_bytes"] - torch.cuda.memory_reserved()) / _MIB, 1)


_DEVICE_WRITTEN: list = []


def device_record(torch, here: dict | None) -> dict:
    """Where this worker process runs: verl's rank, Ray's CUDA_VISIBLE_DEVICES, what torch sees, the GPU NVML finds
    it on, the Ray node's address."""
    node_ip = None
    ray = sys.modules.get("ray")
    if ray is not None:
        try:
            node_ip = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001
            pass
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"event": "device", "rank": os.environ.get("RANK"), "local_rank": os.environ.get("LOCAL_RANK"),
            "world_size": os.environ.get("WORLD_SIZE"), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device_count": torch.cuda.device_count() if cuda else 0,
            "current_device": torch.cuda.current_device() if cuda else None,
            "gpu": (here or {}).get("gpu"), "gpu_uuid": (here or {}).get("gpu_uuid"), "node_ip": node_ip}


_CENSUS_CALLS = {"update_actor": 2, "update_critic": 1}     # census at the start of the first calls
_THREADS_WRITTEN: list = []


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


# ------------------------------------------------------------------ where the time goes

def profile_requests(spec: str) -> dict[str, dict[int, int | None]]:
    """``VERL_LAB_PROFILE``'s calls to profile: phase -> {call number (1-based): forwards to profile, None for the
    whole call}. An item is ``phase``, ``phase:N`` (the N-th call) and either may end in ``@K``: only K forwards
    of the call's model, after PROFILE_SKIP_FORWARDS (with their backward passes and what runs between them)."""
    wanted: dict[str, dict[int, int | None]] = {}
    for item in spec.replace(" ", "").split(","):
        head, _, window = item.partition("@")
        phase, _, n = head.partition(":")
        if not phase or (n and not n.isdigit()) or (window and not window.isdigit()):
            if item:
                print(f"verl-lab probe: VERL_LAB_PROFILE item {item!r} ignored (phase[:N][@K])", file=sys.stderr)
            continue
        wanted.setdefault(phase, {})[int(n) if n else 1] = int(window) if window else None
    return wanted


PROFILE_SKIP_FORWARDS = 2      # a profiling window starts after the call's first forwards (warm-up, gathers)
_PROFILE_CALLS = profile_requests(_PROFILE)
_SPLITS: dict[str, float] = {}        # the actor's wall-clock splits of the phase call running now
_FSDP_LABEL = "FSDP::"


def _ms(us) -> float:
    return round(float(us or 0.0) / 1000.0, 3)


def _row_times(row) -> tuple[float, float, float, float]:
    """(cpu total, self cpu, device total, self device) in microseconds, across torch versions
    (``cuda_*`` became ``device_*`` in torch 2.4)."""
    def get(*names):
        for name in names:
            value = getattr(row, name, None)
            if value is not None:
                return float(value)
        return 0.0
    return (get("cpu_time_total"), get("self_cpu_time_total"),
            get("device_time_total", "cuda_time_total"), get("self_device_time_total", "self_cuda_time_total"))


def _category(name: str, on_device: bool) -> str | None:
    """Where an operator's time belongs in the summary; None: only in the top lists."""
    if on_device:
        if "HtoD" in name:
            return "h2d_copy"
        if "DtoH" in name:
            return "d2h_copy"
        if name.startswith("Memcpy") or name.startswith("Memset"):
            return "device_copy_other"
        return "gpu_kernels"
    if name.startswith(_FSDP_LABEL):
        return "fsdp " + name.split(" (", 1)[0][len(_FSDP_LABEL):]     # FSDP::all_gather (model.layers.3)
    if name.startswith("Optimizer.step#"):
        return "optimizer_step"
    if name.startswith("Optimizer.zero_grad#"):
        return "optimizer_zero_grad"
    return None


def profile_table(rows, wall_s: float, top: int = 25) -> dict:
    """Where the time of one profiled call went, from ``torch.profiler``'s ``key_averages()``:
    per category (time in ms; CPU ranges such as ``fsdp all_gather`` and ``optimizer_step`` are
    inclusive CPU time, copies and kernels are device time), the CPU time of operators that ran
    no device work (CPU compute: the offloaded AdamW step, gradient accumulation on the host), and
    the heaviest operators by self CPU and by self device time."""
    categories: dict[str, dict] = {}
    table = []
    cpu_only_ms = 0.0
    for row in rows:
        name = str(row.key)
        cpu_total, self_cpu, dev_total, self_dev = _row_times(row)
        on_device = "cuda" in str(getattr(row, "device_type", "")).lower()
        entry = {"name": name[:120], "count": int(row.count), "cpu_ms": _ms(cpu_total), "self_cpu_ms": _ms(self_cpu),
                 "device_ms": _ms(dev_total), "self_device_ms": _ms(self_dev), "on_device": on_device}
        table.append(entry)
        cat = _category(name, on_device)
        if cat is not None:
            c = categories.setdefault(cat, {"ms": 0.0, "count": 0})
            c["ms"] = round(c["ms"] + (entry["self_device_ms"] if on_device else entry["cpu_ms"]), 3)
            c["count"] += entry["count"]
        if not on_device and dev_total == 0 and name.startswith("aten::"):
            cpu_only_ms += entry["self_cpu_ms"]
    categories["cpu_only_aten_ops"] = {"ms": round(cpu_only_ms, 3), "count": None}
    by_cpu = sorted((e for e in table if not e["on_device"]), key=lambda e: -e["self_cpu_ms"])[:top]
    by_dev = sorted((e for e in table if e["self_device_ms"] > 0), key=lambda e: -e["self_device_ms"])[:top]
    return {"wall_s": round(wall_s, 3), "categories": dict(sorted(categories.items())),
            "top_self_cpu": by_cpu, "top_self_device": by_dev}


def _start_profile(torch):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False)
    prof.__enter__()
    return prof


def _finish_profile(prof, role: str, name: str, call: int, wall_s: float, forwards: int | None = None) -> None:
    prof.__exit__(None, None, None)
    record = {"event": "profile", "role": role, "phase": name, "call": call, "forwards": forwards,
              **profile_table(prof.key_averages(), wall_s)}
    if not _PROBE_DIR:
        return
    try:
        os.makedirs(_PROBE_DIR, exist_ok=True)
        path = os.path.join(_PROBE_DIR, f"profile-{name}-{call}-{os.getpid()}.json")
        with open(path, "w") as fh:
            json.dump({"pid": os.getpid(), "t": round(time.time(), 3), **record}, fh, indent=1)
    except OSError as exc:
        print(f"verl-lab probe: cannot write the profile: {exc}", file=sys.stderr)


# the model each worker call runs its forwards through, for a profiling window
_CALL_MODULE = {"compute_ref_log_prob": "ref_module_fsdp", "compute_values": "critic_module",
                "update_critic": "critic_module"}


class _ProfileWindow:
    """torch.profiler over ``forwards`` forwards of ``module`` (a forward pre-hook counts them), after
    PROFILE_SKIP_FORWARDS: a bounded slice of a long call (an update of tens of micro-batches, a generate() call of
    hundreds of decoding steps), whose whole profile would cost far more than the call."""

    def __init__(self, torch, module, role: str, name: str, call: int, forwards: int):
        self.torch, self.role, self.name, self.call, self.forwards = torch, role, name, call, forwards
        self.seen, self.prof, self.start = 0, None, 0.0
        self.handle = module.register_forward_pre_hook(self._pre_forward)

    def _pre_forward(self, module, args):
        self.seen += 1
        if self.seen == PROFILE_SKIP_FORWARDS + 1:
            self.prof, self.start = _start_profile(self.torch), time.time()
        elif self.seen == PROFILE_SKIP_FORWARDS + self.forwards + 1:
            self.finish()

    def finish(self) -> None:
        self.handle.remove()
        if self.prof is not None:
            if self.torch.cuda.is_available() and self.torch.cuda.is_initialized():
                self.torch.cuda.synchronize()
            prof, self.prof = self.prof, None
            _finish_profile(prof, self.role, self.name, self.call, time.time() - self.start,
                            forwards=min(self.forwards, self.seen - PROFILE_SKIP_FORWARDS))


def _start_profiling(torch, worker, role: str, name: str, call: int, window: int | None):
    """A whole-call profile (window None) or a window over the call's model's forwards."""
    module = getattr(worker, _CALL_MODULE.get(name, "actor_module_fsdp"), None)
    if window is None or module is None or not hasattr(module, "register_forward_pre_hook"):
        return _start_profile(torch)
    return _ProfileWindow(torch, module, role, name, call, window)


def _threads(torch) -> dict:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = None
    return {"event": "threads", "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count(), "cpus_allowed": cpus}


def _timed(label: str, method):
    """The actor's method, its wall-clock seconds (device work included) added to ``_SPLITS``."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        import torch

        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
        start = time.time()
        try:
            return method(*args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize()
            _SPLITS[label + "_s"] = round(_SPLITS.get(label + "_s", 0.0) + time.time() - start, 4)
            _SPLITS[label + "_calls"] = _SPLITS.get(label + "_calls", 0) + 1

    return wrapper


def _patch_actor(module) -> None:
    cls = module.DataParallelPPOActor
    for name, label in (("_forward_micro_batch", "forward"), ("_optimizer_step", "optimizer_step")):
        if name in cls.__dict__:
            setattr(cls, name, _timed(label, cls.__dict__[name]))
    import torch

    # the backward passes (with FSDP's gradient reductions in their hooks) and the AdamW step itself (inside
    # optimizer_step, which also clips the gradients)
    torch.Tensor.backward = _timed("backward", torch.Tensor.backward)
    torch.optim.AdamW.step = _timed("adamw_step", torch.optim.AdamW.step)


def _phase_wrapper(role: str, name: str, method):
    calls = {"n": 0}
    profiled = _PROFILE_CALLS.get(name, {})

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        import torch

        ok = torch.cuda.is_available() and torch.cuda.is_initialized()
        calls["n"] += 1
        call = calls["n"]
        if name == "init_model" and not _THREADS_WRITTEN:
            _THREADS_WRITTEN.append(True)
            _write(_threads(torch))
        if ok and call <= _CENSUS_CALLS.get(name, 0):
            _write(_census(torch, f"{role}.{name} start {call}"))
        if ok:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        _SPLITS.clear()
        prof = _start_profiling(torch, self, role, name, call, profiled[call]) if call in profiled else None
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
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001 - after an OOM the stream may be unusable
                    pass
            seconds = time.time() - start
            record = {"event": "phase", "role": role, "phase": name, "call": call, "seconds": round(seconds, 3),
                      "rank": os.environ.get("RANK")}
            if _SPLITS:
                record["splits"] = dict(_SPLITS)
            if prof is not None:
                record["profiled"] = True
                try:
                    if isinstance(prof, _ProfileWindow):
                        prof.finish()
                    else:
                        _finish_profile(prof, role, name, call, seconds)
                except Exception as exc:  # noqa: BLE001 - a probe never breaks the run
                    _write({"event": "profile_error", "phase": name, "error": f"{type(exc).__name__}: {exc}"})
            here = None
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                here = nvml_process()
                record.update({
                    "allocated_before_mib": round(before / _MIB, 1) if ok else None,
                    "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / _MIB, 1),
                    "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / _MIB, 1),
                    "allocated_after_mib": round(torch.cuda.memory_allocated() / _MIB, 1),
                    "outside_torch_mib": _outside_torch_mib(torch, here),
                    "gpu": (here or {}).get("gpu"),
                })
            if oom:
                record["oom"] = oom
            _write(record)
            if name == "init_model" and not _DEVICE_WRITTEN:
                _DEVICE_WRITTEN.append(True)
                _write(device_record(torch, here))

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
        # with LoRA verl's compute_ref_log_prob is this call with the adapter disabled (meta_info is_lora, popped
        # by the call): the base model's log-probs, not the policy the rollout sampled; no gap record for it
        ref_pass = bool(data.meta_info.get("is_lora", False)) if data.meta_info else False
        out = original(self, data, *args, **kwargs)
        try:
            if not ref_pass:
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
             "verl.workers.actor.dp_actor": _patch_actor,
             "verl.workers.rollout.hf_rollout": _patch_hf_rollout}
    if _CAP_MIB:
        hooks["torch"] = _cap_torch
    sys.meta_path.insert(0, _AfterImport(hooks))


if _PROBE_DIR or _CAP_MIB:
    _install()
