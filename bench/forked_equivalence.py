"""Forked children against processes of their own: the LoRA fixtures compute the same either way (issue 45).

    python bench/forked_equivalence.py --base REV [--keep DIR]

REV is a revision whose tests/fixtures/lora_two_ranks.py, lora_worker_run.py, lora_export_run.py and
offload_worker_run.py start a Python for each rank, run and merge (f482004: the adapter's initial A seeded, the
ranks' sha256 reported); this checkout's fork them from one parent that imported torch, transformers, peft and verl
(tests/fixtures/forked_runs.py). On the same inputs (the tests' tiny model, their verl trees and plans), run by the
unit tests' cached Python with one compute thread (as tests/conftest.py sets it):

* lora_two_ranks.py, the four specs of tests/unit/test_lora_merge_ranks.py: every field of every rank's report,
  the sha256 of its log-probs, responses and shards among them;
* lora_worker_run.py, the eight variants of tests/unit/test_lora_worker.py and the four checkpoints of
  test_lora_export.py: the RESULT, the run.pt tensors bit for bit, every file save_checkpoint wrote (its bytes, or
  its tensors where the bytes differ between any two processes), a failing variant's exception;
* lora_export_run.py on the four checkpoints: the RESULT and every file of the export;
* offload_worker_run.py, the six variants of tests/unit/test_fsdp2_gather.py: the RESULT and every tensor saved.

Prints a table with each arm's CPU seconds (its reaped processes') and writes bench/results/forked_equivalence.json.
What differs between any two processes, spawned ones too, is reported and not counted as a difference: FSDP2's
merge peak (an allocator measure: 18,444-21,516 bytes spawned and forked alike), the pickled RNG states of
Python and numpy in verl's extra_state, torch.save's serialization id and a DeviceMesh's hash in FSDP2 shards, the
order of target_modules (a set) in adapter_config.json. docs/testing.md "Heavy processes". No root.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIXTURES = Path("tests") / "fixtures"
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):     # as tests/conftest.py
    os.environ.setdefault(_var, "1")


def _cpu_wall(fn):
    """fn()'s result, and the CPU seconds of the processes it reaped, and its wall."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    out = fn()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return out, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, time.monotonic() - start


def _lines(res, prefix: str) -> list[dict]:
    return [json.loads(line[len(prefix):]) for line in res.stdout.splitlines() if line.startswith(prefix)]


def inputs(tmp: Path) -> dict:
    """The tests' model, trees and specs."""
    from tasks.verl import source as verl_source
    from tests.fixtures.standins import env as standin
    from tests.unit import test_fsdp2_gather as gather
    from tests.unit.test_fsdp2_gather import KNOBS, tiny_model
    from tests.unit.test_hf_rollout import _tree
    from tests.unit.test_lora_export import CHECKPOINTS, _in_dtype
    from tests.unit.test_lora_merge_ranks import LIMIT_S, MEMINFO
    from tests.unit.test_lora_worker import PEFT, WRAP, plan_overrides

    model = tiny_model(tmp / "model")
    patches = verl_source.patch_files()
    trees = {"patched": _tree(tmp / "patched", patches),
             "release": _tree(tmp / "release", [p for p in patches if p.name < WRAP]),
             "wrap": _tree(tmp / "wrap", [p for p in patches if p.name <= WRAP]),
             "peft": _tree(tmp / "peft", [p for p in patches if p.name <= PEFT]),
             "before-0007": _tree(tmp / "before-0007", [p for p in patches if p.name < gather.FIRST])}
    base = gather.plan_overrides(model)
    offload = {"before": ("before-0007", base), "off": ("patched", base),
               "gather": ("patched", base + KNOBS["gather"]), "grads": ("patched", base + KNOBS["grads"]),
               "both": ("patched", base + KNOBS["gather"] + KNOBS["grads"]),
               "fused": ("patched", base + KNOBS["gather"] + KNOBS["grads"] + KNOBS["fused"])}
    variants = {"fsdp1": ("patched", plan_overrides("fsdp1", model)),
                "fsdp2": ("patched", plan_overrides("fsdp2", model)),
                "fsdp2-knobs": ("patched", plan_overrides("fsdp2", model, KNOBS["gather"] + KNOBS["grads"]
                                                          + KNOBS["fused"])),
                "fsdp1-release": ("release", plan_overrides("fsdp1", model)),
                "fsdp1-0011": ("wrap", plan_overrides("fsdp1", model)),
                "fsdp2-0011": ("wrap", plan_overrides("fsdp2", model)),
                "fsdp1-0012": ("peft", plan_overrides("fsdp1", model)),
                "fsdp2-0012": ("peft", plan_overrides("fsdp2", model))}
    for name, (card, dtype, rollout) in CHECKPOINTS.items():
        variants[f"export-{name}"] = ("patched", _in_dtype(plan_overrides(card, model), dtype, rollout))
    (tmp / "specs").mkdir()
    for name, (_, overrides) in variants.items():
        (tmp / "specs" / f"{name}.json").write_text(json.dumps({"overrides": overrides}))
    for name, (_, overrides) in offload.items():
        (tmp / "specs" / f"offload-{name}.json").write_text(json.dumps({"overrides": overrides}))
    ranks = {}
    for card in ("fsdp1", "fsdp2"):
        overrides = [line if not line.startswith("actor_rollout_ref.actor.ppo_mini_batch_size=")
                     else "actor_rollout_ref.actor.ppo_mini_batch_size=4" for line in plan_overrides(card, model)]
        for case, meminfo in MEMINFO.items():
            ranks[f"{card}-{case}"] = tmp / "specs" / f"ranks-{card}-{case}.json"
            ranks[f"{card}-{case}"].write_text(json.dumps({"overrides": overrides, "meminfo_kib": meminfo,
                                                           "limit_s": LIMIT_S}))
    return {"python": str(standin.test_env()), "model": model, "trees": trees, "ranks": ranks,
            "variants": {name: tree for name, (tree, _) in variants.items()}, "exports": list(CHECKPOINTS),
            "offload": {name: tree for name, (tree, _) in offload.items()}}


