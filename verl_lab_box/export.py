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
2. proves the folder (``prove``): it loads with transformers (no missing, unexpected or
   mismatched weights), its tensors equal exactly the checkpoint's weights rebuilt here from the shards
   (``full_weights``: each rank's local shard placed at its offset in the global shape the DTensor
   records, every element covered once; not the merger's code path) in the export's dtype, and
   the logits of both (the checkpoint's weights under the config verl saved beside them,
   ``actor/huggingface/config.json``) on fixed chat prompts, computed on the CPU in fp32, differ by at most
   ``LOGIT_TOLERANCE`` (the difference is recorded, and beside it the difference to the
   checkpoint's own dtype, which is the export's bf16 rounding);
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
FORMAT = 1
LOGIT_TOLERANCE = 1e-3
# Fixed prompts through the export's own chat template (GSM8K-shaped, as training sees them).
PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Let's think step by step and output "
    "the final answer after \"####\".",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much "
    "did she earn? Let's think step by step and output the final answer after \"####\".",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it "
    "take? Let's think step by step and output the final answer after \"####\".",
)


class ExportError(Exception):
    """The checkpoint cannot become a proven export; the message says which file and what to do."""


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


CHECKPOINT_READERS = ("verl_lab_checkpoints.py", "checkpoints.py")   # its sibling: placed beside it, or in the repo


