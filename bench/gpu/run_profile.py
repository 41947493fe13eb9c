"""Run one GPU-harness profile on the device machine (standard library only).

    python3 bench/gpu/run_profile.py NAME --out DIR [--model /tmp/model] [--timeout 540]

Lays out ``/tmp/vl/<NAME>`` as a box's lab_root would be after deploy/full.py (the rendered
``train/`` from ``.gpu/profiles/<NAME>``, an env whose ``bin/python`` is this machine's python3
with the payload's packages and the profile's verl tree on PYTHONPATH, the model and the GSM8K
files), then runs the profile the way a box runs it:

* ``launcher``: ``train-launcher --no-preflight [--no-export] -- <extra overrides>`` (the launcher
  runs ``verl.trainer.main_ppo`` with the plan's overrides; it reads train.env itself); an export
  profile leaves out ``--no-export``, so when verl finishes the launcher exports the latest
  checkpoint, proves it and scores the base model and the export on GSM8K, and what that left in
  the checkpoint folder is copied to ``DIR/<NAME>/export/`` (``collect_export``);
* ``print-overrides`` (a launcher from before the ``--`` passthrough): its
  ``--print-overrides`` list, train.env, then ``verl.trainer.main_ppo`` with the extras;
* ``overrides`` (the seed recipe): ``verl.trainer.main_ppo`` with the profile's overrides;
* ``burnin``: ``train-launcher --burnin --no-preflight`` (the burn-in: bench/gpu/burnin_profiles.py), whose
  ``burnin.json`` and records are copied to ``DIR/<NAME>/``.

The probe (bench/gpu/probe/sitecustomize.py) caps the allocator at the profile's cap and writes
per-phase memory into ``DIR/<NAME>/probe/``; the console goes to ``DIR/<NAME>/console.log``;
``DIR/<NAME>/run.json`` says how it ended.

A profile of several GPUs (``gpus``) runs only where nvidia-smi lists that many (else it is refused
before anything is laid out: rc 2); Ray gives each of verl's workers its own GPU and the probe caps
each worker on it. A profile of several Ray nodes (``nodes``) forms its cluster first with the units
the cluster stage rendered for it (bench/gpu/ray_nodes.py: ``DIR/<NAME>/cluster.json``, the nodes'
logs ``ray-*.log``), runs the launcher's cluster preflight (``cluster-check``), trains from the head
with the head's ``ray.env`` (as the training unit's drop-in gives it), and stops the nodes after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = REPO / ".gpu"
PROBE = REPO / "bench" / "gpu" / "probe"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray_nodes  # noqa: E402  (bench/gpu/ray_nodes.py, standard library)

FORM_TIMEOUT_S = 180     # the Ray nodes of a profile join within this (the lab boxes' 8 joined in 26 s: docs/cluster.md)


def load_env_file(path: Path, env: dict) -> None:
    """The launcher's rule: a value already in the environment wins."""
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            env.setdefault(key, value)


def lay_out(profile: dict, src: Path, model: Path, payload: Path = PAYLOAD) -> Path:
    """The lab_root a box has after deploy/full.py: the rendered train dir, an env whose ``bin/python`` and
    ``bin/ray`` are this machine's python3 (with the payload on PYTHONPATH), the model and the data; for Ray
    nodes, the head's ``ray.env`` and ``cluster-check`` beside the plan (the cluster stage's files)."""
    root = Path(profile["lab_root"])
    shutil.rmtree(root, ignore_errors=True)
    for sub in ("train/work", "train/checkpoints", "train/cache", "home", "env/bin", "models", "data"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for f in (src / "train").iterdir():
        if f.is_dir():       # the burn-in's probe folder
            shutil.copytree(f, root / "train" / f.name)
        else:
            shutil.copy2(f, root / "train" / f.name)
    python = shutil.which("python3") or sys.executable
    for name, run in (("python", ""), ("ray", "-m ray.scripts.scripts ")):  # a venv's programs: found by their path
        wrapper = root / "env" / "bin" / name
        wrapper.write_text(f"#!/bin/sh\nexec {python} {run}\"$@\"\n")
        wrapper.chmod(0o755)
    if profile.get("cluster"):
        head = src / profile["cluster"]["nodes"][0]["dir"]
        for name in ("ray.env", "cluster-check"):
            shutil.copy2(head / name, root / "train" / name)
    (root / "models" / ((profile.get("plan") or {}).get("model_dir") or "Qwen--Qwen2.5-0.5B-Instruct")).symlink_to(model)
    (root / "data" / "gsm8k").symlink_to(payload / "data")
    return root


def visible_gpus() -> int | None:
    """GPUs nvidia-smi lists (``-L``: one line each); None where it cannot say."""
    try:
        res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in res.stdout.splitlines() if line.startswith("GPU ")) if res.returncode == 0 else None


