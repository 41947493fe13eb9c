"""Summarise GPU-harness runs: the plan's prediction against what the workers measured, speed,
and the rollout/actor log-prob gap, per profile.

    .venv/bin/python bench/gpu/ppo_results.py RUNS_DIR [--json OUT.json] [--markdown]

RUNS_DIR holds ``<profile>/{profile.json? console.log, run.json, probe/*.jsonl}`` as
bench/gpu/run_ppo.sh packs them (``runs.tgz``); profile.json is read from ``.gpu/profiles/``
when the run folder has none.

* measured peak = the largest per-phase ``torch.cuda.max_memory_allocated`` of the worker
  process plus what that process holds outside torch (NVML): the GPU memory it needed. The
  reserved peak (+ outside torch) is reported beside it as "held": the caching allocator keeps
  freed blocks up to the cap, so it reads the cap on capped runs. Predicted = the plan's
  ``predicted_peak_mib`` (its allocated peak + the 1368 MiB outside torch measured on the H200;
  1908 MiB before GPU call 9's calibration), re-estimated with the memory model as it is now for
  exactly the workload that ran (``estimate_as_ran``: algorithm, rollout.n, offload policy,
  checkpointing, micro-batches, from the run's plan.json and the harness's extra overrides); the
  prediction when the profile was rendered is kept beside it.
* s/step = the mean of verl's ``timing_s/step`` over steps 2.. (step 1 warms up) less the
  step's validation (``timing_s/testing``, which verl counts inside the step that validates); prompts/s = train batch / s/step;
  tokens/s = generated tokens per step / s/step.
* log-prob gap = the largest |rollout log-prob - actor log-prob| of the same sampled tokens
  (probe), with verl's own ``training/rollout_probs_diff_max``.
* several GPUs (``gpus`` > 1, or ``nodes`` > 1: ``per_gpu``): each worker process's peak (its own
  allocated peak + what it held outside torch) against the plan's per-GPU prediction (the memory model
  at the run's world size), within 10% and never over the cap, with the GPU NVML found it on (each rank
  on its own GPU); NCCL's interfaces and transports from its INFO lines (``nccl_summary``); for Ray
  nodes, the cluster's formation and preflight (``cluster.json``); ``scaling_markdown`` / ``--scaling``:
  prompts/s against the profile's ``compare_with`` run of the same call (2 GPUs / 1, 2 nodes / 1 box).
* export (export profiles, ``export_summary``): the bytes of one save (``global_step_N``: actor,
  critic, data.pt) against the plan's prediction (plan.json ``checkpoints.save.total_bytes``, where
  the plan has it), which saves remain, the export's merge and proof seconds, its bytes, the
  largest logit difference, and the GSM8K scores (accuracy, prompts/s) of the base model and the
  export.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASE_ORDER = ("generate_sequences", "compute_log_prob", "compute_ref_log_prob", "compute_values", "update_critic",
               "update_actor")
PLAN_PHASE = {"generate_sequences": "phase_rollout", "compute_log_prob": "phase_actor_logprob",
              "compute_ref_log_prob": "phase_ref_logprob",
              "compute_values": "phase_critic_values", "update_critic": "phase_critic_update",
              "update_actor": "phase_actor_update"}


def parse_steps(console: str) -> dict[int, dict[str, float]]:
    """verl's per-step metrics, read by the product's own log reader (tasks/status.py)."""
    sys.path.insert(0, str(REPO))
    from tasks.status import parse_log

    return {s["step"]: s["metrics"] for s in parse_log(console).steps}


def read_probe(folder: Path) -> list[dict]:
    records = []
    for f in sorted(folder.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def read_run(run: Path) -> tuple[dict, dict[int, dict[str, float]]]:
    """A run folder's profile (its own profile.json, else .gpu/profiles/) and verl's per-step metrics."""
    prof_file = run / "profile.json"
    if not prof_file.is_file():
        prof_file = REPO / ".gpu" / "profiles" / run.name / "profile.json"
    profile = json.loads(prof_file.read_text()) if prof_file.is_file() else {"name": run.name}
    console = (run / "console.log").read_text(errors="replace") if (run / "console.log").is_file() else ""
    return profile, parse_steps(console)


def step_speed(profile: dict, steps: dict[int, dict[str, float]]) -> dict:
    """s/step over steps 2.. (step 1 warms up; all steps when there is one) less the validation verl counts in
    the step that validates (``timing_s/testing``); prompts/s = train batch / s/step; tokens/s = generated tokens
    per step / s/step."""
    plan = profile.get("plan") or {}
    later = [s for n, s in steps.items() if n >= 2 and "timing_s/step" in s] or list(steps.values())
    s_step = statistics.mean(s["timing_s/step"] - s.get("timing_s/testing", 0.0)
                             for s in later if "timing_s/step" in s) if later else None
    batch = _batch_from_overrides(profile) or plan.get("train_batch_size")     # the harness's override wins
    resp = statistics.mean(s["response_length/mean"] for s in later if "response_length/mean" in s) if later else None
    return {"s_per_step": round(s_step, 2) if s_step else None, "gen_s_per_step": _mean(later, "timing_s/gen"),
            "prompts_per_s": round(batch / s_step, 3) if s_step and batch else None,
            "tokens_per_s": round(batch * resp / s_step, 1) if s_step and batch and resp else None,
            "train_batch_size": batch, "response_length_mean": round(resp, 1) if resp else None}


def summarise(run: Path) -> dict:
    name = run.name
    profile, steps = read_run(run)
    plan = profile.get("plan") or {}
    result = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
    probe = read_probe(run / "probe")
    phases: dict[str, dict] = {}
    for r in probe:
        if r.get("event") != "phase" or r.get("peak_allocated_mib") is None:
            continue
        ph = phases.setdefault(r["phase"], {"calls": 0, "peak_allocated_mib": 0.0, "peak_reserved_mib": 0.0,
                                            "outside_torch_mib": None, "seconds": []})
        ph["calls"] += 1
        ph["peak_allocated_mib"] = max(ph["peak_allocated_mib"], r["peak_allocated_mib"])
        ph["peak_reserved_mib"] = max(ph["peak_reserved_mib"], r["peak_reserved_mib"])
        if r.get("outside_torch_mib") is not None:
            ph["outside_torch_mib"] = max(ph["outside_torch_mib"] or 0.0, r["outside_torch_mib"])
        ph["seconds"].append(r["seconds"])
        if r.get("oom"):
            ph["oom"] = r["oom"]
    outside = [p["outside_torch_mib"] for p in phases.values() if p["outside_torch_mib"] is not None]
    outside_mib = max(outside) if outside else None
    train_phases = {k: v for k, v in phases.items() if k in PHASE_ORDER}
    peak_alloc = max((p["peak_allocated_mib"] for p in train_phases.values()), default=None)
    peak_res = max((p["peak_reserved_mib"] for p in train_phases.values()), default=None)
    # what the process needed: torch's allocated peak plus what it held outside torch (the
    # reserved peak is bigger: the caching allocator keeps freed blocks, up to the cap)
    measured = (peak_alloc + (outside_mib or 0.0)) if peak_alloc is not None else None
    as_ran = estimate_as_ran(profile, run)
    predicted = as_ran["peak_mib"] if as_ran else plan.get("predicted_peak_mib")
    predicted = round(predicted) if predicted is not None else None
    breakdown = as_ran["breakdown"] if as_ran else (plan.get("breakdown") or {})
    gpus = per_gpu(probe, predicted, profile.get("cap_mib")) if world_size(profile) > 1 else None
    console = (run / "console.log").read_text(errors="replace") if (run / "console.log").is_file() else ""
    gaps = [r for r in probe if r.get("event") == "logprob_gap"]
    gens = [r for r in probe if r.get("event") == "generate" and r.get("sampled")]
    val = {k: v for s in steps.values() for k, v in s.items() if k.startswith("val-")}
    ooms = sorted({p["oom"] for p in phases.values() if p.get("oom")})
    out = {
        "profile": name, "stands_for": profile.get("stands_for"), "cap_mib": profile.get("cap_mib"),
        "rc": result.get("rc"), "timed_out": result.get("timed_out"), "wall_s": result.get("seconds"),
        "steps_done": max(steps) if steps else 0,
        "predicted_peak_mib": predicted, "predicted_at_render_mib": plan.get("predicted_peak_mib"),
        "measured_peak_mib": round(measured, 0) if measured is not None else None,
        "measured_peak_allocated_mib": peak_alloc, "measured_peak_reserved_mib": peak_res,
        "measured_held_mib": round(peak_res + (outside_mib or 0.0), 0) if peak_res is not None else None,
        "outside_torch_mib": outside_mib,
        "ratio_measured_to_predicted": round(measured / predicted, 3) if measured and predicted else None,
        "under_cap": (peak_res <= profile["cap_mib"]) if peak_res is not None and profile.get("cap_mib") else None,
        "oom": ooms,
        "phases": {k: {**v, "seconds": round(statistics.mean(v["seconds"]), 2),
                       "predicted_mib": breakdown.get(PLAN_PHASE.get(k, ""))}
                   for k, v in sorted(phases.items())},
        **step_speed(profile, steps),
        "gen_tokens_per_s": round(statistics.mean(g["prompts"] * (g["new_tokens"] or 0) / g["seconds"] for g in gens), 1)
        if gens else None,
        "logprob_gap_max": max((g["logprob_gap_max"] for g in gaps), default=None),
        "prob_gap_max": max((g["prob_gap_max"] for g in gaps), default=None),
        "verl_rollout_probs_diff_max": max((s["training/rollout_probs_diff_max"] for s in steps.values()
                                            if "training/rollout_probs_diff_max" in s), default=None),
        "validation": val, "testing_s": _mean(list(steps.values()), "timing_s/testing"),
        "plan": {k: plan.get(k) for k in ("micro_batches", "offload", "gradient_checkpointing", "rollout")},
        "as_ran": as_ran.get("workload") if as_ran else None,
        "step_phases": step_phases(probe),
        "threads": next((r for r in probe if r.get("event") == "threads"), None),
        "profiles": read_profiles(run / "probe"),
        "export": export_summary(run),
        "gpus": profile.get("gpus", 1), "nodes": profile.get("nodes", 1), "compare_with": profile.get("compare_with"),
        "per_gpu": gpus, "own_gpu_each": own_gpu_each(gpus) if gpus else None,
        "per_gpu_within_10pct": all(g["within_10pct"] for g in gpus) if gpus else None,
        "per_gpu_under_cap": all(g["under_cap"] is not False for g in gpus) if gpus else None,
        "nccl": nccl_summary(console) if world_size(profile) > 1 else None,
        "cluster": cluster_summary(run),
        "refused": result.get("refused"),
    }
    return out


def world_size(profile: dict) -> int:
    """The run's GPUs in all: ``gpus`` per box (or Ray node) times ``nodes``."""
    return int(profile.get("gpus") or 1) * int(profile.get("nodes") or 1)


