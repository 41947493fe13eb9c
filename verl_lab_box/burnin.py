"""The burn-in: a few minutes of verl on this box's own plan that must show the reward rising, the card's memory and
speed against the plan, a save, a resume and an export (the training launcher's part; docs/burnin.md).

Placed by the burn-in stage (tasks/burnin/stage.py) as ``<train_dir>/verl_lab_burnin.py`` beside the launcher, which
loads it for ``train-launcher --burnin`` and hands it what it uses of the launcher as ``launcher``. It reads the
box's plan.json and, beside it, ``burnin-plan.json`` (tasks/burnin/plan.py: the steps, the reward, the learning
rate and the test of "rises" with their reasons, the plan's memory per phase and the speed model's seconds). In its
own folder (``burnin-plan.json``'s ``folder``, the train user's), never the run's checkpoints or trackers, it

1. refuses while the training unit runs (exit ``REFUSED``), then runs the launcher's preflight;
2. runs verl (verl_lab_box/burnin_driver.py, with the probe and the reward manager in every process) for the first
   steps, which end in a save, then again from that save (``trainer.resume_mode=auto``) for the rest;
3. exports the last save with its proof (verl_lab_box/export.py, as a finished run's) and compares the saved
   weights with the model folder (verl_lab_box/burnin_weights.py);
4. judges it (verl_lab_box/burnin_judge.py), writes ``burnin.json`` in its folder (``state``: running, passed,
   failed), prints a ``verl-lab burn-in FAIL <reason>:`` line per failed check (the doctor's rules read them:
   files/doctor/burnin.toml) and removes its saves and export unless ``--keep``.

Exit status 0 when it passed, 1 when it failed, ``REFUSED`` when the training unit runs, 2 without a burn-in plan.
"""

import copy
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import time

launcher = None     # what this part uses of the launcher that loaded it (train_launcher.part)
BURNIN_PLAN = "burnin-plan.json"      # beside plan.json, placed by deploy/burnin.py
RECORD = "burnin.json"                # in the burn-in's folder
REFUSED = 3
JUDGE = ("verl_lab_burnin_judge.py", "burnin_judge.py")
DRIVER = ("verl_lab_burnin_driver.py", "burnin_driver.py")
WEIGHTS = ("verl_lab_burnin_weights.py", "burnin_weights.py")
EXPORTERS = ("verl_lab_export.py", "export.py")
TRACKER = "latest_checkpointed_iteration.txt"
BUSY = ("active", "activating", "reloading", "deactivating")


def say(msg, err=False):
    print(f"verl-lab burn-in: {msg}", file=sys.stderr if err else sys.stdout, flush=True)


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def load_burnin_plan(launch):
    """``burnin-plan.json`` beside plan.json; ValueError saying why not and what to run."""
    path = os.path.join(os.path.dirname(os.path.abspath(launch.plan_file)), BURNIN_PLAN)
    try:
        with open(path) as fh:
            plan = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read ({exc}): run deploy/burnin.py (it places it)") from None
    missing = [k for k in ("folder", "train_unit", "runs", "overrides", "rises") if k not in plan]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: run deploy/burnin.py again")
    return plan


def unit_busy(unit):
    """The training unit's state words where it runs (or starts, or restarts), else None."""
    try:
        out = subprocess.run(["systemctl", "show", "-p", "ActiveState", "-p", "SubState", "--value", unit],
                             capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return f"{out[0]} ({out[1]})" if len(out) >= 2 and out[0] in BUSY else None


def override_key(override):
    return override.split("=", 1)[0].lstrip("+")


def merged(plan_overrides, burnin_overrides):
    """The plan's overrides with the burn-in's: a key the plan sets takes the burn-in's value in its place, the
    others follow."""
    mine = {override_key(o): o for o in burnin_overrides}
    out = [mine.pop(override_key(o), o) for o in plan_overrides]
    return out + [o for o in burnin_overrides if override_key(o) in mine]


def jsonl(folder, prefix):
    """Every JSON line of ``<folder>/<prefix>-*.jsonl``, by time."""
    lines = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if name.startswith(prefix + "-") and name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as fh:
                lines += [json.loads(line) for line in fh if line.strip()]
    return sorted(lines, key=lambda r: r.get("t", 0))


def saved_check(ckpt, step, roles):
    """The save of ``step``: verl's tracker names it and each role's folder holds files."""
    folder = os.path.join(ckpt, f"global_step_{step}")
    try:
        with open(os.path.join(ckpt, TRACKER)) as fh:
            tracked = int(fh.read().strip())
    except (OSError, ValueError):
        tracked = None
    sizes = {}
    for role in roles:
        role_dir = os.path.join(folder, role)
        sizes[role] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(role_dir) for f in fs)
    missing = [r for r, size in sizes.items() if not size]
    if tracked != step or missing:
        why = (f"no files in {', '.join(missing)}" if tracked == step else
               f"verl's tracker file names step {tracked}" if tracked is not None else f"no {TRACKER}")
        return {"id": "save-failed", "ok": False, "words": f"no whole save of step {step} in {folder}: {why}",
                "bytes": sizes}
    return {"id": "save", "ok": True, "words": f"step {step} saved: " + ", ".join(
        f"{r} {launcher.checkpoints_module().gib(b)}" for r, b in sizes.items()), "bytes": sizes}


