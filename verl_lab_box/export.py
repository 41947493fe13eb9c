"""A verl actor checkpoint as a proven Hugging Face folder: verl 0.5.0's own model merger, then a
proof of what it wrote.

    <env>/bin/python export.py --checkpoint-dir DIR [--step N] [--final] [--host-ram-mib M] [--base-model REPO@REV]

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
   names, sizes and mtimes, the merger's and this process's peak RSS beside the host RAM the plan
   predicted: ``--host-ram-mib``, which the launcher passes and which is checked against
   MemAvailable before the merge).

A re-run whose proof still matches the shards and the folder changes nothing ("already proven");
a folder without its proof (a run cut between the two renames) is made again. One export of a step
at a time: the step folder's lock (``.export.lock``, verl_lab_box/checkpoints.py ``step_lock``, a
``flock`` the kernel releases when its holder dies) is held from the check to the proof's JSON, so
an export started beside another (the unit's after-run and ``train-launcher --export``) waits, then
finds it proven; a ``.hf.partial`` found under the lock is one whose maker died. Before it, the
exports of saves verl's retention removed are pruned (``prune_exports``). ``--final`` records
that the training run finished at this step (the launcher passes it only after verl exited 0 by
itself); an export on demand of a run still going is recorded as not final.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
LORA_MODULES = ("verl_lab_lora_export.py", "lora_export.py")      # a LoRA run's merge and proof, likewise


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
PROMPTS = _proof.PROMPTS            # the fixed chat prompts both proofs compute logits on


def prove_export(partial: str, actor: str, base_model: str | None = None) -> dict:
    """The proof of the merger's folder. A LoRA checkpoint's (verl saved ``actor/lora_adapter``: the merger
    writes the base alone) is first made the merged model with the adapter beside it (its config naming
    ``base_model``, REPO@REVISION, where given), then proven by verl_lab_box/lora_export.py; any other by
    ``prove``."""
    lora = _sibling("verl_lab_lora_export", LORA_MODULES)
    if not lora.is_lora_checkpoint(actor):
        return prove(partial, actor)
    weights, facts = full_weights(actor)
    try:
        return {**facts, **lora.export_and_prove(actor, partial, weights, list(PROMPTS), base_model)}
    except lora.LoraExportError as exc:
        raise ExportError(str(exc)) from None


def check_base_model(given: str) -> None:
    """``--base-model`` is REPO@COMMIT (lora_export.base_model's rule), else ExportError."""
    lora = _sibling("verl_lab_lora_export", LORA_MODULES)
    try:
        lora.base_model({}, given)
    except lora.LoraExportError as exc:
        raise ExportError(str(exc)) from None


def log(msg: str) -> None:
    print(f"verl-lab export: {msg}", flush=True)


def latest_step(checkpoint_dir: str) -> int | None:
    """The step of verl's tracker file, or None when there is no checkpoint yet."""
    ck = checkpoints_module()
    return ck.read_tracker(ck.read_small(os.path.join(checkpoint_dir, TRACKER)) or "")


def step_dir(checkpoint_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir, f"global_step_{step}")


CHECKPOINT_READERS = ("verl_lab_checkpoints.py", "checkpoints.py")   # its sibling: placed beside it, or in the repo


def checkpoints_module():
    """verl_lab_box/checkpoints.py, loaded from beside this program (the step lock, the pruning)."""
    return _sibling("verl_lab_checkpoints", CHECKPOINT_READERS)


def shard_identity(actor_dir: str) -> list[dict]:
    """The files the export is made from (verl_lab_box/checkpoints.py ``shard_identity``)."""
    return checkpoints_module().shard_identity(actor_dir)


def folder_identity(folder: str) -> list[dict]:
    return checkpoints_module().folder_identity(folder)


def write_json(path: str, data: dict) -> None:
    part = path + ".part"
    with open(part, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(part, path)


def proven(checkpoint_dir: str, step: int) -> dict | None:
    """The proof of step ``step``'s export when it still holds: proven, the same shards, the same
    files in the folder; else None (verl_lab_box/checkpoints.py ``proven_export``, which the
    launcher asks too)."""
    ck = checkpoints_module()
    if ck.EXPORT_FORMAT != FORMAT:
        raise ExportError(f"{ck.__file__} reads proofs of format {ck.EXPORT_FORMAT}, this program writes {FORMAT}: "
                          "re-run deploy/train.py (it places both)")
    return ck.proven_export(checkpoint_dir, step)


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


MEMINFO = "/proc/meminfo"


def ram_short(need_mib: int | None, step: int, meminfo: str | None = None) -> str | None:
    """Why an export needing ``need_mib`` of host RAM does not fit what the box has available now
    (MemAvailable), with the fix; None where it fits or nothing is known."""
    if not need_mib:
        return None
    try:
        with open(meminfo or MEMINFO) as fh:
            available = next(int(line.split()[1]) // 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    if available >= need_mib:
        return None
    return (f"step {step}'s export needs about {need_mib} MiB of host RAM (plan.json launch.checkpoints."
            f"export_host_ram: the higher of verl's merger and the proof), this box has {available} MiB available "
            "(MemAvailable). Fix: stop training first (train_unit_state = \"stopped\" in the host's data, then "
            f"deploy/train.py, then deploy/export.py), or export on a box with more RAM (global_step_{step}/actor "
            "copied there, then verl_lab_export.py --checkpoint-dir)")


def export(checkpoint_dir: str, step: int | None = None, final: bool = False, python: str = sys.executable,
           host_ram_mib: int | None = None, base_model: str | None = None) -> dict:
    """The proven export of ``step`` (default: the latest checkpoint); made when it is not there yet.
    Exports of saves verl removed are pruned first; the step's lock is held throughout (a second
    export of the step waits for it, then finds it proven). ``host_ram_mib``: what the merge and
    the proof need, checked against MemAvailable under the lock before the merge (not where the
    export is proven already). ``base_model``: REPO@REVISION a LoRA export's adapter names (default: the
    data stage's stamp beside the model folder, lora_export.base_model)."""
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
    ck = checkpoints_module()
    ck.prune_exports(checkpoint_dir, say=log)
    with ck.step_lock(folder, f"export of step {step}", say=log):
        return _export(checkpoint_dir, step, final, python, host_ram_mib, base_model)


def _export(checkpoint_dir: str, step: int, final: bool, python: str, host_ram_mib: int | None = None,
            base_model: str | None = None) -> dict:
    """``export`` under the step's lock: a partial folder here is one whose maker died."""
    folder = step_dir(checkpoint_dir, step)
    actor = os.path.join(folder, "actor")
    if not os.path.isdir(actor):
        raise ExportError(f"{actor} was removed while this export waited for the step's lock (verl's retention): "
                          "export a later step")
    have = proven(checkpoint_dir, step)
    if have is not None:
        if final and not have.get("final"):
            have["final"] = True
            write_json(os.path.join(folder, PROOF), have)
        log(f"step {step}: already proven ({os.path.join(folder, EXPORT)}, logits within "
            f"{have['max_abs_logit_diff']:.3g})")
        return have
    short = ram_short(host_ram_mib, step)
    if short:
        raise ExportError(short)
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
        found = prove_export(partial, actor, base_model)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)      # never a half-made folder beside the checkpoint
        raise
    prove_s = time.monotonic() - start
    rss = {"merge_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024,   # Linux: KiB
           "proof_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
           "host_ram_mib_predicted": host_ram_mib}
    os.replace(partial, target)
    files = folder_identity(target)
    proof = {"format": FORMAT, "ok": True, "step": step, "final": bool(final), "checkpoint": actor, "export": target,
             "shards": shards, "files": files, "export_bytes": sum(f["bytes"] for f in files),
             "merge_seconds": round(merge_s, 2), "proof_seconds": round(prove_s, 2),
             "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **rss, **found, **versions()}
    write_json(os.path.join(folder, PROOF), proof)
    lora = (f"the LoRA adapter (rank {found['lora_rank']}) merged into the base, the adapter alone in "
            f"{EXPORT}/lora_adapter; ") if "lora_rank" in found else ""
    log(f"step {step}: {target} proven ({proof['export_bytes']} bytes, {found['export_dtype']}; {lora}logits within "
        f"{found['max_abs_logit_diff']:.3g} (limit {found['logit_tolerance']}); merge {merge_s:.1f} s, proof "
        f"{prove_s:.1f} s on {found.get('proof_device', 'cpu')})")
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
    ap.add_argument("--host-ram-mib", type=int, help="the host RAM the merge and the proof need (plan.json's "
                    "prediction, passed by the launcher): checked against MemAvailable before the merge")
    ap.add_argument("--base-model", metavar="REPO@REVISION", help="a LoRA export: the base model its adapter names "
                    "(default: the data stage's stamp beside the model folder the run trained from)")
    args = ap.parse_args(argv)
    os.umask(0o027)                     # as the training unit writes (UMask=0027)
    try:
        if args.base_model:             # checked before anything is merged
            check_base_model(args.base_model)
        proof = export(args.checkpoint_dir, args.step, args.final, host_ram_mib=args.host_ram_mib,
                       base_model=args.base_model)
    except ExportError as exc:
        print(f"verl-lab export FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps({"step": proof["step"], "export": proof["export"], "final": proof["final"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