def per_gpu(probe: list[dict], predicted: float | None, cap: float | None) -> list[dict]:
    """One row per worker process (a rank of a run: verl's WorkerDict, one per GPU): its peak allocated over the
    training phases plus the most it held outside torch, against the plan's per-GPU prediction; its reserved
    peak against the cap; the GPU NVML found it on, its rank, CUDA_VISIBLE_DEVICES and Ray node (the probe's
    ``device`` record) and the span of its phase records (``own_gpu_each`` reads them)."""
    devices = {r["pid"]: r for r in probe if r.get("event") == "device"}
    by_pid: dict[int, list[dict]] = {}
    for r in probe:
        if r.get("event") == "phase" and r.get("peak_allocated_mib") is not None:
            by_pid.setdefault(r["pid"], []).append(r)
    rows = []
    for pid, records in by_pid.items():
        train = [r for r in records if r["phase"] in PHASE_ORDER]
        if not train:
            continue
        alloc = max(r["peak_allocated_mib"] for r in train)
        reserved = max(r["peak_reserved_mib"] for r in train)
        outside = max((r["outside_torch_mib"] for r in records if r.get("outside_torch_mib") is not None), default=None)
        measured = round(alloc + (outside or 0.0))
        dev = devices.get(pid, {})
        ratio = round(measured / predicted, 3) if predicted else None
        rows.append({"pid": pid, "rank": dev.get("rank", next((r.get("rank") for r in records if r.get("rank")), None)),
                     "gpu": dev.get("gpu", next((r["gpu"] for r in records if r.get("gpu") is not None), None)),
                     "gpu_uuid": dev.get("gpu_uuid"), "cuda_visible_devices": dev.get("cuda_visible_devices"),
                     "node_ip": dev.get("node_ip"), "peak_allocated_mib": alloc, "peak_reserved_mib": reserved,
                     "outside_torch_mib": outside, "measured_peak_mib": measured, "predicted_peak_mib": predicted,
                     "ratio": ratio, "within_10pct": ratio is not None and abs(ratio - 1) <= 0.10,
                     "under_cap": reserved <= cap if cap else None,
                     "span": [min(r["t"] - r["seconds"] for r in records), max(r["t"] for r in records)]})
    rows.sort(key=lambda r: r["span"][0])
    runs: list[list[dict]] = []          # processes alive together: one run's ranks (a resume profile has two runs)
    for r in rows:
        if runs and r["span"][0] < max(o["span"][1] for o in runs[-1]):
            runs[-1].append(r)
        else:
            runs.append([r])
    return [r for run in runs for r in sorted(run, key=lambda r: int(r["rank"]) if str(r["rank"]).isdigit() else -1)]


