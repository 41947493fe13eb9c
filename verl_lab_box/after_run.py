"""What follows a training run (the training launcher's part, verl_lab_box/after_run.py).

Placed by tasks/train.py as ``<train_dir>/verl_lab_after_run.py`` beside the launcher
(``train-launcher``, verl_lab_box/train_launcher.py), which loads it (``after_run_module``) and hands
it what it uses of the launcher as ``launcher``: its loader of box files, its child runner, ``ray.env``.
Standard library only. What it decides: whether the run finished and at which step
(``<checkpoint_dir>/run-finished.json``, verl's tracker, the plan's last step), and the after-run:
a Ray cluster's step gathered on the head (``cluster-gather``), then the export (``verl_lab_export.py``)
and the GSM8K scores (``verl_lab_score.py``) with the env's Python; the launcher's docstring tells
the three ways a run ends.
"""

import hashlib
import json
import os
import sys

EXPORTERS = ("verl_lab_export.py", "export.py")                    # the export and its proof
SCORERS = ("verl_lab_score.py", "gsm8k_score.py")                 # the GSM8K score
FINISHED = "run-finished.json"          # in the checkpoint folder: the run finished at this step
TRACKER = "latest_checkpointed_iteration.txt"   # verl's trainer writes it after each save
AFTER_RUN_FAILED = 70                    # the run finished, its export or score failed: not restarted
launcher = None     # what this part uses of the launcher that loaded it (train_launcher.part)


def latest_checkpoint(launch):
    return launcher.checkpoints_module().read_tracker(
        launcher.checkpoints_module().read_small(os.path.join(launch.checkpoint_dir, TRACKER)) or "")


def run_digest(launch, extra):
    return hashlib.sha256(json.dumps([*launch.overrides, *extra]).encode()).hexdigest()


def finished_step(launch, extra=None):
    """The step the run finished at (``run-finished.json``), when that is still the latest checkpoint
    and, with ``extra`` given, the run had these overrides; else None."""
    try:       # the train user's folder: no FIFO waited on, no link followed (checkpoints.py read_small)
        record = json.loads(launcher.checkpoints_module().read_small(os.path.join(launch.checkpoint_dir, FINISHED)) or "")
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("step") is None or record.get("step") != latest_checkpoint(launch):
        return None
    if extra is not None and record.get("overrides_sha256") != run_digest(launch, extra):
        return None
    return record["step"]


def record_finished(launch, extra):
    """``run-finished.json``: the run finished at the latest checkpoint, with these overrides."""
    done = latest_checkpoint(launch)
    part = os.path.join(launch.checkpoint_dir, FINISHED + ".part")
    with open(part, "w") as fh:
        json.dump({"step": done, "overrides_sha256": run_digest(launch, extra)}, fh)
    os.replace(part, os.path.join(launch.checkpoint_dir, FINISHED))
    return done


def marker_value(path, key):
    """An integer ``key=value`` of a stage's marker (the data stage's ``train_rows``), or None."""
    try:
        with open(path) as fh:
            found = dict(line.strip().partition("=")[::2] for line in fh if "=" in line)
    except OSError:
        return None
    value = found.get(key, "")
    return int(value) if value.isdigit() else None


def at_last_step(launch, extra):
    """The planned last step when the latest checkpoint is at or past it, else None: verl 0.5.0
    adds 1 to the step it loads before it checks for the last one (ray_trainer.py ``fit``), so
    started again from its last save it would train a step past the plan."""
    last = launcher.checkpoints_module().planned_last_step(launch.run_overrides(extra),
                                                           marker_value(launch.data_marker, "train_rows"))
    latest = latest_checkpoint(launch)
    return last if last is not None and latest is not None and latest >= last else None


def gather_on_head(launch, step):
    """A Ray cluster's run: each node saved its own ranks' shards on its own disk; ``cluster-gather`` (beside
    the plan, as the cluster stage places it) copies the step's model shards and rank 0's files the head lacks,
    over Ray. None when the export may go on (gathered, or no save at all); else the exit status: 2 on a
    worker (a cluster is exported on its head), AFTER_RUN_FAILED when the step cannot be made whole here."""
    try:
        env = launcher.ray_env(launch)
    except OSError as exc:
        print(f"verl-lab: a cluster run, but {exc.filename or 'ray.env'} cannot be read ({exc.strerror or exc}): "
              "re-run deploy/cluster.py; not exported", file=sys.stderr, flush=True)
        return AFTER_RUN_FAILED
    me, head = env.get("VERL_LAB_NODE_IP", ""), env.get("RAY_ADDRESS", "").rpartition(":")[0]
    if me and head and me != head:
        print(f"verl-lab: this box ({me}) is a worker of the Ray cluster whose head is {head}: a cluster run is "
              "exported on its head (train-launcher --export there, or deploy/export.py)", file=sys.stderr, flush=True)
        return 2
    saves = [o.split("=", 1)[1] for o in launch.run_overrides(launch.extra) if o.startswith("trainer.save_freq=")]
    if step is None:
        if saves and saves[-1].isdigit() and int(saves[-1]) > 0:
            # the run saved, yet the head has no tracker: verl's TaskRunner wrote it on another node's disk
            print(f"verl-lab: the cluster run saved (trainer.save_freq={saves[-1]}) but {launch.checkpoint_dir} has "
                  f"no {TRACKER}: verl's TaskRunner ran on another node (is patch 0010 in the env? deploy/env.py "
                  "applies it), so the export and a restart cannot find the checkpoint: not exported",
                  file=sys.stderr, flush=True)
            return AFTER_RUN_FAILED
        return None
    gather = [launch.env_python, os.path.join(os.path.dirname(os.path.abspath(launch.plan_file)), "cluster-gather"),
              "--plan", launch.plan_file, "--step", str(step)]
    if launch.gather_timeout_s:           # every call to a node within it: a node that hangs ends the gather
        gather += ["--timeout", str(launch.gather_timeout_s)]
    try:
        rc = launcher.run_child(gather, launch.work_dir, env=env)
    except OSError as exc:
        rc = f"not run ({exc})"
    if rc != 0:
        print(f"verl-lab: the cluster's step {step} cannot be gathered on this head (cluster-gather exit {rc}; its "
              "reason is above): not exported", file=sys.stderr, flush=True)
        return AFTER_RUN_FAILED
    return None


