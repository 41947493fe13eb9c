"""GSM8K in verl's RL format: the project's own preprocessing (verl's script is not in its
release files and is not copied here).

From the two parquet files of ``openai/gsm8k`` (config ``main``; columns ``question``,
``answer``) to ``train.parquet`` / ``test.parquet`` with exactly verl's columns, plus
``val_small.parquet`` (the first 64 test rows) for quick validation runs:

- ``data_source``: ``"openai/gsm8k"`` (verl picks its GSM8K scorer by this name)
- ``prompt``: ``[{"role": "user", "content": question + " " + INSTRUCTION}]``
- ``ability``: ``"math"``
- ``reward_model``: ``{"style": "rule", "ground_truth": <final answer>}``
- ``extra_info``: ``{"split", "index", "answer", "question"}`` (the raw answer and question)

The final answer is the text after the **last** ``####`` of the answer (GSM8K answers have one;
verl's scorer also reads the last ``#### number`` of a response), with commas and ``$`` signs
removed; it must then be a number (``-12``, ``3.5``). A row without ``####``, or whose final
answer is not a number, is an error naming the split and row (``--bad-rows error``, the
default: the row counts are proven afterwards, so silently dropping rows would only move the
failure); ``--bad-rows skip`` drops such rows and records how many in ``gsm8k.record.json``.

Where it runs: on the box, with the training env's python (``<env>/bin/python gsm8k.py build``).
The env has pyarrow anyway (verl 0.5.0 requires pyarrow >= 19), so the files are written by the
very pyarrow that verl reads them with; both artifact modes then work the same way (in direct
mode the raw parquet files exist only on the box), and the controller needs no pyarrow. The
script is pure (pyarrow and the standard library, no pyinfra) so the stage pushes it as is.

Idempotent: ``gsm8k.record.json`` in the output folder records the sha256 of the inputs and of
this script, and of each output. A re-run with the same inputs whose outputs are intact changes
nothing (exit 0, "unchanged"). Outputs are written to temporary names and renamed into place,
the record last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path

DATA_SOURCE = "openai/gsm8k"
ABILITY = "math"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
OUTPUTS = {"train": "train.parquet", "test": "test.parquet", "val_small": "val_small.parquet"}
RECORD = "gsm8k.record.json"
VAL_ROWS = 64
NUMBER_RE = re.compile(r"^-?\d+(?:\.\d+)?$")


class Gsm8kError(ValueError):
    """A row or file that cannot become verl's format; the message names split, row and file."""


def final_answer(answer: str) -> str:
    """The ground truth of one GSM8K answer: after the last ``####``, commas and ``$`` removed."""
    if not isinstance(answer, str) or "####" not in answer:
        raise Gsm8kError("the answer has no '####' line")
    text = answer.rsplit("####", 1)[1].strip()
    text = text.replace(",", "").replace("$", "").strip()
    if text.endswith(".") and NUMBER_RE.match(text[:-1]):
        text = text[:-1]
    if not NUMBER_RE.match(text):
        raise Gsm8kError(f"the final answer {text!r} after '####' is not a number")
    return text


def to_verl_row(question: str, answer: str, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": final_answer(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert(rows: list[dict], split: str, bad_rows: str = "error") -> tuple[list[dict], int]:
    """GSM8K rows (``question``, ``answer``) -> verl rows; returns (rows, skipped)."""
    out, skipped = [], 0
    for index, row in enumerate(rows):
        try:
            question, answer = row["question"], row["answer"]
            if not isinstance(question, str) or not question.strip():
                raise Gsm8kError("the question is empty")
            out.append(to_verl_row(question, answer, split, index))
        except (Gsm8kError, KeyError) as exc:
            if bad_rows == "skip":
                skipped += 1
                continue
            raise Gsm8kError(f"{split} row {index}: {exc}") from None
    return out, skipped


def verl_schema():
    import pyarrow as pa

    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()),
                                  ("answer", pa.string()), ("question", pa.string())])),
    ])