def own_gpu_each(rows: list[dict]) -> bool | None:
    """Whether no two worker processes that ran at the same time shared a GPU (a resume profile's second run may
    take the first run's GPUs in another order); None where NVML named no GPU."""
    if any(r["gpu"] is None for r in rows):
        return None
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["gpu"] == b["gpu"] and a["span"][0] < b["span"][1] and b["span"][0] < a["span"][1]:
                return False
    return True


NCCL_CHANNEL = re.compile(r"NCCL INFO Channel \d+(?:/\d+)? : \d+\[\w+\] -> \d+\[\w+\](?: \[(?:send|receive)\])? via (\S+)")
NCCL_USING = re.compile(r"NCCL INFO (Bootstrap|NET/Socket) ?: Using (.+?)\s*$")


def nccl_summary(console: str) -> dict:
    """What NCCL said at its start (NCCL_DEBUG=INFO): the interfaces its bootstrap and socket transport used
    and how many channel connections each transport took (``P2P/CUMEM/read``, ``NET/Socket/0``, ``SHM/direct/direct``).
    Empty where the run had no NCCL INFO lines."""
    transports: dict[str, int] = {}
    using: dict[str, list[str]] = {}
    for line in console.splitlines():
        m = NCCL_CHANNEL.search(line)
        if m:
            transports[m.group(1)] = transports.get(m.group(1), 0) + 1
            continue
        m = NCCL_USING.search(line)
        if m and m.group(2) not in using.setdefault(m.group(1), []):
            using[m.group(1)].append(m.group(2))
    return {"transports": dict(sorted(transports.items())), "using": using,
            "families": sorted({t.split("/")[0] if not t.startswith("NET/") else "/".join(t.split("/")[:2])
                                for t in transports})}


def cluster_summary(run: Path) -> dict | None:
    """A Ray-node run's cluster (``cluster.json``, written by run_profile.py): seconds until the head answered and
    until every node joined, the nodes Ray listed, the preflight's verdict and seconds; None for a run of one box."""
    path = run / "cluster.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    pre = record.get("preflight") or {}
    return {"formed_s": record.get("formed_s"), "head_up_s": record.get("head_up_s"),
            "nodes_alive": record.get("nodes_alive"), "interface": record.get("interface"),
            "preflight_ok": pre.get("rc") == 0 if pre else None, "preflight_s": pre.get("seconds"),
            "preflight": [detail for _, _, detail in pre.get("results") or []],
            "refused": record.get("refused"), "stopped": record.get("stopped")}


