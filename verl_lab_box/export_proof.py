"""The proof of an export: a Hugging Face folder made from a verl actor checkpoint holds that
checkpoint's model, checked tensor by tensor and by its logits.

Placed by tasks/train.py as ``<train_dir>/verl_lab_export_proof.py`` beside ``verl_lab_export.py``
(verl_lab_box/export.py), which loads it and calls ``prove`` after verl's model merger wrote the folder.
Standard library at import; torch, safetensors and transformers are imported by the functions that
run in the training env.

``prove(export, actor_dir)``:

1. the folder loads with transformers (no missing, unexpected or mismatched weights) and gives its
   logits on fixed chat prompts (``PROMPTS``), computed in fp32 with eager attention on the proof's
   device: the GPU when one has room for the model (training has ended and released it, or another
   process leaves enough free), else the CPU (``proof_device``; ``VERL_LAB_PROOF_DEVICE`` names one);
2. the checkpoint's weights are rebuilt from the shards (``full_weights``: each rank's local shard at
   the offset its DTensor placement gives it, every element covered once; not the merger's code path),
   and every tensor of the folder, read one at a time, must equal its weight cast to the export's dtype
   exactly;
3. a model built from the checkpoint's own config (``actor/huggingface/config.json``, as verl saved it)
   takes those weights in the checkpoint's own dtype (assigned, not copied) and gives its logits on the
   same prompts, then with each weight rounded to the export's dtype: the export's logits equal the
   rounded weights' within ``SAME_DTYPE_TOLERANCE`` (the same values: only the config and the load path
   can differ), and the checkpoint's own within the limit for the pair of dtypes (``logit_tolerance``:
   ``SAME_DTYPE_TOLERANCE`` when the export keeps the checkpoint's dtype, ``BF16_RELATIVE_TOLERANCE`` of
   the largest logit when a fp32 checkpoint is exported in bf16, whose rounding of every weight to 8
   significant bits is recorded as ``max_abs_logit_diff``).

Host memory: one copy of the weights in the checkpoint's dtype plus the tensor being compared (the
shards are memory-mapped), and one model at a time: on the GPU when it is used, else on the CPU,
where the reference model shares the weights' own storage. ``peak_host_bytes`` states it for the
plan's prediction.
"""

from __future__ import annotations

import os
import time

SAME_DTYPE_TOLERANCE = 1e-3
# A bf16 export of a fp32 checkpoint: bf16 keeps 8 significant bits, so each weight moves by up to 2^-9 of
# itself, and updates smaller than that are lost. GPU call A (2026-12-05, bench/gpu/results/ppo-20261205-callA)
# measured 0.26-0.30 between the bf16 export and the fp32 checkpoint of the random-weight 0.5B after 3 steps
# (about a tenth of its largest logit): the limit is a quarter of the checkpoint's largest logit on the prompts.
BF16_RELATIVE_TOLERANCE = 0.25
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
DEVICE_ENV = "VERL_LAB_PROOF_DEVICE"
TIED = {"lm_head.weight": "model.embed_tokens.weight"}   # tie_word_embeddings: the head is the embedding
GPU_ROOM = 1.25          # the fp32 model and its activations on the prompts, of the free GPU memory


class ExportError(Exception):
    """The checkpoint cannot become a proven export; the message says which file and what to do."""


def read_json(path: str) -> dict | None:
    import json

    try:
        with open(path) as fh:
            found = json.load(fh)
        return found if isinstance(found, dict) else None
    except (OSError, ValueError):
        return None


def logit_tolerance(export_dtype: str, checkpoint_dtype: str, scale: float) -> float:
    """The limit on the logits' difference between the export and the checkpoint in its own dtype, by their
    dtypes (``scale``: the checkpoint's largest logit on the prompts)."""
    if export_dtype == checkpoint_dtype:
        return SAME_DTYPE_TOLERANCE
    if export_dtype == "bfloat16" and checkpoint_dtype in ("float32", "bfloat16,float32"):
        return max(SAME_DTYPE_TOLERANCE, BF16_RELATIVE_TOLERANCE * scale)
    raise ExportError(f"an export in {export_dtype} of a checkpoint in {checkpoint_dtype}: no stated limit for "
                      "this pair of dtypes")


def peak_host_bytes(parameters: int, checkpoint_bytes_per_param: int = 4) -> int:
    """The proof's host memory at its peak: the weights in the checkpoint's dtype and, when the proof runs
    on the CPU, nothing more for the reference model (it shares them); the export's model, loaded before
    the weights, is freed first. The largest tensor compared at a time is left out (the embedding: a few
    percent)."""
    return parameters * checkpoint_bytes_per_param