def resume_check(phases, metrics, saved, started):
    """The second run loaded the save (the probe saw ``load_checkpoint``, after its start) and went on from it."""
    loads = [p for p in phases if p.get("phase") == "load_checkpoint" and p.get("t", 0) >= started]
    later = sorted(s for s in metrics if s > saved)
    failed = [p["error"] for p in loads if p.get("error")]
    if failed or not loads or not later or later[0] != saved + 1:
        why = (failed[0][:300] if failed else "no load_checkpoint call" if not loads
               else f"its first step is {later[0] if later else 'none'}, not {saved + 1}")
        return {"id": "resume-failed", "ok": False, "words": f"the run from the save of step {saved} did not resume it: "
                                                             f"{why}"}
    seconds = max(p.get("seconds", 0) for p in loads)
    return {"id": "resume", "ok": True, "seconds": seconds,
            "words": f"resumed from step {saved} ({len(loads)} load_checkpoint calls, {seconds:.1f} s), then steps "
                     f"{later[0]}-{later[-1]}"}


def export_check(launch, ckpt, step):
    """The last save as a proven Hugging Face folder (verl_lab_box/export.py, as after a finished run)."""
    start = time.monotonic()
    cmd = [launch.env_python, launcher.box_file(EXPORTERS), "--checkpoint-dir", ckpt, "--step", str(step)]
    rc = launcher.run_child(cmd, os.path.dirname(ckpt))
    seconds = round(time.monotonic() - start, 1)
    try:
        with open(os.path.join(ckpt, f"global_step_{step}", "hf.proof.json")) as fh:
            proof = json.load(fh)
    except (OSError, ValueError):
        proof = None
    if rc != 0 or not proof:
        return {"id": "export-failed", "ok": False, "seconds": seconds,
                "words": f"the export of step {step} failed (export exit {rc}; its error is above)"}
    keep = ("merge_seconds", "proof_seconds", "export_bytes", "logits_max_abs_diff", "device", "lora")
    return {"id": "export", "ok": True, "seconds": seconds, "proof": {k: proof.get(k) for k in keep if k in proof},
            "words": f"step {step} exported and proven in {seconds:.0f} s"}


def weights_check(launch, actor):
    cmd = [launch.env_python, launcher.box_file(WEIGHTS), "--actor", actor, "--model", launch.model_dir]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"id": "weights", "ok": False, "words": f"the weights check exited {res.returncode}: "
                                                       f"{(res.stderr or res.stdout).strip()[-400:]}"}


def gpu_words():
    try:
        gpu = launcher.gpu_module()
        inv = gpu.parse_fact_output(subprocess.run(["sh", "-c", gpu.fact_command()], capture_output=True,
                                                   text=True, timeout=60).stdout)
        return {"driver": inv.driver_version, "names": sorted({g.name for g in inv.gpus})} if inv.ok else \
            {"problem": inv.problem}
    except Exception as exc:  # noqa: BLE001 - the record says what it could not read
        return {"problem": f"{type(exc).__name__}: {exc}"}