def two_ranks(setup: dict, checkout: Path, forked: bool) -> list[dict]:
    script, tree = str(checkout / FIXTURES / "lora_two_ranks.py"), setup["trees"]["patched"]
    batches = [list(setup["ranks"].values())] if forked else [[spec] for spec in setup["ranks"].values()]
    out = []
    for specs in batches:
        res = subprocess.run([setup["python"], script, *map(str, specs)], cwd=tree, capture_output=True, text=True)
        out += _lines(res, "RESULT ")
    return out


def worker(setup: dict, checkout: Path, dest: Path, forked: bool, offload: bool = False) -> dict:
    """Each variant's RESULT (None when it failed) and its log's last line, its outputs under dest/NAME
    (offload_worker_run.py's: dest/NAME.pt)."""
    script = str(checkout / FIXTURES / ("offload_worker_run.py" if offload else "lora_worker_run.py"))
    by_tree, found = defaultdict(list), {}
    dest.mkdir(parents=True)
    for name, tree in setup["offload" if offload else "variants"].items():
        if not offload:
            (dest / name).mkdir()
        by_tree[tree].append(name)
    for tree, names in by_tree.items():
        pairs = [[str(dest.parent / "specs" / (f"offload-{n}.json" if offload else f"{n}.json")),
                  str(dest / (f"{n}.pt" if offload else n))] for n in names]
        if forked:
            res = subprocess.run([setup["python"], script, "--forked", *sum(pairs, [])], cwd=setup["trees"][tree],
                                 capture_output=True, text=True)
            found.update({n: (r["result"], r["log"]) for n, r in zip(names, _lines(res, "RUN "), strict=True)})
            continue
        for name, pair in zip(names, pairs, strict=True):
            res = subprocess.run([setup["python"], script, *(["run"] if offload else []), *pair],
                                 cwd=setup["trees"][tree], capture_output=True, text=True)
            got = _lines(res, "RESULT ")
            found[name] = (got[-1] if res.returncode == 0 and got else None, res.stderr)
    return {n: {"result": r, "last_line": (log.strip().splitlines() or [""])[-1]} for n, (r, log) in found.items()}