# ---------------------------------------------------------------- the checkpoint's own weights

def _load_shard(path: str):
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:        # a file torch cannot map (the legacy format): read it whole
        return torch.load(path, map_location="cpu", weights_only=False)


def full_weights(actor_dir: str) -> tuple[dict, dict]:
    """Every parameter of the checkpoint in full, in the dtype the ranks saved it, rebuilt from the
    shards: each rank's local tensor goes to the offset its DTensor placement gives it (torch's
    chunking: ``ceil(n / W)`` rows per rank, the last ranks fewer), and every element of the global
    shape must be covered. Returns (weights, facts: FSDP version, world size, dtype)."""
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
        shards.append(_load_shard(path))
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

def proof_device(parameters: int) -> str:
    """``cuda`` when a GPU has room for the fp32 model (and its activations on the prompts), else ``cpu``;
    ``VERL_LAB_PROOF_DEVICE`` decides where it is set."""
    import torch

    wanted = os.environ.get(DEVICE_ENV)
    if wanted:
        return wanted
    if not torch.cuda.is_available():
        return "cpu"
    free, _ = torch.cuda.mem_get_info()
    return "cuda" if free > GPU_ROOM * 4 * parameters + (512 << 20) else "cpu"


def _prompt_ids(export: str) -> list:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    tokenize=False), return_tensors="pt",
                      add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _logits(model, inputs: list, device: str) -> list:
    import torch

    with torch.no_grad():
        return [model(input_ids=ids.to(device), use_cache=False).logits.float().cpu() for ids in inputs]


def _export_logits(export: str, inputs: list, device: str) -> tuple[list, int]:
    """The folder loaded by transformers as a user loads it, upcast to fp32, and its logits."""
    import torch
    from transformers import AutoModelForCausalLM

    # on a GPU: read in the stored dtype straight onto it and upcast there (the CPU's cast of every weight
    # and its copy are most of the load); on the CPU: read as fp32
    on_gpu = device != "cpu"
    place = {"torch_dtype": "auto", "device_map": {"": device}} if on_gpu else {"torch_dtype": torch.float32}
    try:
        loaded, info = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager",
                                                            output_loading_info=True, **place)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ExportError(f"transformers cannot load {export}: {type(exc).__name__}: {exc}") from None
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys",
                                                           "error_msgs")}
    if bad:
        raise ExportError(f"transformers loads {export} with problems: {bad}")
    parameters = sum(p.numel() for p in loaded.parameters())
    got = _logits(loaded.to(device).float().eval(), inputs, device)
    del loaded
    return got, parameters


def _compare_tensors(export: str, weights: dict, tied: dict, device: str = "cpu") -> tuple[str, float, str | None]:
    """Every tensor of the folder's safetensors, one at a time, against its weight in the export's dtype;
    a weight tied to another (``tied``: the output head to the embedding, which ``save_pretrained`` stores
    once) may be left out when it equals that one. Returns (the export's dtype, the largest difference,
    its tensor)."""
    import torch
    from safetensors import safe_open

    files = sorted(n for n in os.listdir(export) if n.endswith(".safetensors"))
    if not files:
        raise ExportError(f"{export} holds no *.safetensors")
    seen, dtypes = set(), set()
    worst, worst_key = 0.0, None
    for name in files:
        with safe_open(os.path.join(export, name), framework="pt", device=device) as fh:
            for key in fh.keys():
                t = fh.get_tensor(key)
                seen.add(key)
                dtypes.add(t.dtype)
                if key not in weights:
                    continue
                want = weights[key].to(device).to(t.dtype)
                if t.shape != want.shape:
                    raise ExportError(f"{key}: the export holds shape {tuple(t.shape)}, the checkpoint {tuple(want.shape)}")
                d = float((t.float() - want.float()).abs().max()) if t.numel() else 0.0
                if d > worst:
                    worst, worst_key = d, key
    missing, extra = sorted(set(weights) - seen), sorted(seen - set(weights))
    missing = [k for k in missing if not (k in tied and tied[k] in seen and torch.equal(weights[k], weights[tied[k]]))]
    if missing or extra:
        raise ExportError(f"the export's tensors differ from the checkpoint's: missing {missing[:5]}, extra {extra[:5]}")
    if len(dtypes) != 1:
        raise ExportError(f"the export mixes dtypes {sorted(map(str, dtypes))}")
    dtype = str(dtypes.pop()).removeprefix("torch.")
    if worst > 0:          # the merger casts each shard to the export's dtype: the same rounding as here
        raise ExportError(f"the export's {worst_key} differs from the checkpoint's weights (in {dtype}) by {worst:.3g}")
    return dtype, worst, worst_key