def read_run_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def logit_diffs(proof: dict) -> dict:
    """{in the export's dtype, against the checkpoint's own dtype} of an export's proof, either format."""
    if "max_abs_logit_diff_vs_checkpoint_dtype" in proof:          # format 1
        return {"logit_diff_in_export_dtype": proof.get("max_abs_logit_diff"),
                "logit_diff_vs_checkpoint_dtype": proof.get("max_abs_logit_diff_vs_checkpoint_dtype")}
    return {"logit_diff_in_export_dtype": proof.get("max_abs_logit_diff_in_export_dtype"),
            "logit_diff_vs_checkpoint_dtype": proof.get("max_abs_logit_diff")}


def export_summary(run: Path) -> dict | None:
    """What an export profile's run saved, kept, exported and scored (``run/export/``, written by
    run_profile.collect_export); None for a profile without one."""
    folder = run / "export"
    if not (folder / "checkpoints.json").is_file():
        return None
    record = json.loads((folder / "checkpoints.json").read_text())
    plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").is_file() else {}
    predicted = ((plan.get("checkpoints") or {}).get("save") or {}).get("total_bytes")
    saves = record.get("saves") or {}
    last = record["global_steps"][-1] if record.get("global_steps") else None

    def read(name):
        path = folder / name
        return json.loads(path.read_text()) if path.is_file() else None

    proof = read(f"{last}.hf.proof.json") if last else None
    trained = read(f"{last}.hf.gsm8k.json") if last else None
    base = read("gsm8k-base.json")
    save_bytes = saves[last]["bytes"] if last in saves else None
    score = lambda s: None if not s else {k: s.get(k) for k in ("accuracy", "correct", "rows", "prompts_per_s",  # noqa: E731
                                                                 "seconds", "engine", "dtype", "batch",
                                                                 "cut_at_max_new_tokens", "peak_allocated_mib")}
    return {
        "kept": record.get("global_steps"), "finished": read("run-finished.json"),
        "save_bytes": save_bytes, "save_bytes_by_role": {k: v for k, v in (saves.get(last) or {}).items()
                                                          if k in ("actor", "critic")},
        "predicted_save_bytes": predicted,
        "save_ratio": round(save_bytes / predicted, 4) if save_bytes and predicted else None,
        "proven": bool(proof and proof.get("ok")),
        "export_bytes": (proof or {}).get("export_bytes"),
        "merge_seconds": (proof or {}).get("merge_seconds"), "proof_seconds": (proof or {}).get("proof_seconds"),
        "export_seconds": round(proof["merge_seconds"] + proof["proof_seconds"], 2) if proof else None,
        # the logits against the checkpoint's weights in the export's dtype, and against its own dtype: a
        # proof of format 2 (issue 34) names them so; format 1 recorded the first as max_abs_logit_diff
        **logit_diffs(proof or {}),
        "logit_tolerance": (proof or {}).get("logit_tolerance"), "proof_device": (proof or {}).get("proof_device"),
        "proof_bench": read_run_json(run / "proof-bench.json"),
        "max_abs_weight_diff": (proof or {}).get("max_abs_weight_diff"),
        "fsdp_version": (proof or {}).get("fsdp_version"), "world_size": (proof or {}).get("world_size"),
        "base": score(base), "trained": score(trained),
    }


def step_phases(probe: list[dict]) -> dict[str, dict]:
    """Each training phase's seconds and the actor's wall-clock splits (forward, optimizer step) over its calls
    after the first (the first warms up, and the probe may have profiled it): the mean per call."""
    by_phase: dict[str, list[dict]] = {}
    for r in probe:
        if r.get("event") == "phase" and r.get("phase") in PHASE_ORDER:
            by_phase.setdefault(r["phase"], []).append(r)
    out = {}
    for phase, records in by_phase.items():
        later = records[1:] or records
        splits: dict[str, float] = {}
        for r in later:
            for k, v in (r.get("splits") or {}).items():
                splits[k] = splits.get(k, 0.0) + v / len(later)
        out[phase] = {"calls": len(later), "seconds": round(statistics.mean(r["seconds"] for r in later), 2),
                      **{k: round(v, 2) for k, v in splits.items()}}
    return out


def read_profiles(folder: Path) -> list[dict]:
    """The probe's profile tables (VERL_LAB_PROFILE): per profiled call, its time per category."""
    out = []
    for f in sorted(folder.glob("profile-*.json")):
        try:
            table = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        out.append({"phase": table.get("phase"), "call": table.get("call"), "forwards": table.get("forwards"),
                    "wall_s": table.get("wall_s"),
                    "categories": table.get("categories") or {}, "top_self_cpu": (table.get("top_self_cpu") or [])[:8],
                    "top_self_device": (table.get("top_self_device") or [])[:8]})
    return out