def export_ram_mib(launch, gpu_free):
    """The host RAM the export needs (plan.json ``launch.checkpoints.export_host_ram``: its fp32
    model on the GPU once training released it, else in host RAM), or None in older plans. The
    export checks it against MemAvailable under the step's lock, before it merges."""
    ram = (launch.checkpoints or {}).get("export_host_ram")
    return (ram["gpu_free_mib"] if gpu_free else ram["gpu_busy_mib"]) if ram else None


def after_run(launch, final, score=True, gpu_free=False):
    """The latest actor checkpoint as a proven Hugging Face folder (verl_lab_export.py), then the base
    model's GSM8K score (kept once made) and the export's (verl_lab_score.py); a Ray cluster's step gathered on
    the head first (``gather_on_head``). 0, AFTER_RUN_FAILED, or 2 on a cluster's worker."""
    step = latest_checkpoint(launch)
    ckpt = launch.checkpoint_dir
    ev = launch.evaluation
    if any(o.startswith("trainer.nnodes=") and o != "trainer.nnodes=1" for o in launch.overrides):
        rc = gather_on_head(launch, step)
        if rc is not None:
            return rc
    if step is None:
        print(f"verl-lab: no checkpoint in {ckpt} to export (trainer.save_freq=-1?)", flush=True)
        return 0
    try:
        exporter, scorer = launcher.box_file(EXPORTERS), launcher.box_file(SCORERS)
    except ImportError as exc:
        print(f"verl-lab: {exc}", file=sys.stderr, flush=True)
        return AFTER_RUN_FAILED
    cmd = [launch.env_python, exporter, "--checkpoint-dir", ckpt, "--step", str(step)]
    if export_ram_mib(launch, gpu_free):
        cmd += ["--host-ram-mib", str(export_ram_mib(launch, gpu_free))]
    if launcher.run_child(cmd + (["--final"] if final else []), launch.work_dir) != 0:
        print(f"verl-lab: the export of step {step} failed (the merge's or the proof's error is above)",
              file=sys.stderr, flush=True)
        return AFTER_RUN_FAILED
    if not score:
        return 0
    if not ev or ev.get("problem"):
        why = ev["problem"] if ev else "it has no evaluation section (written by an older deploy/train.py?)"
        print(f"verl-lab: not scored: {launch.plan_file}: {why}", flush=True)
        return 0
    common = ["--data", ev["test_file"], "--engine", ev["engine"], "--dtype", ev["dtype"], "--batch", str(ev["batch"]),
              "--prompt-len", str(ev["prompt_len"]), "--max-new-tokens", str(ev["max_new_tokens"]),
              "--tensor-parallel", str(ev.get("tensor_parallel_size") or 1)]
    if ev.get("vllm_gpu_memory_utilization"):
        common += ["--vllm-share", str(ev["vllm_gpu_memory_utilization"])]
    step_dir = os.path.join(ckpt, f"global_step_{step}")
    scores = {"base": ([launch.model_dir, os.path.join(ckpt, "gsm8k-base.json"), "base", "0"], False),
              "trained": ([os.path.join(step_dir, "hf"), os.path.join(step_dir, "hf.gsm8k.json"), f"global_step_{step}",
                           str(step)], final)}
    found = {}
    for what, ((model, out, label, at), is_final) in scores.items():
        cmd = [launch.env_python, scorer, "--model", model, "--out", out, "--label", label, "--step", at,
               *common, *(["--final"] if is_final else [])]
        if launcher.run_child(cmd, launch.work_dir) != 0:
            print(f"verl-lab: the GSM8K score of the {what} model failed (its error is above)", file=sys.stderr,
                  flush=True)
            return AFTER_RUN_FAILED
        with open(out) as fh:
            found[what] = json.load(fh)
    base, trained = found["base"], found["trained"]
    print(f"verl-lab: GSM8K {base['accuracy']:.4f} (base) -> {trained['accuracy']:.4f} (step {step}"
          f"{'' if final else ', not final'}) on {trained['rows']} test prompts, {ev['engine']} greedy", flush=True)
    return 0