def export(setup: dict, checkout: Path, checkpoints: Path, dest: Path) -> list[dict]:
    args = [str(a) for n in setup["exports"] for a in (checkpoints / f"export-{n}" / "global_step_1" / "actor",
                                                      setup["model"], checkpoints / f"export-{n}" / "run.pt", dest / n)]
    res = subprocess.run([setup["python"], str(checkout / FIXTURES / "lora_export_run.py"), *args],
                         cwd=setup["trees"]["patched"], capture_output=True, text=True)
    return [json.loads(json.dumps(r).replace(str(dest), "WORK")) for r in _lines(res, "RESULT ")]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compare_ranks(before: list[dict], after: list[dict], names: list[str]) -> dict:
    differ, noise, digests = [], [], 0
    for name, b, a in zip(names, before, after, strict=True):
        assert b["exit"] == a["exit"] == [0, 0], (name, b["exit"], a["exit"])
        for rb, ra in zip(b["ranks"], a["ranks"], strict=True):
            digests += sum(rb["sha256"][k] == ra["sha256"].get(k) for k in rb["sha256"])
            for key in sorted(set(rb) | set(ra)):
                if rb.get(key) != ra.get(key):
                    peak = key == "merge_peak_bytes" and name.startswith("fsdp2")
                    (noise if peak else differ).append(f"{name} rank {rb['rank']} {key}: {rb.get(key)} / {ra.get(key)}")
    return {"differ": differ, "allowed": noise, "sha256_equal": digests}