def ran_overrides(profile: dict, run: Path | None = None) -> dict[str, str] | None:
    """The Hydra overrides the run's verl got, key -> value (later ones win, ``+``/``++`` dropped):
    the plan's (``plan.json`` in the run folder, the launcher's ``overrides``) then the extra ones
    the harness passed after ``--`` (``command.json``; else the profile's ``overrides`` and
    ``extra_overrides``). None where the run folder has no plan.json (runs of calls 1-3: their
    profile's plan says what ran)."""
    if run is None or not (run / "plan.json").is_file():
        return None
    lines = list(json.loads((run / "plan.json").read_text()).get("overrides") or [])
    command = run / "command.json"
    if command.is_file():
        cmd = json.loads(command.read_text())
        if cmd and isinstance(cmd[0], list):    # a resume profile's two runs: the second is the whole run
            cmd = cmd[-1]
        lines += cmd[cmd.index("--") + 1:] if "--" in cmd else []
    else:
        lines += list(profile.get("overrides") or []) + list(profile.get("extra_overrides") or [])
    out = {}
    for line in lines:
        key, _, value = line.lstrip("+").partition("=")
        out[key] = value
    return out


def estimate_as_ran(profile: dict, run: Path | None = None) -> dict | None:
    """The current memory model's estimate of exactly the configuration a profile ran, so runs
    made before a calibration are compared with the model as it is now. Where the run folder
    holds the plan (``plan.json``), the workload is rebuilt from the overrides verl got
    (``ran_overrides``): the algorithm (GRPO: no critic), rollout.n, the KL loss (the ref),
    FSDP2 with CPUOffloadPolicy and patches 0007-0008's knobs, the batch and mini-batch, lengths, the
    rollout engine, the micro-batches and HF chunk, gradient checkpointing and each FSDP1 offload; otherwise from the
    profile's plan (micro-batches, offloads, checkpointing, rollout) on the default PPO workload."""
    plan = profile.get("plan")
    if not plan:
        return None
    sys.path.insert(0, str(REPO))
    from dataclasses import replace

    from bench.gpu.ppo_profiles import settings_data
    from tasks.plan import OFFLOAD_KNOBS, GpuTarget, MemoryChoice, choose_precision, default_estimator, workload_for
    from tasks.settings import load_settings

    settings = load_settings(profile["name"], settings_data(profile))
    # per GPU at the run's world size (a cluster's plan is make_plan at nodes x gpus: tasks.plan.cluster_plan)
    gpu = GpuTarget(profile["gpu_name"], profile["compute_capability"], profile["memory_mib"], world_size(profile))
    workload = replace(workload_for(settings), rollout_engine=profile.get("rollout") or profile.get("rollout_engine", "auto"),
                       train_batch_size=plan["train_batch_size"], lora=bool(plan.get("lora")))
    mb = plan["micro_batches"]
    offload = dict(plan["offload"])
    grad_ckpt = bool(plan.get("gradient_checkpointing", True))
    actor_mb, lp_mb, critic_mb, rollout_mb = mb["actor"], mb["log_prob"], mb["critic"], mb["rollout"]
    knobs = {k: bool((plan.get("offload_knobs") or {}).get(k)) for k in OFFLOAD_KNOBS}
    ran = ran_overrides(profile, run)
    if ran is not None:
        a, r = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
        true = lambda key, default=False: ran.get(key, str(default)).lower() == "true"   # noqa: E731
        grpo = ran.get("algorithm.adv_estimator", "gae") == "grpo"
        workload = replace(
            workload, algorithm="grpo" if grpo else "ppo", rollout_n=int(ran.get(r + "n", 1)),
            use_kl_loss=true(a + "use_kl_loss"),
            actor_offload_policy=ran.get(a + "strategy") == "fsdp2" and true(a + "fsdp_config.offload_policy"),
            train_batch_size=int(ran.get("data.train_batch_size", workload.train_batch_size)),
            ppo_mini_batch_size=int(ran.get(a + "ppo_mini_batch_size", workload.ppo_mini_batch_size)),
            max_prompt_length=int(ran.get("data.max_prompt_length", workload.max_prompt_length)),
            max_response_length=int(ran.get("data.max_response_length", workload.max_response_length)),
            rollout_engine=ran.get(r + "name", workload.rollout_engine),
            lora=int(ran.get("actor_rollout_ref.model.lora_rank", 0)) > 0,
            lora_rank=int(ran.get("actor_rollout_ref.model.lora_rank", 0)) or workload.lora_rank)
        actor_mb = int(ran.get(a + "ppo_micro_batch_size_per_gpu", actor_mb))
        critic_mb = int(ran.get("critic.ppo_micro_batch_size_per_gpu", critic_mb)) if not grpo else actor_mb
        lp_mb = int(ran.get(r + "log_prob_micro_batch_size_per_gpu", lp_mb))
        rollout_mb = int(ran.get(r + "micro_batch_size", rollout_mb))
        grad_ckpt = true("actor_rollout_ref.model.enable_gradient_checkpointing", grad_ckpt)
        offload = {"actor_param_offload": true(a + "fsdp_config.param_offload"),
                   "actor_optimizer_offload": true(a + "fsdp_config.optimizer_offload"),
                   "ref_param_offload": true("actor_rollout_ref.ref.fsdp_config.param_offload"),
                   "critic_param_offload": not grpo and true("critic.model.fsdp_config.param_offload"),
                   "critic_optimizer_offload": not grpo and true("critic.model.fsdp_config.optimizer_offload")}
        knobs = {k: workload.actor_offload_policy and true(key) for k, (key, _) in OFFLOAD_KNOBS.items()}
    if workload.actor_offload_policy and workload.uses_critic:
        # PPO with the critic on FSDP2 CPU offload (GPU call 6): verl 0.5.0 could not build it; no estimate
        return {"peak_mib": None, "breakdown": {}, "workload": None}
    # HFRollout generates at most the step's sequences at once, whatever chunk it was given
    rollout_mb = min(rollout_mb, workload.train_batch_size * workload.rollout_n)
    precision, _ = choose_precision(gpu, False, workload.rollout_engine)
    choice = MemoryChoice(offload=offload, actor_micro_batch=actor_mb, log_prob_micro_batch=lp_mb,
                          critic_micro_batch=critic_mb, rollout_micro_batch=rollout_mb, grad_ckpt=grad_ckpt,
                          **knobs)
    est = default_estimator(gpu, workload, precision, choice)
    return {"peak_mib": est.peak_mib, "breakdown": dict(est.breakdown),
            "workload": {"algorithm": workload.algorithm, "rollout_n": workload.rollout_n,
                         "use_kl_loss": workload.use_kl_loss, "actor_offload_policy": workload.actor_offload_policy,
                         "train_batch_size": workload.train_batch_size, "rollout": precision.rollout,
                         "micro_batches": {"actor": actor_mb, "critic": critic_mb if workload.uses_critic else None,
                                           "log_prob": lp_mb, "rollout": rollout_mb},
                         "gradient_checkpointing": grad_ckpt, "offload": offload,
                         "offload_knobs": {k: v for k, v in knobs.items() if v}}}


