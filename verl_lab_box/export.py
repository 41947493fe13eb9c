"""A verl actor checkpoint as a proven Hugging Face folder: verl 0.5.0's own model merger, then a
proof of what it wrote.

    <env>/bin/python export.py --checkpoint-dir DIR [--step N] [--final]

Placed by tasks/train.py as ``<train_dir>/verl_lab_export.py``; the training launcher runs it
with the env's Python as the train user when a run finishes (``train-launcher --export`` on
demand). For ``DIR/global_step_N/actor`` (N: ``--step``, else the step in verl's tracker file
``DIR/latest_checkpointed_iteration.txt``), it

1. runs ``python -m verl.model_merger merge --backend fsdp --local_dir DIR/global_step_N/actor
   --target_dir DIR/global_step_N/.hf.partial`` (verl/model_merger/fsdp_model_merger.py: reads
   ``fsdp_config.json``'s world size, loads ``model_world_size_W_rank_r.pt`` of every rank, joins
   the DTensor shards by their placement, casts every tensor to bf16 and saves the model built from
   ``actor/huggingface/config.json`` with ``save_pretrained``, the generation config and the
   tokenizer); its output goes to this program's, so its errors reach the journal as verl,
   torch and transformers print them (files/doctor/export.toml knows them);
2. proves the folder (``prove``, verl_lab_box/export_proof.py, placed beside this program as
   ``verl_lab_export_proof.py``): it loads with transformers, every tensor equals exactly the
   checkpoint's weight (rebuilt from the shards, not the merger's code path) in the export's dtype,
   and its logits on fixed chat prompts are the checkpoint's own (in the checkpoint's dtype, under
   the checkpoint's config) within the limit stated for the pair of dtypes; on the GPU once training
   has released it, else on the CPU;
3. renames ``.hf.partial`` to ``DIR/global_step_N/hf`` and writes ``DIR/global_step_N/hf.proof.json``
   last (the merge and proof seconds, the export's files and bytes, the differences, the shards'
   names, sizes and mtimes).

A re-run whose proof still matches the shards and the folder changes nothing ("already proven");
a folder without its proof (a run cut between the two renames) is made again. ``--final`` records
that the training run finished at this step (the launcher passes it only after verl exited 0 by
itself); an export on demand of a run still going is recorded as not final.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

TRACKER = "latest_checkpointed_iteration.txt"     # verl's RayPPOTrainer._save_checkpoint writes it
EXPORT = "hf"
PARTIAL = ".hf.partial"
PROOF = "hf.proof.json"
FORMAT = 2      # 2: the logits are compared with the checkpoint's own dtype, under a limit for the pair
PROOF_MODULES = ("verl_lab_export_proof.py", "export_proof.py")   # its sibling: placed beside it, or in the repo


def _sibling(module_name: str, names: tuple) -> object:
    """A box module shipped beside this program (placed name first, then its name in the repo)."""
    import importlib.util

    if module_name in sys.modules:
        return sys.modules[module_name]
    here = os.path.dirname(os.path.abspath(__file__))
    for name in names:
        path = os.path.join(here, name)
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
            return module
    raise ImportError(f"no {' or '.join(names)} beside {os.path.abspath(__file__)}: re-run deploy/train.py")


_proof = _sibling("verl_lab_export_proof", PROOF_MODULES)
ExportError = _proof.ExportError      # the proof's failures and this program's are one kind
full_weights = _proof.full_weights
prove = _proof.prove
read_json = _proof.read_json


def log(msg: str) -> None:
    print(f"verl-lab export: {msg}", flush=True)


def latest_step(checkpoint_dir: str) -> int | None:
    """The step of verl's tracker file, or None when there is no checkpoint yet."""
    try:
        with open(os.path.join(checkpoint_dir, TRACKER)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def step_dir(checkpoint_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir, f"global_step_{step}")


def shard_identity(actor_dir: str) -> list[dict]:
    """The files the export is made from: name, bytes and mtime of ``fsdp_config.json`` and every
    model shard (a changed checkpoint is a new export)."""
    names = sorted(n for n in os.listdir(actor_dir)
                   if n == "fsdp_config.json" or (n.startswith("model_world_size_") and n.endswith(".pt")))
    out = []
    for n in names:
        st = os.stat(os.path.join(actor_dir, n))
        out.append({"name": n, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def folder_identity(folder: str) -> list[dict]:
    out = []
    for root, _, files in os.walk(folder):
        for n in files:
            path = os.path.join(root, n)
            out.append({"name": os.path.relpath(path, folder), "bytes": os.path.getsize(path)})
    return sorted(out, key=lambda f: f["name"])


def write_json(path: str, data: dict) -> None:
    part = path + ".part"
    with open(part, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(part, path)


def proven(checkpoint_dir: str, step: int) -> dict | None:
    """The proof of step ``step``'s export when it still holds: proven, the same shards, the same
    files in the folder; else None."""
    folder = step_dir(checkpoint_dir, step)
    proof = read_json(os.path.join(folder, PROOF))
    export = os.path.join(folder, EXPORT)
    actor = os.path.join(folder, "actor")
    if not proof or not proof.get("ok") or proof.get("format") != FORMAT or not os.path.isdir(export):
        return None
    if not os.path.isdir(actor) or proof.get("shards") != shard_identity(actor):
        return None
    if proof.get("files") != folder_identity(export):
        return None
    return proof


# ---------------------------------------------------------------- the export

def merge(actor_dir: str, target: str, python: str = sys.executable) -> float:
    """verl's own model merger into ``target``; its output is this program's. Returns seconds."""
    cmd = [python, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", actor_dir,
           "--target_dir", target]
    log("$ " + " ".join(cmd))
    start = time.monotonic()
    res = subprocess.run(cmd)
    if res.returncode != 0:
        raise ExportError(f"verl's model merger failed (exit {res.returncode}) on {actor_dir}: its error is above")
    return time.monotonic() - start


def export(checkpoint_dir: str, step: int | None = None, final: bool = False, python: str = sys.executable) -> dict:
    """The proven export of ``step`` (default: the latest checkpoint); made when it is not there yet."""
    if step is None:
        step = latest_step(checkpoint_dir)
        if step is None:
            raise ExportError(f"no checkpoint in {checkpoint_dir} ({TRACKER} is missing): the run saved none yet "
                              "(trainer.save_freq)")
    folder = step_dir(checkpoint_dir, step)
    actor = os.path.join(folder, "actor")
    if not os.path.isdir(actor):
        raise ExportError(f"{actor} does not exist: step {step} has no actor checkpoint (removed by the plan's "
                          "retention?)")
    have = proven(checkpoint_dir, step)
    if have is not None:
        if final and not have.get("final"):
            have["final"] = True
            write_json(os.path.join(folder, PROOF), have)
        log(f"step {step}: already proven ({os.path.join(folder, EXPORT)}, logits within "
            f"{have['max_abs_logit_diff']:.3g})")
        return have
    partial, target = os.path.join(folder, PARTIAL), os.path.join(folder, EXPORT)
    for stale in (os.path.join(folder, PROOF), partial, target):
        if os.path.isdir(stale):
            shutil.rmtree(stale)
        elif os.path.exists(stale):
            os.remove(stale)
    shards = shard_identity(actor)
    try:
        merge_s = merge(actor, partial, python)
        start = time.monotonic()
        found = prove(partial, actor)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)      # never a half-made folder beside the checkpoint
        raise
    prove_s = time.monotonic() - start
    os.replace(partial, target)
    files = folder_identity(target)
    proof = {"format": FORMAT, "ok": True, "step": step, "final": bool(final), "checkpoint": actor, "export": target,
             "shards": shards, "files": files, "export_bytes": sum(f["bytes"] for f in files),
             "merge_seconds": round(merge_s, 2), "proof_seconds": round(prove_s, 2),
             "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **found, **versions()}
    write_json(os.path.join(folder, PROOF), proof)
    log(f"step {step}: {target} proven ({proof['export_bytes']} bytes, {found['export_dtype']}; logits within "
        f"{found['max_abs_logit_diff']:.3g} of the checkpoint's in its {found['checkpoint_dtype']} (limit "
        f"{found['logit_tolerance']}); merge {merge_s:.1f} s, proof {prove_s:.1f} s on {found['proof_device']})")
    return proof


def versions(names=("torch", "transformers", "verl")) -> dict:
    """The versions of the packages that made a file, for its record."""
    found = {}
    for name in names:
        try:
            found[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a version is a record, never a failure
            found[name] = None
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint-dir", required=True, help="verl's trainer.default_local_dir")
    ap.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    ap.add_argument("--final", action="store_true", help="the training run finished at this step")
    args = ap.parse_args(argv)
    os.umask(0o027)                     # as the training unit writes (UMask=0027)
    try:
        proof = export(args.checkpoint_dir, args.step, args.final)
    except ExportError as exc:
        print(f"verl-lab export FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps({"step": proof["step"], "export": proof["export"], "final": proof["final"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