def _checkpoint_logits(actor_dir: str, weights: dict, inputs: list, device: str, export_dtype) -> tuple[list, list]:
    """A model of the checkpoint's own config holding its weights (assigned, not copied; upcast to fp32
    where they are not: bf16 values are exact in fp32): its logits with the weights in their own dtype, then
    with each weight rounded to the export's dtype in place (the export's values, under the checkpoint's
    config). The weights are rounded when this returns."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(os.path.join(actor_dir, "huggingface"))   # the checkpoint's own, as saved
    try:
        from accelerate import init_empty_weights  # parameters on the meta device: no random init
    except ImportError:
        init_empty_weights = None
    state = {k: v if v.dtype == torch.float32 else v.to(torch.float32) for k, v in weights.items()}
    if init_empty_weights is not None:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, attn_implementation="eager")
        model.load_state_dict(state, strict=True, assign=True)
    else:
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, attn_implementation="eager")
        model.load_state_dict(state, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model = model.to(device).eval()
    own = _logits(model, inputs, device)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(export_dtype))
    rounded = _logits(model, inputs, device)
    del model, state
    return own, rounded


def prove(export: str, actor_dir: str, device: str | None = None) -> dict:
    """The folder loads with transformers, holds exactly the checkpoint's weights in its dtype, gives the
    logits of those weights under the checkpoint's own config (``SAME_DTYPE_TOLERANCE``: the config and the
    load path), and its logits are the checkpoint's own within the limit for the pair of dtypes
    (``logit_tolerance``). Raises ExportError with what differs."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False         # fp32 logits as fp32 computes them
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.monotonic()
    inputs = _prompt_ids(export)
    if device is None:
        device = proof_device(_parameters_of(read_json(os.path.join(export, "config.json")) or {}))
    got, parameters = _export_logits(export, inputs, device)
    t_export = time.monotonic()
    weights, facts = full_weights(actor_dir)
    config = read_json(os.path.join(actor_dir, "huggingface", "config.json")) or {}
    tied = TIED if config.get("tie_word_embeddings") else {}
    dtype, worst, worst_key = _compare_tensors(export, weights, tied, device)
    t_tensors = time.monotonic()
    tensors = len(weights)
    own, rounded = _checkpoint_logits(actor_dir, weights, inputs, device, getattr(torch, dtype))
    del weights
    same = _max_diff(got, rounded)
    if same > SAME_DTYPE_TOLERANCE:
        raise ExportError(f"the export's logits differ from the checkpoint's weights (in {dtype}, under the "
                          f"checkpoint's config) by {same:.3g}, more than {SAME_DTYPE_TOLERANCE}: the export's "
                          "config or its load path is not the checkpoint's")
    diff = _max_diff(got, own)
    scale = max(float(t.abs().max()) for t in own)
    limit = logit_tolerance(dtype, facts["checkpoint_dtype"], scale)
    if diff > limit:
        raise ExportError(f"the export's logits differ from the checkpoint's own (in {facts['checkpoint_dtype']}) by "
                          f"{diff:.3g}, more than the {limit:.3g} allowed a {dtype} export of it")
    return {**facts, "export_dtype": dtype, "tensors": tensors,
            "parameters": parameters, "max_abs_weight_diff": worst, "max_abs_weight_diff_key": worst_key,
            "prompts": len(inputs), "prompt_tokens": sum(int(i.shape[1]) for i in inputs),
            "max_abs_logit_diff_in_export_dtype": same, "max_abs_logit_diff": diff, "max_abs_logit": scale,
            "logit_tolerance": limit, "proof_device": device,
            "proof_split_seconds": {"export_logits": round(t_export - t0, 2),
                                    "weights_and_tensors": round(t_tensors - t_export, 2),
                                    "checkpoint_logits": round(time.monotonic() - t_tensors, 2)}}


def _max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _parameters_of(config: dict) -> int:
    """The parameters of a decoder-only config (embedding, layers, head), for the device's room only."""
    try:
        h, n, i, v = (int(config[k]) for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"))
    except (KeyError, TypeError, ValueError):
        return 0
    heads = int(config.get("num_attention_heads") or 1)
    kv = int(config.get("num_key_value_heads") or heads)
    attn = h * h * 2 + 2 * h * (h // heads) * kv
    head = 0 if config.get("tie_word_embeddings") else v * h
    return v * h + head + n * (attn + 3 * h * i)
