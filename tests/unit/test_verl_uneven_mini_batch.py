"""workload = {"train_batch_size": 3, "ppo_mini_batch_size": 2}: verl 0.5.0 accepts it (its checks:
tests/unit/test_verl_rules.py) and runs it. Here its real actor and critic updates
(DataParallelPPOActor.update_policy, DataParallelPPOCritic.update_critic, with the batch sizes its
workers normalise from the plan's config) take a step of 3 sequences: two mini-batches, of 2 and
of 1 (DataProto.split keeps the remainder), each one optimizer step with a finite gradient norm.

Behaviour of verl's code on CPU (tests/fixtures/verl_uneven_update.py); the model is a tiny random
Qwen2, the step's data random: what this proves is that verl's update takes an uneven last
mini-batch without error, not what it learns. verl scales each micro-batch's loss by the full
mini-batch's accumulation count (ppo_mini_batch_size // micro), so the short mini-batch's gradient
is not scaled up: its step is smaller, never wrong in shape (docs/refusals.md says so).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tasks.plan import GpuTarget, make_plan
from tests.unit.test_plan import workload
from tests.unit.test_verl_validation import verl_root  # noqa: F401  (the fixture)

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "verl_uneven_update.py"


def test_verl_updates_a_step_of_3_in_mini_batches_of_2_and_1(verl_python, verl_root, tmp_path):  # noqa: F811
    plan = make_plan(GpuTarget("Tesla P40", "6.1", 24576), workload(train_batch_size=3, ppo_mini_batch_size=2))
    assert plan.rung == "ppo" and (plan.workload.train_batch_size, plan.workload.ppo_mini_batch_size) == (3, 2)
    item = tmp_path / "plan.json"
    item.write_text(json.dumps({"overrides": plan.override_lines, "batch": 3}))
    res = subprocess.run([str(verl_python), str(SCRIPT), str(item)], cwd=verl_root, capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in res.stdout.splitlines() if line.startswith("UNEVEN ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(lines[0][len("UNEVEN "):])
    assert got["mini_batch"] == {"actor": 2, "critic": 2}
    for role in ("actor", "critic"):
        micro = got["micro_batch"][role]
        run = got[role]
        # mini-batches [2, 1], each split into micro-batches of the plan's size
        expect = [m for mini in (2, 1) for m in [micro] * (mini // micro) + ([mini % micro] if mini % micro else [])]
        assert run["forward_sequences"] == expect, run
        assert run["optimizer_steps"] == 2 and len(run["grad_norms"]) == 2, run
        assert all(0 < g < float("inf") for g in run["grad_norms"]) and run["weights_moved"], run