def checkpoints_module():
    """verl_lab_box/checkpoints.py, loaded from beside this program (the step lock, the pruning)."""
    import importlib.util

    if "verl_lab_checkpoints" in sys.modules:
        return sys.modules["verl_lab_checkpoints"]
    here = os.path.dirname(os.path.abspath(__file__))
    for name in CHECKPOINT_READERS:
        path = os.path.join(here, name)
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("verl_lab_checkpoints", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules["verl_lab_checkpoints"] = module
            spec.loader.exec_module(module)
            return module
    raise ImportError(f"no {' or '.join(CHECKPOINT_READERS)} beside {os.path.abspath(__file__)}: re-run deploy/train.py")


def shard_identity(actor_dir: str) -> list[dict]:
    """The files the export is made from (verl_lab_box/checkpoints.py ``shard_identity``)."""
    return checkpoints_module().shard_identity(actor_dir)


def folder_identity(folder: str) -> list[dict]:
    return checkpoints_module().folder_identity(folder)


def read_json(path: str) -> dict | None:
    try:
        with open(path) as fh:
            found = json.load(fh)
        return found if isinstance(found, dict) else None
    except (OSError, ValueError):
        return None


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


# ---------------------------------------------------------------- the checkpoint's own weights

def full_weights(actor_dir: str) -> tuple[dict, dict]:
    """Every parameter of the checkpoint in full, in the dtype the ranks saved it, rebuilt from the
    shards: each rank's local tensor goes to the offset its DTensor placement gives it (torch's
    chunking: ``ceil(n / W)`` rows per rank, the last ranks fewer), and every element of the global
    shape must be covered. Returns (weights, facts: FSDP version, world size, dtype)."""
    import torch

    config = read_json(os.path.join(actor_dir, "fsdp_config.json"))
    if not config or not isinstance(config.get("world_size"), int):
        raise ExportError(f"{actor_dir}/fsdp_config.json is missing or has no world_size: not a verl FSDP checkpoint")
    world = config["world_size"]
    shards = []
    for rank in range(world):
        path = os.path.join(actor_dir, f"model_world_size_{world}_rank_{rank}.pt")
        if not os.path.isfile(path):
            raise ExportError(f"{path} is missing: the checkpoint has {world} ranks (fsdp_config.json) and every rank's "
                              "shard is needed")
        shards.append(torch.load(path, map_location="cpu", weights_only=False))
    keys = sorted(shards[0])
    for rank, shard in enumerate(shards[1:], 1):
        if sorted(shard) != keys:
            raise ExportError(f"rank {rank}'s shard names other parameters than rank 0's: shards of two checkpoints?")
    weights, dtypes = {}, set()
    for key in keys:
        parts = [shard.pop(key) for shard in shards]
        weights[key] = _join(key, parts, world)
        dtypes.add(str(weights[key].dtype).removeprefix("torch."))
    return weights, {"fsdp_version": config.get("FSDP_version"), "world_size": world,
                     "checkpoint_dtype": ",".join(sorted(dtypes))}


def _join(key: str, parts: list, world: int):
    import torch

    first = parts[0]
    if not hasattr(first, "placements"):           # a plain tensor: one rank holds it all
        if world != 1:
            raise ExportError(f"{key}: a plain tensor in a checkpoint of {world} ranks (not a DTensor): "
                              "this layout is not supported")
        return first.detach().clone()
    mesh = first.device_mesh.mesh.flatten().tolist()
    if len(first.placements) != 1 or len(mesh) != world:
        raise ExportError(f"{key}: a {len(first.placements)}-dimensional device mesh of {len(mesh)} ranks; "
                          f"only a 1-D mesh over all {world} ranks (verl's FSDP without fsdp_size) is supported")
    placement, shape = first.placements[0], tuple(first.shape)
    local = [p.to_local() for p in parts]
    if placement.is_replicate():
        for rank, t in enumerate(local[1:], 1):
            if not torch.equal(t, local[0]):
                raise ExportError(f"{key}: replicated, but rank {rank} holds other values than rank 0")
        return local[0].clone()
    if not placement.is_shard():
        raise ExportError(f"{key}: placement {placement} cannot be joined")
    dim = placement.dim
    n = shape[dim]
    chunk = -(-n // world)
    full = torch.empty(shape, dtype=local[0].dtype)
    covered = 0
    for rank, coord in ((r, mesh.index(r)) for r in range(world)):
        start = min(n, coord * chunk)
        rows = max(0, min(n, start + chunk) - start)
        t = local[rank]
        want = shape[:dim] + (rows,) + shape[dim + 1:]
        if tuple(t.shape) != want:
            raise ExportError(f"{key}: rank {rank} holds shape {tuple(t.shape)}, its place in {shape} is {want}")
        full.narrow(dim, start, rows).copy_(t)
        covered += rows
    if covered != n:
        raise ExportError(f"{key}: the shards cover {covered} of {n} rows")
    return full


# ---------------------------------------------------------------- the proof

def _logits(model, inputs: list) -> list:
    import torch

    with torch.no_grad():
        return [model(input_ids=ids, use_cache=False).logits.float() for ids in inputs]


def _max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def prove(export: str, actor_dir: str) -> dict:
    """The folder loads with transformers, holds exactly the checkpoint's weights in its dtype, and
    gives the same logits as they do. Raises ExportError with what differs."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    weights, facts = full_weights(actor_dir)
    stored = {}
    for name in sorted(os.listdir(export)):
        if name.endswith(".safetensors"):
            stored.update(load_file(os.path.join(export, name)))
    if not stored:
        raise ExportError(f"{export} holds no *.safetensors")
    missing, extra = sorted(set(weights) - set(stored)), sorted(set(stored) - set(weights))
    if missing or extra:
        raise ExportError(f"the export's tensors differ from the checkpoint's: missing {missing[:5]}, extra {extra[:5]}")
    export_dtype = {t.dtype for t in stored.values()}
    if len(export_dtype) != 1:
        raise ExportError(f"the export mixes dtypes {sorted(map(str, export_dtype))}")
    dtype = export_dtype.pop()
    worst, worst_key = 0.0, None
    for key, t in stored.items():
        want = weights[key].to(dtype)
        if t.shape != want.shape:
            raise ExportError(f"{key}: the export holds shape {tuple(t.shape)}, the checkpoint {tuple(want.shape)}")
        d = float((t.float() - want.float()).abs().max()) if t.numel() else 0.0
        if d > worst:
            worst, worst_key = d, key
    del stored
    if worst > 0:          # the merger casts each shard to the export's dtype: the same rounding as here
        raise ExportError(f"the export's {worst_key} differs from the checkpoint's weights (in {dtype}) by {worst:.3g}")

    tokenizer = AutoTokenizer.from_pretrained(export)
    inputs = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                      tokenize=False), return_tensors="pt",
                        add_special_tokens=False)["input_ids"] for p in PROMPTS]
    try:
        loaded, info = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32,
                                                            attn_implementation="eager", output_loading_info=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ExportError(f"transformers cannot load {export}: {type(exc).__name__}: {exc}") from None
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys",
                                                           "error_msgs")}
    if bad:
        raise ExportError(f"transformers loads {export} with problems: {bad}")
    loaded.eval()
    got = _logits(loaded, inputs)
    del loaded
    config = AutoConfig.from_pretrained(os.path.join(actor_dir, "huggingface"))   # the checkpoint's own, as saved

    def rebuilt(cast):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, attn_implementation="eager")
        model.load_state_dict({k: (v.to(cast) if cast else v).to(torch.float32) for k, v in weights.items()},
                              strict=True)
        return model.eval()

    in_dtype = _logits(rebuilt(dtype), inputs)
    diff = _max_diff(got, in_dtype)
    own = _logits(rebuilt(None), inputs)
    if diff > LOGIT_TOLERANCE:
        raise ExportError(f"the export's logits differ from the checkpoint's weights (in {dtype}) by {diff:.3g}, more "
                          f"than {LOGIT_TOLERANCE}")
    return {**facts, "export_dtype": str(dtype).removeprefix("torch."), "tensors": len(weights),
            "max_abs_weight_diff": worst, "max_abs_weight_diff_key": worst_key,
            "prompts": len(inputs), "prompt_tokens": sum(int(i.shape[1]) for i in inputs),
            "max_abs_logit_diff": diff, "max_abs_logit_diff_vs_checkpoint_dtype": _max_diff(got, own),
            "logit_tolerance": LOGIT_TOLERANCE}


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
           host_ram_mib: int | None = None) -> dict:
    """The proven export of ``step`` (default: the latest checkpoint); made when it is not there yet.
    Exports of saves verl removed are pruned first; the step's lock is held throughout (a second
    export of the step waits for it, then finds it proven). ``host_ram_mib``: what the merge and
    the proof need, checked against MemAvailable under the lock before the merge (not where the
    export is proven already)."""
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
        return _export(checkpoint_dir, step, final, python, host_ram_mib)


def _export(checkpoint_dir: str, step: int, final: bool, python: str, host_ram_mib: int | None = None) -> dict:
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
        found = prove(partial, actor)
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
    log(f"step {step}: {target} proven ({proof['export_bytes']} bytes, {found['export_dtype']}; logits within "
        f"{found['max_abs_logit_diff']:.3g} of the checkpoint's weights in that dtype, {found['max_abs_logit_diff_vs_checkpoint_dtype']:.3g} "
        f"of its {found['checkpoint_dtype']}; merge {merge_s:.1f} s, proof {prove_s:.1f} s)")
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
    args = ap.parse_args(argv)
    os.umask(0o027)                     # as the training unit writes (UMask=0027)
    try:
        proof = export(args.checkpoint_dir, args.step, args.final, host_ram_mib=args.host_ram_mib)
    except ExportError as exc:
        print(f"verl-lab export FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps({"step": proof["step"], "export": proof["export"], "final": proof["final"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