def gpus_needed(profile: dict) -> int:
    return int(profile.get("gpus") or 1) * int(profile.get("nodes") or 1)


def resume_runs(cmd: list[str], step: int, export: bool) -> list[list[str]]:
    """A resume profile's two runs in one lab_root: to ``step`` saving a checkpoint there (an export profile's
    first run exports nothing: it is not the run's end), then the whole run again, which resumes from it (the
    plan's resume_mode=auto)."""
    first = list(cmd)
    if export and "--no-export" not in first:
        first.insert(first.index("--no-preflight") + 1, "--no-export")
    return [first + [f"trainer.total_training_steps={step}", f"trainer.save_freq={step}"], cmd]


def command(profile: dict, root: Path, env: dict) -> list[str]:
    env_python = str(root / "env" / "bin" / "python")
    extra = list(profile.get("extra_overrides", []))
    launcher = root / "train" / "train-launcher"
    if profile["kind"] == "launcher":
        return [sys.executable, str(launcher), "--no-preflight", *([] if profile.get("export") else ["--no-export"]),
                "--", *extra]
    if profile["kind"] == "burnin":     # the launcher's burn-in (verl_lab_box/burnin.py); the H200 is not the card
        return [sys.executable, str(launcher), "--burnin", "--no-preflight"]
    if profile["kind"] == "print-overrides":
        out = subprocess.run([sys.executable, str(launcher), "--print-overrides"], capture_output=True, text=True,
                             check=True)
        load_env_file(root / "train" / "train.env", env)
        return [env_python, "-m", "verl.trainer.main_ppo", *out.stdout.split("\n"), *extra]
    return [env_python, "-m", "verl.trainer.main_ppo", *profile["overrides"], *extra]


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (``du -sb`` without the directories' own blocks)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def collect_export(checkpoints: Path, out: Path) -> dict:
    """What an export profile's run left in its checkpoint folder, into ``out``: which
    ``global_step_*`` remain (the plan's retention), the bytes of each and of its actor and critic
    (one save, to compare with the plan's prediction), and the JSON files the launcher's export and
    score wrote (the proof, the scores, run-finished.json), copied as they are."""
    out.mkdir(parents=True, exist_ok=True)
    steps = sorted((p for p in checkpoints.glob("global_step_*") if p.is_dir()), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    record = {"checkpoint_dir": str(checkpoints), "global_steps": [p.name for p in steps],
              # a save's bytes: the step folder less its export, made or cut while being made (.hf.partial)
              "saves": {p.name: {"bytes": tree_bytes(p) - sum(tree_bytes(p / d) for d in ("hf", ".hf.partial")
                                                              if (p / d).is_dir())
                                 - sum(f.stat().st_size for f in p.glob("hf.*.json")),
                                 **{role: tree_bytes(p / role) for role in ("actor", "critic") if (p / role).is_dir()},
                                 "actor_files": sorted(f.name for f in (p / "actor").iterdir()) if (p / "actor").is_dir()
                                 else []}
                        for p in steps},
              "exports": {p.name: tree_bytes(p / "hf") for p in steps if (p / "hf").is_dir()}}
    for name in ("run-finished.json", "gsm8k-base.json", "latest_checkpointed_iteration.txt"):
        if (checkpoints / name).is_file():
            shutil.copy2(checkpoints / name, out / name)
    for p in steps:
        for name in ("hf.proof.json", "hf.gsm8k.json"):
            if (p / name).is_file():
                shutil.copy2(p / name, out / f"{p.name}.{name}")
    (out / "checkpoints.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def proof_baseline(checkpoints: Path, old: Path, out: Path, args, env: dict) -> None:
    """Today's export proof and the earlier one (``old``) timed on the run's last exported step, in the time
    left (bench/gpu/proof_bench.py: ``out/proof-bench.json``)."""
    steps = sorted((p for p in checkpoints.glob("global_step_*") if (p / "hf").is_dir() and (p / "actor").is_dir()),
                   key=lambda p: int(p.name.rsplit("_", 1)[1]))
    left = (args.deadline - time.time()) if args.deadline else 300.0
    if not steps or left < 60:
        (out / "proof-bench.json").write_text(json.dumps({"skipped": "no exported step" if not steps else
                                                          f"{left:.0f} s left"}) + "\n")
        return
    subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "proof_bench.py"), str(steps[-1]), "--old", str(old),
                    "--out", str(out / "proof-bench.json"), "--timeout", str(int(left - 20))],
                   env={**env, "PYTHONPATH": args.site}, capture_output=True, text=True)


