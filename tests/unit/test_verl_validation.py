"""verl 0.5.0's own checks pass on every plan: ``RayPPOTrainer._validate_config`` (through the
trainer's real ``__init__``) and the FSDP workers' batch normalisation, on CPU.

tests/fixtures/verl_plan_check.py runs them in the patched verl 0.5.0 tree with the cached
Python of tests/fixtures/standins/env.py (torch + verl's dependencies): one process, the
workers' ``__init__`` in as many forked gloo ranks as the plan has GPUs. The cases are
test_verl_compose.py's (every GPU of docs/plan.md's table that gets a plan, and each rung
forced on a few), plus broken plans that verl must refuse, so the judge is shown to fail.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tasks import verl_source
from tasks.plan import GpuTarget
from tests.fixtures.standins import env as standin
from tests.unit.test_verl_compose import _plan, _plans

CHECK = Path(__file__).resolve().parents[1] / "fixtures" / "verl_plan_check.py"
TRAIN_ROWS = 7473          # GSM8K's train split (tasks/gsm8k.py keeps every row; filtering drops overlong ones)
CASES = _plans()


def _broken():
    """Plans verl refuses: (label, changed override lines, gpu count, what verl says)."""
    base = _plan(next(c for c in CASES if c[0] == "1 x Tesla P40")).override_lines
    four = _plan(("4 x P40", GpuTarget("Tesla P40", "6.1", 24576, 4), {}))
    swap = lambda lines, key, value: [f"{key}={value}" if line.startswith(key + "=") else line for line in lines]  # noqa: E731
    return [
        ("micro-batch not dividing the mini-batch", swap(base, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 3),
         1, "should be divisible by ppo_micro_batch_size_per_gpu"),
        ("sequences not dividing over 4 GPUs", swap(four.override_lines, "data.train_batch_size", 254), 4,
         "must be divisible by minimal possible batch size"),
        ("no log-prob micro-batch", swap(base, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "null"),
         1, "Please set at least one of"),
    ]


@pytest.fixture(scope="module")
def results(verl_python, tmp_path_factory):
    root = standin.verl_tree(tmp_path_factory.mktemp("verl"))
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    for patch in verl_source.patch_files():
        subprocess.run(["git", "apply", str(patch)], cwd=root, check=True)
    items = [{"label": label, "overrides": _plan((label, gpu, extra)).override_lines, "n_gpus": gpu.count,
              "train_rows": TRAIN_ROWS, "val_rows": 64} for label, gpu, extra in CASES]
    items += [{"label": label, "overrides": lines, "n_gpus": n, "train_rows": TRAIN_ROWS, "val_rows": 64}
              for label, lines, n, _ in _broken()]
    plans = tmp_path_factory.mktemp("plans") / "plans.json"
    plans.write_text(json.dumps(items))
    res = subprocess.run([str(verl_python), str(CHECK), str(plans)], cwd=root, capture_output=True, text=True,
                         timeout=900)
    found = {}
    for line in res.stdout.splitlines():
        if line.startswith("PLANCHECK "):
            item = json.loads(line[len("PLANCHECK "):])
            found[item["label"]] = item
    assert len(found) == len(items), res.stdout[-3000:] + res.stderr[-3000:]
    return found


@pytest.mark.parametrize("label,gpu,extra", CASES, ids=[c[0] for c in CASES])
def test_verl_accepts_the_plan(results, label, gpu, extra):
    plan = _plan((label, gpu, extra))
    w = plan.workload
    r = results[label]
    assert "error" not in r and "error" not in r["workers"], r
    # verl decides critic and reference from the config as the plan meant them
    assert r["use_critic"] is w.uses_critic and r["use_reference_policy"] is w.uses_reference
    # the run's length: a step cap, else whole epochs of 'train_batch_size' prompts (verl drops the last partial batch)
    assert r["train_batches"] == TRAIN_ROWS // w.train_batch_size
    assert r["total_training_steps"] == (w.total_training_steps or r["train_batches"] * w.total_epochs)
    # the workers' normalisation: sequences of a mini-batch per GPU, divided into the planned micro-batches
    workers = r["workers"]
    assert workers["actor_mini_per_gpu"] == w.ppo_mini_batch_size * w.rollout_n // gpu.count
    assert workers["actor_micro"] == plan.memory.actor_micro_batch
    assert ("critic_micro" in workers) is w.uses_critic and workers.get("ref", False) is w.uses_reference
    if w.uses_critic:
        assert (workers["critic_mini_per_gpu"], workers["critic_micro"]) == (workers["actor_mini_per_gpu"],
                                                                           plan.memory.critic_micro_batch)
    # HF rollout: equal chunks of the planned size over a rank's share of a step and of validation
    if plan.precision.rollout == "hf":
        train, val = r["hf_chunks"]["train"], r["hf_chunks"]["validation"]
        assert set(train) == {plan.memory.rollout_micro_batch}
        assert sum(train) == w.train_batch_size * w.rollout_n // gpu.count and len(set(val)) == 1


@pytest.mark.parametrize("label,lines,n,message", _broken(), ids=[b[0] for b in _broken()])
def test_verl_refuses_broken_plans(results, label, lines, n, message):
    r = results[label]
    error = r.get("error") or r["workers"].get("error")
    assert error and message in error, r