def read_gsm8k(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = {"question", "answer"} - set(table.column_names)
    if missing:
        raise Gsm8kError(f"{path}: no column {', '.join(sorted(missing))} (has {', '.join(table.column_names)})")
    return table.select(["question", "answer"]).to_pylist()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write(rows: list[dict], dest: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = dest.with_name(dest.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows, schema=verl_schema()), tmp)
    os.replace(tmp, dest)


def _record_matches(out: Path, inputs: dict) -> bool:
    try:
        record = json.loads((out / RECORD).read_text())
    except (OSError, ValueError):
        return False
    if record.get("inputs") != inputs:
        return False
    for name, info in (record.get("outputs") or {}).items():
        path = out / name
        if not path.is_file() or path.stat().st_size != info["size"] or _sha256(path) != info["sha256"]:
            return False
    return bool(record.get("outputs"))


def build(train: Path, test: Path, out: Path, val_rows: int = VAL_ROWS, bad_rows: str = "error") -> dict:
    """Write the three verl files into ``out``; return the record (``changed`` says whether it wrote)."""
    out.mkdir(parents=True, exist_ok=True)
    inputs = {"train": _sha256(train), "test": _sha256(test), "script": _sha256(Path(__file__)),
              "val_rows": val_rows, "bad_rows": bad_rows}
    if _record_matches(out, inputs):
        record = json.loads((out / RECORD).read_text())
        return {**record, "changed": False}
    splits = {}
    skipped = {}
    for split, path in (("train", train), ("test", test)):
        splits[split], skipped[split] = convert(read_gsm8k(path), split, bad_rows)
    splits["val_small"] = splits["test"][:val_rows]
    (out / RECORD).unlink(missing_ok=True)
    outputs = {}
    for split, name in OUTPUTS.items():
        _write(splits[split], out / name)
        outputs[name] = {"rows": len(splits[split]), "size": (out / name).stat().st_size,
                         "sha256": _sha256(out / name)}
    record = {"inputs": inputs, "outputs": outputs, "skipped": skipped}
    tmp = out / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out / RECORD)
    return {**record, "changed": True}


def prove(out: Path, rows: dict[str, int]) -> dict[str, int]:
    """Each output has exactly verl's columns, the expected row count and numeric ground truths."""
    import pyarrow.parquet as pq

    found = {}
    for split, name in OUTPUTS.items():
        path = out / name
        if not path.is_file():
            raise Gsm8kError(f"{path} is missing")
        table = pq.read_table(path)
        if tuple(table.column_names) != VERL_COLUMNS:
            raise Gsm8kError(f"{path}: columns {table.column_names}, expected {list(VERL_COLUMNS)}")
        want = rows.get(split)
        if want is not None and table.num_rows != want:
            raise Gsm8kError(f"{path}: {table.num_rows} rows, expected {want}")
        for i, row in enumerate(table.to_pylist()):
            truth = row["reward_model"]["ground_truth"]
            try:
                float(truth)
            except (TypeError, ValueError):
                raise Gsm8kError(f"{path} row {i}: ground_truth {truth!r} is not a number") from None
            prompt = row["prompt"]
            if (row["data_source"] != DATA_SOURCE or len(prompt) != 1 or prompt[0]["role"] != "user"
                    or not prompt[0]["content"].endswith(INSTRUCTION)):
                raise Gsm8kError(f"{path} row {i}: not in verl's GSM8K format")
        found[split] = table.num_rows
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gsm8k", description="GSM8K parquet -> verl RL format")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write train/test/val_small parquet in verl's format")
    b.add_argument("--train", required=True, type=Path)
    b.add_argument("--test", required=True, type=Path)
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--val-rows", type=int, default=VAL_ROWS)
    b.add_argument("--bad-rows", choices=("error", "skip"), default="error")
    p = sub.add_parser("prove", help="check the outputs: columns, row counts, ground truths")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--train-rows", type=int)
    p.add_argument("--test-rows", type=int)
    p.add_argument("--val-rows", type=int)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            record = build(args.train, args.test, args.out, args.val_rows, args.bad_rows)
            rows = {n: o["rows"] for n, o in record["outputs"].items()}
            print(("wrote " if record["changed"] else "unchanged ") + json.dumps(rows, sort_keys=True))
        else:
            rows = {"train": args.train_rows, "test": args.test_rows, "val_small": args.val_rows}
            print("proven " + json.dumps(prove(args.out, rows), sort_keys=True))
    except (Gsm8kError, OSError) as exc:
        print(f"verl-lab gsm8k: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
