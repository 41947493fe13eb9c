"""A model's GSM8K score: greedy answers to the test split, judged by verl 0.5.0's own GSM8K reward.

    <env>/bin/python gsm8k_score.py --model DIR --data test.parquet --out SCORE.json --label LABEL
        --engine hf|vllm --dtype float32|float16|bfloat16 --batch N --prompt-len P --max-new-tokens M
        [--step N] [--final] [--vllm-share S] [--tensor-parallel N] [--limit ROWS]

Placed by tasks/train.py as ``<train_dir>/verl_lab_score.py``; the training launcher runs it with
the env's Python for the base model (once: ``<checkpoint_dir>/gsm8k-base.json``) and for each
export (``global_step_N/hf.gsm8k.json``), with the engine, dtype and batch of plan.json's
``launch.evaluation`` (tasks/evaluation.py: the plan's rollout engine on that GPU, the batch the
memory model sizes).

The prompts are the training format: each row's ``prompt`` (the data stage's test.parquet in
verl's RL format) through the tokenizer's chat template with the generation prompt, tokenized
without special tokens, as verl's RLHFDataset does (verl/utils/dataset/rl_dataset.py). Decoding
is greedy with nothing from the model's generation_config.json but its end tokens (transformers
>= 4.50 otherwise fills every field left at its default from it: patch 0004's note); the response is decoded with
``skip_special_tokens=True`` and judged by ``verl.utils.reward_score.default_compute_score`` with
the row's ``data_source`` ("openai/gsm8k": verl's gsm8k.compute_score, the last ``#### number``),
as verl's NaiveRewardManager judges validation.

* ``hf``: ``model.generate`` on the GPU (the CPU where there is none), prompts sorted by length
  and batched so that ``sequences x (longest prompt + M)`` stays within ``N x (P + M)``, the
  shape the memory model sized; an out-of-memory error halves the batch and is recorded.
* ``vllm``: ``vllm.LLM`` and ``SamplingParams`` as verl 0.5.0's vLLM rollout uses them for greedy
  validation (verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py: ``temperature=0``,
  ``top_p=1.0``, ``top_k=-1``, ``min_p=0.0``, token-id prompts ``{"prompt_token_ids": [...]}``,
  ``generate(prompts=..., sampling_params=..., use_tqdm=False)``), ``max_num_seqs=N`` and the
  planned ``gpu_memory_utilization``.

The JSON: accuracy, correct, rows, prompts/s, seconds, engine, dtype, batch, the model's files and
the data's sha256. A re-run whose JSON names the same model files, data and settings changes
nothing ("already scored") but its ``final`` flag, set when the run has since finished at that
step. The score is made under the lock of the folder it is written into (verl_lab_box/checkpoints.py
``step_lock``: the export's step folder, the checkpoint folder for the base model), so a score and
an export of one step never run together, and the export is not pruned under it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

FORMAT = 1
DTYPES = ("float32", "float16", "bfloat16")
REWARD = "verl.utils.reward_score.default_compute_score"
EXAMPLES = 3


EXPORTERS = ("verl_lab_export.py", "export.py")   # its sibling: placed beside it, or in the repo


def export_module():
    """verl_lab_box/export.py, loaded from beside this program (its JSON reader and version record)."""
    import importlib.util

    if "verl_lab_export" in sys.modules:
        return sys.modules["verl_lab_export"]
    here = os.path.dirname(os.path.abspath(__file__))
    for name in EXPORTERS:
        path = os.path.join(here, name)
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("verl_lab_export", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules["verl_lab_export"] = module
            spec.loader.exec_module(module)
            return module
    raise ImportError(f"no {' or '.join(EXPORTERS)} beside {os.path.abspath(__file__)}: re-run deploy/train.py")


def read_json(path: str) -> dict | None:
    return export_module().read_json(path)


class ScoreError(Exception):
    """The model cannot be scored; the message says why."""


def log(msg: str) -> None:
    print(f"verl-lab score: {msg}", flush=True)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_identity(model: str) -> list[dict]:
    """The model folder's files that decide its answers: weights, config, tokenizer."""
    out = []
    for name in sorted(os.listdir(model)):
        path = os.path.join(model, name)
        if os.path.isfile(path) and (name.endswith((".safetensors", ".json", ".txt", ".jinja", ".model"))):
            st = os.stat(path)
            out.append({"name": name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def settings_of(args) -> dict:
    """What the score depends on besides the model and data (a re-run with other settings scores again)."""
    return {"engine": args.engine, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "limit": args.limit}


def already(args, identity: list[dict], data_sha: str) -> dict | None:
    have = read_json(args.out)
    if (have and have.get("format") == FORMAT and have.get("model_files") == identity
            and have.get("data_sha256") == data_sha and have.get("settings") == settings_of(args)):
        return have
    return None


def read_rows(path: str, limit: int | None) -> list[dict]:
    import pyarrow.parquet as pq

    rows = pq.read_table(path, columns=["data_source", "prompt", "reward_model"]).to_pylist()
    rows = rows[:limit] if limit else rows
    if not rows:
        raise ScoreError(f"{path} has no rows")
    return rows


def prompt_ids(tokenizer, rows: list[dict]) -> list[list[int]]:
    """verl's prompt: the chat template with the generation prompt, no special tokens added."""
    out = []
    for row in rows:
        text = tokenizer.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def batches(lengths: list[int], batch: int, prompt_len: int, new_tokens: int,
            rows: list[int] | None = None) -> list[list[int]]:
    """Indices of ``rows`` (default: all) in generate() calls, longest prompts first: at most
    ``batch`` sequences, and no more tokens than ``batch x (prompt_len + new_tokens)`` counting every
    sequence at the longest prompt of its call (left padding), the shape the memory model sized."""
    budget = batch * (prompt_len + new_tokens)
    order = sorted(range(len(lengths)) if rows is None else rows, key=lambda i: (-lengths[i], i))
    out, current = [], []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1 > batch or (len(current) + 1) * (longest + new_tokens) > budget):
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out


def end_tokens(model_dir: str, tokenizer) -> list[int]:
    """The model's end-of-turn tokens (generation_config.json's eos_token_id), else the tokenizer's."""
    found = (read_json(os.path.join(model_dir, "generation_config.json")) or {}).get("eos_token_id")
    ids = found if isinstance(found, list) else [found] if isinstance(found, int) else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ScoreError(f"{model_dir}: no end-of-sequence token in generation_config.json or the tokenizer")
    return ids


def generate_hf(args, tokenizer, ids: list[list[int]], eos: list[int]) -> tuple[list[list[int]], dict]:
    import inspect

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype),
                                                 attn_implementation="sdpa").to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                              pad_token_id=pad)
    extra = {"use_model_defaults": False} if "use_model_defaults" in inspect.signature(model.generate).parameters else {}
    out: list[list[int] | None] = [None] * len(ids)
    lengths = [len(i) for i in ids]
    batch, ooms, calls = args.batch, 0, 0
    todo = batches(lengths, batch, args.prompt_len, args.max_new_tokens)
    while todo:
        rows = todo.pop(0)
        longest = max(lengths[i] for i in rows)
        input_ids = torch.full((len(rows), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for n, i in enumerate(rows):                      # left padding, as generation needs
            input_ids[n, longest - lengths[i]:] = torch.tensor(ids[i])
            mask[n, longest - lengths[i]:] = 1
        try:
            with torch.no_grad():
                gen = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                     generation_config=config, **extra)
        except torch.OutOfMemoryError:
            if len(rows) == 1:
                raise
            ooms += 1
            batch = max(1, len(rows) // 2)
            log(f"out of memory at {len(rows)} prompts of up to {longest} tokens: {batch} at a time from here on")
            torch.cuda.empty_cache()
            todo = batches(lengths, batch, args.prompt_len, args.max_new_tokens, rows + [i for b in todo for i in b])
            continue
        calls += 1
        for n, i in enumerate(rows):
            response = gen[n, longest:].tolist()
            cut = next((k for k, t in enumerate(response) if t in eos), None)
            out[i] = response[:cut + 1] if cut is not None else response
    facts = {"device": device, "generate_calls": calls, "oom_retries": ooms}
    if device == "cuda":
        facts.update(gpu=torch.cuda.get_device_name(0), peak_allocated_mib=round(torch.cuda.max_memory_allocated() / 2**20))
    return out, facts


def generate_vllm(args, tokenizer, ids: list[list[int]], eos: list[int]) -> tuple[list[list[int]], dict]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, gpu_memory_utilization=args.vllm_share, max_num_seqs=args.batch,
              max_model_len=max(len(i) for i in ids) + args.max_new_tokens, tensor_parallel_size=args.tensor_parallel,
              seed=0, disable_log_stats=True, skip_tokenizer_init=False)
    params = SamplingParams(n=1, temperature=0, top_p=1.0, top_k=-1, min_p=0.0, max_tokens=args.max_new_tokens,
                            stop_token_ids=eos, detokenize=False)
    outputs = llm.generate(prompts=[{"prompt_token_ids": i} for i in ids], sampling_params=params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], {"device": "cuda", "generate_calls": 1, "oom_retries": 0}


def score(args) -> dict:
    """The score, made under the lock of the folder it is written into (the export's step folder,
    or the checkpoint folder for the base model): one score or export of a step at a time."""
    folder = os.path.dirname(os.path.abspath(args.out))
    with export_module().checkpoints_module().step_lock(folder, f"GSM8K score of {args.label}", say=log):
        return _score(args)


def _score(args) -> dict:
    from transformers import AutoTokenizer
    from verl.utils.reward_score import default_compute_score

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ScoreError(f"{args.model} has no config.json: not a Hugging Face model folder")
    identity, data_sha = model_identity(args.model), sha256_of(args.data)
    have = already(args, identity, data_sha)
    if have is not None:
        if args.final and not have.get("final"):     # the run has since finished at this step
            have["final"] = True
            export_module().write_json(args.out, have)
        log(f"{args.label}: already scored ({args.out}: {have['correct']}/{have['rows']} = {have['accuracy']:.4f}"
            f"{', final' if have.get('final') else ''})")
        return have
    rows = read_rows(args.data, args.limit)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = prompt_ids(tokenizer, rows)
    eos = end_tokens(args.model, tokenizer)
    log(f"{args.label}: {len(rows)} prompts of {args.data}, {args.engine} ({args.dtype}), batch {args.batch}, "
        f"at most {args.max_new_tokens} new tokens, greedy")
    start = time.monotonic()
    responses, facts = (generate_vllm if args.engine == "vllm" else generate_hf)(args, tokenizer, ids, eos)
    seconds = time.monotonic() - start
    scores, examples = [], []
    for row, response in zip(rows, responses):
        text = tokenizer.decode(response, skip_special_tokens=True)
        truth = row["reward_model"]["ground_truth"]
        scores.append(float(default_compute_score(row["data_source"], text, truth)))
        if len(examples) < EXAMPLES:
            examples.append({"response": text[-300:], "ground_truth": truth, "score": scores[-1]})
    correct = sum(1 for s in scores if s > 0)
    result = {
        "format": FORMAT, "label": args.label, "model": args.model, "step": args.step, "final": args.final,
        "rows": len(rows), "correct": correct, "accuracy": correct / len(rows),
        "seconds": round(seconds, 2), "prompts_per_s": round(len(rows) / seconds, 3) if seconds else None,
        "generated_tokens": sum(len(r) for r in responses),
        "cut_at_max_new_tokens": sum(1 for r in responses if len(r) >= args.max_new_tokens and r[-1] not in eos),
        "engine": args.engine, "dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens, "settings": settings_of(args), "reward": REWARD,
        "decoding": "greedy; nothing from generation_config.json but its end tokens",
        "data": args.data, "data_sha256": data_sha, "model_files": identity, "examples": examples,
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **facts,
        **export_module().versions(("torch", "transformers", "verl") + (("vllm",) if args.engine == "vllm" else ())),
    }
    part = args.out + ".part"
    with open(part, "w") as fh:
        json.dump(result, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(part, args.out)
    log(f"{args.label}: {correct}/{len(rows)} = {result['accuracy']:.4f} ({result['prompts_per_s']} prompts/s, "
        f"{seconds:.1f} s) -> {args.out}")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--data", required=True, help="GSM8K's test split in verl's RL format (test.parquet)")
    ap.add_argument("--out", required=True, help="the score's JSON")
    ap.add_argument("--label", required=True, help="base, or global_step_N")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--final", action="store_true", help="the export of a finished run")
    ap.add_argument("--engine", choices=("hf", "vllm"), required=True)
    ap.add_argument("--dtype", choices=DTYPES, required=True)
    ap.add_argument("--batch", type=int, required=True, help="prompts per generate() call / vLLM max_num_seqs")
    ap.add_argument("--prompt-len", type=int, required=True, help="prompt tokens the batch was sized for")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--vllm-share", type=float, default=0.9, help="vLLM's gpu_memory_utilization")
    ap.add_argument("--tensor-parallel", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="score only the first ROWS rows")
    args = ap.parse_args(argv)
    if min(args.batch, args.prompt_len, args.max_new_tokens, args.tensor_parallel) < 1:
        ap.error("--batch, --prompt-len, --max-new-tokens and --tensor-parallel must be >= 1")
    os.umask(0o027)                     # as the training unit writes (UMask=0027)
    try:
        score(args)
    except ScoreError as exc:
        print(f"verl-lab score FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