def _mean(steps: list[dict], key: str):
    vals = [s[key] for s in steps if key in s]
    return round(statistics.mean(vals), 2) if vals else None


def _batch_from_overrides(profile: dict):
    for o in profile.get("overrides") or []:
        if o.startswith("data.train_batch_size="):
            return int(o.split("=", 1)[1])
    return None


def _header(head: str) -> list[str]:
    """A markdown table's first two lines."""
    return [head, "|" + "---|" * (head.count("|") - 1)]


def markdown(rows: list[dict]) -> str:
    head = ("| profile | cap MiB | predicted peak MiB | measured peak MiB (allocated + outside torch) | "
            "measured / predicted | held MiB (reserved + outside torch) | s/step | prompts/s | tokens/s | "
            "log-prob gap max | OOM |")
    lines = _header(head)
    for r in rows:
        lines.append(f"| {r['profile']} | {r['cap_mib'] or '-'} | {r['predicted_peak_mib'] or '-'} | "
                     f"{r['measured_peak_mib'] or '-'} | {r['ratio_measured_to_predicted'] or '-'} | "
                     f"{r['measured_held_mib'] or '-'} | {r['s_per_step'] or '-'} | "
                     f"{r['prompts_per_s'] or '-'} | {r['tokens_per_s'] or '-'} | "
                     f"{r['logprob_gap_max'] if r['logprob_gap_max'] is not None else '-'} | "
                     f"{'yes' if r['oom'] else 'no'} |")
    return "\n".join(lines)