def compare_files(python: str, before: Path, after: Path, names: list[str]) -> dict:
    """The torch side of the comparison, in the Python that has torch (this file with --tensors)."""
    res = subprocess.run([python, __file__, "--tensors", str(before), str(after), *names], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def tensors_main(before: str, after: str, names: list[str]) -> None:
    import torch

    def same(x, y) -> bool:
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y, strict=True))
        if hasattr(x, "to_local"):
            x, y = x.to_local(), y.to_local()
        if isinstance(x, torch.Tensor):
            return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        if type(x).__name__ == "ndarray":
            return x.shape == y.shape and bool((x == y).all())
        return x == y

    out = {"tensors_equal": 0, "files_same_bytes": 0, "files_same_content": [], "differ": []}
    for name in names:
        b_dir, a_dir = Path(before) / name, Path(after) / name
        if name.endswith(".pt"):          # offload_worker_run.py's saved tensors
            saved_b, saved_a = torch.load(b_dir), torch.load(a_dir)
            if same(saved_b, saved_a):
                out["tensors_equal"] += len(saved_b)
            else:
                out["differ"].append(name)
            continue
        if not (b_dir / "run.pt").is_file():
            continue
        run_b, run_a = torch.load(b_dir / "run.pt"), torch.load(a_dir / "run.pt")
        if same(run_b, run_a):
            out["tensors_equal"] += sum(len(v) if isinstance(v, dict) else 1 for v in run_b.values())
        else:
            out["differ"].append(f"{name}/run.pt")
        files = sorted(str(p.relative_to(b_dir)) for p in b_dir.rglob("*") if p.is_file() and p.name != "run.pt")
        if files != sorted(str(p.relative_to(a_dir)) for p in a_dir.rglob("*") if p.is_file() and p.name != "run.pt"):
            out["differ"].append(f"{name}: other files")
        for rel in files:
            fb, fa = b_dir / rel, a_dir / rel
            if _sha(fb) == _sha(fa):
                out["files_same_bytes"] += 1
                continue
            if rel.endswith("adapter_config.json"):
                jb, ja = json.loads(fb.read_text()), json.loads(fa.read_text())
                jb["target_modules"], ja["target_modules"] = sorted(jb["target_modules"]), sorted(ja["target_modules"])
                ok, why = jb == ja, "target_modules' order"
            else:
                xb, xa = torch.load(fb, weights_only=False), torch.load(fa, weights_only=False)
                rng = {k for k in xb.get("rng", {}) if k in ("random", "numpy")}
                for k in rng:
                    xb["rng"].pop(k), xa["rng"].pop(k)
                ok, why = same(xb, xa), f"bytes; RNG states of {sorted(rng)} set aside" if rng else "bytes"
            if ok:
                out["files_same_content"].append(f"{name}/{rel} ({why})")
            else:
                out["differ"].append(f"{name}/{rel}")
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    from bench.harness import REPO, log, render_table, write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="forked-eq-"))
    base = tmp / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.base], check=True,
                   capture_output=True)
    try:
        log("inputs")
        setup = inputs(tmp)
        rows, doc = [], {"base": args.base, "arms": {}}
        arms = {"before": (base, False), "after": (REPO, True)}
        got: dict = defaultdict(dict)
        for arm, (checkout, forked) in arms.items():
            log(f"{arm}: lora_two_ranks.py")
            got["ranks"][arm] = _cpu_wall(lambda c=checkout, f=forked: two_ranks(setup, c, f))
            log(f"{arm}: lora_worker_run.py")
            got["worker"][arm] = _cpu_wall(lambda c=checkout, f=forked, a=arm: worker(setup, c, tmp / f"w-{a}", f))
            log(f"{arm}: offload_worker_run.py")
            got["offload"][arm] = _cpu_wall(lambda c=checkout, f=forked, a=arm: worker(setup, c, tmp / f"o-{a}", f,
                                                                                       offload=True))
        for arm, (checkout, _) in arms.items():      # both on the same checkpoints (the after arm's)
            log(f"{arm}: lora_export_run.py")
            got["export"][arm] = _cpu_wall(lambda c=checkout, a=arm: export(setup, c, tmp / "w-after", tmp / f"e-{a}"))
        names = list(setup["ranks"])
        checks = {"ranks": compare_ranks(got["ranks"]["before"][0], got["ranks"]["after"][0], names)}
        wb, wa = got["worker"]["before"][0], got["worker"]["after"][0]
        checks["worker"] = compare_files(setup["python"], tmp / "w-before", tmp / "w-after", list(wb))
        checks["worker"]["differ"] += [f"{n} RESULT" for n in wb if wb[n]["result"] != wa[n]["result"]]
        checks["worker"]["differ"] += [f"{n} failure" for n in wb if wb[n]["result"] is None
                                       and wb[n]["last_line"] != wa[n]["last_line"]]
        checks["worker"]["failed_alike"] = [f"{n}: {wa[n]['last_line'][:80]}" for n in wb if wb[n]["result"] is None]
        ob, oa = got["offload"]["before"][0], got["offload"]["after"][0]
        checks["offload"] = compare_files(setup["python"], tmp / "o-before", tmp / "o-after", [f"{n}.pt" for n in ob])
        checks["offload"]["differ"] += [f"{n} RESULT" for n in ob if ob[n]["result"] is None
                                        or ob[n]["result"] != oa[n]["result"]]
        eb, ea = got["export"]["before"][0], got["export"]["after"][0]
        files = {n: sorted(p.relative_to(tmp / "e-before" / n / "hf") for p in (tmp / "e-before" / n / "hf").rglob("*")
                           if p.is_file()) for n in setup["exports"]}
        checks["export"] = {"differ": ([] if eb == ea and len(eb) == len(setup["exports"]) else ["RESULT"])
                            + [f"{n}/{p}" for n, ps in files.items() for p in ps
                               if _sha(tmp / "e-before" / n / "hf" / p) != _sha(tmp / "e-after" / n / "hf" / p)],
                            "files_same_bytes": sum(map(len, files.values()))}
        for part, runs in (("ranks", len(names)), ("worker", len(wb)), ("export", len(eb)), ("offload", len(ob))):
            (_, cpu_b, wall_b), (_, cpu_a, wall_a) = got[part]["before"], got[part]["after"]
            doc["arms"][part] = {"runs": runs, "cpu_s": {"before": cpu_b, "after": cpu_a},
                                 "wall_s": {"before": wall_b, "after": wall_a}, "check": checks[part]}
            rows.append([part, runs, f"{cpu_b:.1f}", f"{cpu_a:.1f}", f"{wall_b:.0f}", f"{wall_a:.0f}",
                         "equal" if not checks[part]["differ"] else f"DIFFER: {checks[part]['differ'][:3]}"])
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False,
                       capture_output=True)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(render_table(["fixture", "runs", "CPU-s spawned", "CPU-s forked", "wall spawned", "wall forked",
                        "what they computed"], rows))
    print(json.dumps({part: v["check"] for part, v in doc["arms"].items()}, indent=1))
    write_result("forked_equivalence", doc)
    return 0 if all(not v["check"]["differ"] for v in doc["arms"].values()) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tensors"]:
        tensors_main(sys.argv[2], sys.argv[3], sys.argv[4:])
        sys.exit(0)
    sys.exit(main())