def form_cluster(profile: dict, src: Path, root: Path, env: dict, out: Path, timeout_s: float, nodes: list) -> dict:
    """A Ray-node profile's cluster formed (ray_nodes.form: every node started, appended to ``nodes``), ``env``
    given the head's ray.env (what the training unit's drop-in gives the launcher) and the launcher's cluster
    preflight run; its record, also in ``out/cluster.json``. Where it cannot form or the preflight fails, the nodes
    are stopped and the record says why (``refused``)."""
    try:
        record = ray_nodes.form(profile["cluster"], src, env, str(root / "env" / "bin" / "python"), out, timeout_s,
                                nodes)
        env.update(ray_nodes.read_env_file(root / "train" / "ray.env"))
        record["preflight"] = ray_nodes.preflight(root / "train", env)
        if record["preflight"]["rc"]:
            record["refused"] = "the cluster preflight failed: " + "; ".join(
                detail for status, _, detail in record["preflight"]["results"] if status == "FAIL")
    except (ray_nodes.NodeError, subprocess.TimeoutExpired, OSError) as exc:
        text = str(exc)
        record = json.loads(text) if text.startswith("{") else {"error": text}
        record["refused"] = f"the Ray nodes did not form: {record['error']}"
    if record.get("refused"):
        record["stopped"] = ray_nodes.stop(nodes)
    (out / "cluster.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=Path("/tmp/model"))
    ap.add_argument("--site", default=os.environ.get("SITE", "/tmp/site"))
    ap.add_argument("--verl-trees", default=os.environ.get("VERL_TREES", "/tmp/verl-trees"))
    ap.add_argument("--timeout", type=int, default=540)
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="epoch seconds by which the run must have ended (the device call's own limit)")
    ap.add_argument("--ray-stop", action="store_true",
                    help="afterwards stop every Ray process on the machine (runs one at a time)")
    ap.add_argument("--payload", type=Path, default=PAYLOAD, help="the payload folder (.gpu: profiles, data, tokenizer)")
    args = ap.parse_args(argv)
    src = args.payload / "profiles" / args.name
    profile = json.loads((src / "profile.json").read_text())
    out = args.out / args.name
    shutil.rmtree(out, ignore_errors=True)
    (out / "probe").mkdir(parents=True)
    have, need = visible_gpus(), gpus_needed(profile)
    if have is not None and have < need:
        result = {"name": args.name, "rc": 2, "timed_out": False, "seconds": 0.0,
                  "refused": f"the profile needs {need} GPUs, nvidia-smi lists {have}"}
        (out / "run.json").write_text(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)
        return 2
    config = (profile.get("plan") or {}).get("model_config")
    model = args.model
    if config and not config.endswith("qwen2.5-0.5b-instruct/config.json"):
        # another catalog model: random weights of its shape, made once per model on this machine
        model = Path(f"/tmp/model-{Path(config).parent.name}")
        made = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "make_model.py"), "--out", str(model),
                               "--tokenizer", str(args.payload / "tokenizer"), "--config", str(REPO / config), "--no-check"],
                              env={**os.environ, "PYTHONPATH": args.site}, capture_output=True, text=True)
        (out / "model.log").write_text(made.stdout + made.stderr)
        if made.returncode:
            print(made.stdout[-2000:] + made.stderr[-2000:], file=sys.stderr)
            return 1
    root = lay_out(profile, src, model, args.payload)
    shutil.copy2(src / "profile.json", out / "profile.json")      # the record of what ran
    if (src / "train" / "plan.json").is_file():
        shutil.copy2(src / "train" / "plan.json", out / "plan.json")
    if args.deadline:
        args.timeout = max(1, min(args.timeout, int(args.deadline - time.time())))
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(PROBE), f"{args.verl_trees}/{profile['verl_tree']}", args.site]),
        "VERL_LAB_PROBE_DIR": str(out / "probe"),
        "PYTHONUNBUFFERED": "1",
        "RAY_DEDUP_LOGS": "0",
        "TOKENIZERS_PARALLELISM": "false",
        # each run its own Ray: ray.init() without an address would join the latest cluster
        # under the shared temp dir (/tmp/ray/ray_current_cluster) of a run beside it
        "RAY_TMPDIR": f"/tmp/ray-{args.name}",
    })
    env.pop("RAY_ADDRESS", None)
    if profile.get("cluster"):      # its own Ray already: the head's --temp-dir, which the other nodes take from it
        env.pop("RAY_TMPDIR")
    if profile.get("cap_mib"):
        env["VERL_LAB_GPU_CAP_MIB"] = str(profile["cap_mib"])
    if profile.get("probe_profile"):
        env["VERL_LAB_PROFILE"] = profile["probe_profile"]
    if profile.get("tensorboard"):      # verl's TensorBoard writer (TaskRunner, a Ray actor: it inherits this)
        env["TENSORBOARD_DIR"] = str(out / "tensorboard")
    env.update(profile.get("env") or {})
    cmd = [c for c in command(profile, root, env) if c]
    n = profile.get("resume_after")
    runs = resume_runs(cmd, n, bool(profile.get("export"))) if n else [cmd]
    (out / "command.json").write_text(json.dumps(runs if n else cmd, indent=1) + "\n")
    start = time.time()
    rcs, timed_out = [], False
    nodes: list = []
    cluster = None
    if profile.get("cluster"):   # the Ray nodes, then the launcher's cluster preflight; the launcher trains from the head
        cluster = form_cluster(profile, src, root, env, out, min(FORM_TIMEOUT_S, max(1, args.timeout - 60)), nodes)
        if cluster.get("refused"):
            result = {"name": args.name, "rc": 3, "timed_out": False, "seconds": round(time.time() - start, 1),
                      "refused": cluster["refused"]}
            (out / "run.json").write_text(json.dumps(result) + "\n")
            print(json.dumps(result), flush=True)
            return 3
    try:
        with open(out / "console.log", "w") as log:
            log.write(f"# {profile['name']}: {profile['stands_for']}\n# cap {profile.get('cap_mib')} MiB\n")
            for i, run in enumerate(runs):
                if n:
                    log.write(f"# verl-lab harness: run {i + 1} of 2\n")
                log.flush()
                proc = subprocess.Popen(run, cwd=root / "train" / "work", env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                try:
                    rcs.append(proc.wait(timeout=max(1, args.timeout - int(time.time() - start))))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
                    rcs.append(proc.wait())
                    timed_out = True
                if rcs[-1] or timed_out:
                    break
    finally:
        if nodes:
            cluster["stopped"] = ray_nodes.stop(nodes)
            (out / "cluster.json").write_text(json.dumps(cluster, indent=1) + "\n")
    rc = next((r for r in rcs if r), 0)
    if profile.get("proof_baseline") and profile.get("export") and not rc and not timed_out:
        proof_baseline(root / "train" / "checkpoints", src / "old_export.py", out, args, env)
    if profile["kind"] == "burnin":      # its record and the records it was made from
        folder = root / "train" / "burnin"
        if (folder / "burnin.json").is_file():
            shutil.copy2(folder / "burnin.json", out / "burnin.json")
        if (folder / "records").is_dir():
            shutil.copytree(folder / "records", out / "records")
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    if profile.get("export"):
        collect_export(root / "train" / "checkpoints", out / "export")
        # the saves' bytes are recorded: free the disk for the runs beside and after this one
        shutil.rmtree(root / "train" / "checkpoints", ignore_errors=True)
    if args.ray_stop:   # a run killed at its timeout leaves its local Ray cluster holding the GPU
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], env=env,
                       capture_output=True)
    result = {"name": args.name, "rc": rc, "timed_out": timed_out, "seconds": round(time.time() - start, 1),
              **({"rcs": rcs} if n else {})}
    (out / "run.json").write_text(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