class Tee(io.TextIOBase):
    """Writes to the stream it replaces and keeps a copy (the preflight's words for the record)."""

    def __init__(self, stream):
        self.stream, self.kept = stream, []

    def write(self, text):
        self.kept.append(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


def preflight(launch, bp, extra):
    """The launcher's preflight on a copy of the launch whose work and checkpoint folders are the burn-in's."""
    mine = copy.copy(launch)
    mine.work_dir = bp["folder"]
    mine.checkpoint_dir = os.path.join(bp["folder"], "checkpoints")
    if launch.checkpoints:
        mine.checkpoints = {**launch.checkpoints, "dir": mine.checkpoint_dir, "max_saves": 1, "every": bp["saved_step"],
                            "saves_in_run": len(bp["runs"]), "last_step": bp["runs"][-1]["last_step"]}
    out, err = Tee(sys.stdout), Tee(sys.stderr)
    sys.stdout, sys.stderr = out, err
    try:
        rc = launcher.preflight_module().preflight(mine, extra)
    finally:
        sys.stdout, sys.stderr = out.stream, err.stream
    failed = [line.strip() for line in "".join(out.kept).splitlines() if line.strip().startswith("FAIL")]
    return rc, failed


def write_record(folder, record):
    part = os.path.join(folder, RECORD + ".part")
    with open(part, "w") as fh:
        json.dump(record, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(part, os.path.join(folder, RECORD))


def clean(folder, keep_record=False):
    for name in ("checkpoints", "records", "outputs"):
        shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    if not keep_record and os.path.exists(os.path.join(folder, RECORD)):
        os.remove(os.path.join(folder, RECORD))


def finish(record, folder, verdict, keep):
    record.update(verdict, state="passed" if verdict["passed"] else "failed", ended=now(),
                  wall_s=round(time.time() - record["started_epoch"], 1))
    write_record(folder, record)
    for c in verdict["checks"]:
        if c["ok"] is False:
            say(f"FAIL {c['id']}: {c['words']}", err=True)
        else:
            say(f"{'ok  ' if c['ok'] else 'skip'} {c['id']}: {c['words']}")
    if not keep:
        clean(folder, keep_record=True)
    say(f"{record['state'].upper()} on {record['host']} in {record['wall_s']:.0f} s ({os.path.join(folder, RECORD)})")
    return 0 if verdict["passed"] else 1


def burnin(launch, extra=(), keep=False, preflight_first=True):
    """The whole burn-in; its exit status (``preflight_first`` False: ``--no-preflight``, a run on another card
    than the plan's, as the GPU harness makes on its H200)."""
    try:
        bp = load_burnin_plan(launch)
    except ValueError as exc:
        say(str(exc), err=True)
        return 2
    busy = unit_busy(bp["train_unit"])
    if busy:
        say(f"refused: the training unit {bp['train_unit']} is {busy}; a burn-in never runs beside it (stop it "
            "first: train_unit_state = \"stopped\", then deploy/train.py)", err=True)
        return REFUSED
    folder = bp["folder"]
    ckpt, records = os.path.join(folder, "checkpoints"), os.path.join(folder, "records")
    clean(folder)
    os.makedirs(folder, exist_ok=True)      # the stage makes it on a box; the GPU harness's lab_root has none
    record = {"format": 1, "host": launch.host, "state": "running", "started": now(), "started_epoch": time.time(),
              "gpu": {"name": launch.gpu_name, "count": launch.gpu_count, "memory_mib": launch.gpu_memory_mib,
                      **gpu_words()},
              "plan": bp.get("plan_summary"), "burnin": {k: bp.get(k) for k in ("steps", "saved_step", "lr", "reward",
                                                                               "rises", "prompts")}}
    write_record(folder, record)
    judge = launcher.box_module(JUDGE, "verl_lab_burnin_judge")
    os.makedirs(ckpt, exist_ok=True)         # the preflight checks it is writable
    rc, failed = preflight(launch, bp, extra) if preflight_first else (0, [])
    if rc != 0:
        words = "; ".join(failed) or "the preflight failed (its output is above)"
        return finish(record, folder, {"passed": False, "failed": ["preflight"], "checks": [
            {"id": "preflight", "ok": False, "words": f"this box cannot train now: {words}"}]}, keep)
    env = launcher.ray_env(launch) if any(o.startswith("trainer.nnodes=") and o != "trainer.nnodes=1"
                                          for o in launch.overrides) else None
    runs, started, saves = [], [], {}
    saved = bp["saved_step"]
    roles = ["actor"] + (["critic"] if bp.get("critic") else [])
    for run in bp["runs"]:
        overrides = merged(launch.overrides, bp["overrides"] + run["overrides"]) + list(extra)
        cmd = [launch.env_python, launcher.box_file(DRIVER), "--probe", bp["probe"], "--records", records, "--",
               *overrides]
        say(f"verl's {run['name']} run: steps {run['first_step']}-{run['last_step']}")
        started.append(time.time())
        t0 = time.monotonic()
        rc = launcher.run_child(cmd, folder, env=env)
        runs.append({"name": run["name"], "rc": rc, "seconds": round(time.monotonic() - t0, 1)})
        if rc != 0:
            break
        if len(runs) == 1:           # the next run replaces this save (one kept): checked before it starts
            saves["save"] = saved_check(ckpt, saved, roles)
            if not saves["save"]["ok"]:
                break
    phases, metrics_lines = jsonl(records, "phases"), jsonl(records, "metrics")
    metrics = {m["step"]: m["data"] for m in metrics_lines}
    rewards = [[r for r in jsonl(records, "reward") if start <= r["t"] < end]
               for start, end in zip(started, started[1:] + [float("inf")])]
    result = {"runs": runs, "metrics": metrics, "rewards": rewards, "phases": phases,
              "first_steps": [r["first_step"] for r in bp["runs"][:len(runs)]], **saves}
    if len(runs) > 1 and runs[1]["rc"] == 0:
        result["resume"] = resume_check(phases, metrics, saved, started[1])
    last = bp["runs"][-1]["last_step"]
    if len(runs) == len(bp["runs"]) and runs[-1]["rc"] == 0:
        step = last if os.path.isdir(os.path.join(ckpt, f"global_step_{last}", "actor")) else saved
        result["export"] = export_check(launch, ckpt, step)
        weights = weights_check(launch, os.path.join(ckpt, f"global_step_{step}", "actor"))
        record["versions"] = weights.pop("versions", None)
        result["weights"] = weights
    rows = launcher.after_run_module().marker_value(launch.data_marker, "train_rows")
    configured = launcher.checkpoints_module().planned_last_step(launch.run_overrides(), rows)
    verdict = judge.judge(result, {**bp, "speed_model": {**bp["speed_model"], "configured_steps": configured}})
    record["runs"] = runs
    return finish(record, folder, verdict, keep)