def phase_markdown(rows: list[dict]) -> str:
    lines = ["| profile | phase | calls | predicted MiB (allocated) | peak allocated MiB | peak reserved MiB | s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for k in PHASE_ORDER:
            p = r["phases"].get(k)
            if p:
                lines.append(f"| {r['profile']} | {k} | {p['calls']} | {p['predicted_mib'] or '-'} | "
                             f"{p['peak_allocated_mib']} | {p['peak_reserved_mib']} | {p['seconds']} |")
    return "\n".join(lines)


def export_markdown(rows: list[dict]) -> str:
    lines = _header("| profile | saves kept | one save (bytes) | predicted | measured / predicted | export (bytes) | "
                    "merge + proof s (device) | logit diff (bf16 / checkpoint dtype, limit) | GSM8K base -> trained (rows) | "
                    "eval prompts/s (base, trained) | proof before / today s (same step) |")
    for r in rows:
        e = r.get("export")
        if not e:
            continue
        base, trained = e["base"] or {}, e["trained"] or {}
        lines.append(f"| {r['profile']} | {', '.join(e['kept'] or []) or '-'} | {e['save_bytes'] or '-'} | "
                     f"{e['predicted_save_bytes'] or '-'} | {e['save_ratio'] or '-'} | {e['export_bytes'] or '-'} | "
                     f"{e['merge_seconds']} + {e['proof_seconds']} ({e.get('proof_device') or 'cpu'}) | "
                     f"{e['logit_diff_in_export_dtype']} / {e['logit_diff_vs_checkpoint_dtype']}, "
                     f"{e.get('logit_tolerance')} | {base.get('accuracy')} -> {trained.get('accuracy')} "
                     f"({trained.get('rows') or base.get('rows')}) | {base.get('prompts_per_s')}, "
                     f"{trained.get('prompts_per_s')} | {_bench(e.get('proof_bench'))} |")
    return "\n".join(lines)


def _bench(bench: dict | None) -> str:
    if not bench:
        return "-"
    if bench.get("skipped"):
        return f"skipped ({bench['skipped']})"
    side = lambda r: f"cut at {r.get('timeout')} s" if r.get("timed_out") else r.get("seconds")  # noqa: E731
    return f"{side(bench.get('before') or {})} / {side(bench.get('today') or {})}"


def speed_markdown(rows: list[dict]) -> str:
    """Each card's plan before and after (profiles NAME-before, NAME-after of one session): prompts/s over steps
    2.., the ratio, the whole-run peak against the prediction and the cap, and the log-prob gap."""
    by_name = {r["profile"]: r for r in rows}
    lines = _header("| card | prompts/s before | prompts/s after | after / before | s/step before / after | "
                    "peak / predicted MiB (after) | ratio | cap MiB | held MiB (after) | log-prob gap before / after | "
                    "OOM |")
    for name in sorted({n.rsplit("-", 1)[0] for n in by_name if n.endswith(("-before", "-after"))}):
        b, a = by_name.get(f"{name}-before", {}), by_name.get(f"{name}-after", {})
        ratio = round(a["prompts_per_s"] / b["prompts_per_s"], 2) if a.get("prompts_per_s") and b.get("prompts_per_s") else "-"
        gap = lambda r: r.get("logprob_gap_max") if r.get("logprob_gap_max") is not None else "-"   # noqa: E731
        lines.append(f"| {name} | {b.get('prompts_per_s') or '-'} | {a.get('prompts_per_s') or '-'} | **{ratio}** | "
                     f"{b.get('s_per_step') or '-'} / {a.get('s_per_step') or '-'} | "
                     f"{a.get('measured_peak_mib') or '-'} / {a.get('predicted_peak_mib') or '-'} | "
                     f"{a.get('ratio_measured_to_predicted') or '-'} | {a.get('cap_mib') or '-'} | "
                     f"{a.get('measured_held_mib') or '-'} | {gap(b)} / {gap(a)} | "
                     f"{'yes' if b.get('oom') or a.get('oom') else 'no'} |")
    return "\n".join(lines)


def time_markdown(rows: list[dict]) -> str:
    """Where a step's time goes: each phase's seconds over calls 2.. with the actor's splits, and the profiled
    calls' categories (ms; CPU ranges are inclusive CPU time, copies and kernels device time)."""
    splits = ("forward", "backward", "optimizer_step", "adamw_step")
    lines = _header("| profile | phase | s | " + " | ".join(f"{k.replace('_', ' ')} s (calls)" for k in splits) + " |")
    for r in rows:
        for phase in PHASE_ORDER:
            p = (r.get("step_phases") or {}).get(phase)
            if p:
                lines.append(f"| {r['profile']} | {phase} | {p['seconds']} | " + " | ".join(
                    f"{p.get(k + '_s', '-')} ({p.get(k + '_calls', '-')})" for k in splits) + " |")
    lines += ["", "| profile | profiled call | wall s | category: ms (count) |", "|---|---|---|---|"]
    for r in rows:
        for prof in r.get("profiles") or []:
            cats = sorted(prof["categories"].items(), key=lambda kv: -(kv[1].get("ms") or 0))
            text = "; ".join(f"{k}: {v['ms']:.0f}" + (f" ({v['count']})" if v.get("count") else "") for k, v in cats[:9])
            window = f" ({prof['forwards']} forwards)" if prof.get("forwards") else ""
            lines.append(f"| {r['profile']} | {prof['phase']}:{prof['call']}{window} | {prof['wall_s']} | {text} |")
    threads = [f"{r['profile']}: {r['threads']['torch_threads']} (OMP_NUM_THREADS {r['threads']['omp_num_threads']}, "
               f"{r['threads']['cpus_allowed']} CPUs)" for r in rows if r.get("threads")]
    if threads:
        lines += ["", "torch CPU threads in the worker: " + "; ".join(threads)]
    return "\n".join(lines)


def ratios(runs: Path, names: list[str]) -> str:
    """prompts/s of each named run and each card's after / before, from the consoles alone (no memory model:
    this runs on the device machine too, where bench/gpu/run_speed.sh prints it)."""
    speed = {}
    lines = []
    for name in names:
        profile, steps = read_run(runs / name)
        speed[name] = step_speed(profile, steps)["prompts_per_s"]
        counted = "2.." if any(n >= 2 for n in steps) else "1 (the only one)"
        lines.append(f"{name:20} steps {sorted(steps)}  s/step (step {counted}) {step_speed(profile, steps)['s_per_step']}  "
                     f"prompts/s {speed[name]}")
    for card in sorted({n.rsplit("-", 1)[0] for n in names}):
        before, after = speed.get(f"{card}-before"), speed.get(f"{card}-after")
        if before and after:
            lines.append(f"{card}: after / before = {after / before:.2f}")
    return "\n".join(lines)


def scaling(rows: list[dict]) -> list[dict]:
    """Each run with a ``compare_with`` run among ``rows``: prompts/s and s/step of both and their ratio (2 GPUs /
    1 GPU; 2 Ray nodes / one box of 2 GPUs), with the cluster's formation seconds where it formed one."""
    by_name = {r["profile"]: r for r in rows}
    out = []
    for r in rows:
        base = by_name.get(r.get("compare_with") or "")
        if base is None:
            continue
        ratio = (round(r["prompts_per_s"] / base["prompts_per_s"], 3)
                 if r.get("prompts_per_s") and base.get("prompts_per_s") else None)
        out.append({"profile": r["profile"], "base": base["profile"],
                    "gpus": r.get("gpus", 1) * r.get("nodes", 1), "base_gpus": base.get("gpus", 1) * base.get("nodes", 1),
                    "nodes": r.get("nodes", 1), "prompts_per_s": r.get("prompts_per_s"),
                    "base_prompts_per_s": base.get("prompts_per_s"), "ratio": ratio, "s_per_step": r.get("s_per_step"),
                    "base_s_per_step": base.get("s_per_step"),
                    "formed_s": (r.get("cluster") or {}).get("formed_s")})
    return out


def scaling_markdown(rows: list[dict]) -> str:
    """The scaling table, then every rank of the several-GPU runs: peak against the per-GPU prediction and the cap,
    its GPU, and NCCL's transports."""
    lines = _header("| run | against | GPUs (nodes) | prompts/s | against's prompts/s | ratio | s/step (against) | "
                    "cluster formed s |")
    for c in scaling(rows):
        lines.append(f"| {c['profile']} | {c['base']} | {c['gpus']} ({c['nodes']}) | {c['prompts_per_s'] or '-'} | "
                     f"{c['base_prompts_per_s'] or '-'} | **{c['ratio'] or '-'}** | {c['s_per_step'] or '-'} "
                     f"({c['base_s_per_step'] or '-'}) | {c['formed_s'] if c['formed_s'] is not None else '-'} |")
    lines += [""] + _header("| run | rank | GPU (CUDA_VISIBLE_DEVICES) | node | measured peak MiB | predicted per GPU | "
                            "measured / predicted | reserved peak MiB | cap MiB | NCCL transports |")
    for r in rows:
        nccl = r.get("nccl") or {}
        transports = ", ".join(f"{k} x{v}" for k, v in (nccl.get("transports") or {}).items()) or "-"
        for g in r.get("per_gpu") or []:
            lines.append(f"| {r['profile']} | {g['rank']} | {g['gpu']} ({g['cuda_visible_devices']}) | "
                         f"{g['node_ip'] or '-'} | {g['measured_peak_mib']} | {g['predicted_peak_mib'] or '-'} | "
                         f"{g['ratio'] or '-'}{'' if g['within_10pct'] else ' (outside 10%)'} | {g['peak_reserved_mib']} | "
                         f"{r['cap_mib'] or '-'}{'' if g['under_cap'] is not False else ' (over)'} | {transports} |")
    return "\n".join(lines)


def scaling_lines(runs: Path, names: list[str]) -> str:
    """prompts/s of each named run and its ratio against its ``compare_with`` run, and a cluster's formation and
    preflight, from the consoles and records alone (no memory model: bench/gpu/run_multi.sh prints it on the
    device machine)."""
    lines, speed = [], {}
    for name in names:
        profile, steps = read_run(runs / name)
        run = json.loads((runs / name / "run.json").read_text()) if (runs / name / "run.json").is_file() else {}
        speed[name] = step_speed(profile, steps)
        lines.append(f"{name:22} rc {run.get('rc')}  steps {sorted(steps)}  s/step {speed[name]['s_per_step']}  "
                     f"prompts/s {speed[name]['prompts_per_s']}" + (f"  refused: {run['refused']}" if run.get("refused") else ""))
        cluster = cluster_summary(runs / name)
        if cluster:
            lines.append(f"{'':22} cluster formed in {cluster['formed_s']} s (head up {cluster['head_up_s']} s), "
                         f"preflight {'passed' if cluster['preflight_ok'] else 'FAILED'} in {cluster['preflight_s']} s")
        base = profile.get("compare_with")
        if base and base not in speed and (runs / base).is_dir():
            speed[base] = step_speed(*read_run(runs / base))
        if base in speed and speed[name]["prompts_per_s"] and speed[base]["prompts_per_s"]:
            lines.append(f"{'':22} {name} / {base} = {speed[name]['prompts_per_s'] / speed[base]['prompts_per_s']:.2f} "
                         "(prompts/s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+",
                    help="run folders' parent(s): several calls' folders make one table (--ratios, --scaling: one)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--speed", action="store_true", help="markdown: the before/after table and where the time goes")
    ap.add_argument("--ratios", nargs="+", metavar="PROFILE",
                    help="prompts/s of these runs and after / before per card, from the consoles only")
    ap.add_argument("--multi", action="store_true",
                    help="markdown: 2 GPUs / 1 and 2 nodes / 1 box, and every rank's peak against the per-GPU plan")
    ap.add_argument("--scaling", nargs="+", metavar="PROFILE",
                    help="prompts/s of these runs against their compare_with runs, from the consoles only")
    args = ap.parse_args(argv)
    if (args.ratios or args.scaling) and len(args.runs) > 1:
        ap.error("--ratios and --scaling read one folder of runs")
    if args.ratios:
        print(ratios(args.runs[0], args.ratios))
        return 0
    if args.scaling:
        print(scaling_lines(args.runs[0], args.scaling))
        return 0
    rows = [summarise(d) for runs in args.runs for d in sorted(runs.iterdir())
            if d.is_dir() and (d / "console.log").is_file()]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.multi:
        print(scaling_markdown(rows))
    elif args.speed:
        print(speed_markdown(rows))
        print()
        print(time_markdown(rows))
    elif args.markdown:
        print(markdown(rows))
        print()
        print(phase_markdown(rows))
        if any(r.get("export") for r in rows):
            print()
            print(export_markdown(rows))
    else:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
