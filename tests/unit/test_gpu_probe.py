"""The GPU harness's correctness figure, shown on CPU: the probe (bench/gpu/probe/sitecustomize.py)
records the HF rollout's own log-probs of the tokens it samples, and they agree with the actor's
log-probs once patch 0004 is in, and not before. This is what makes the log-prob gap reported in
docs/training-runs.md mean what it says; the GPU runs themselves are not repeated here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tasks import verl_source
from tests.unit.test_hf_rollout import PATCH, _tree

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "tests" / "fixtures" / "gpu_probe_check.py"
PROBE = REPO / "bench" / "gpu" / "probe"


@pytest.mark.parametrize("tree", ["before", "patched"])
def test_probe_measures_the_rollout_actor_gap(verl_python, tmp_path, tree):
    patches = verl_source.patch_files()
    chosen = [p for p in patches if p.name < PATCH] if tree == "before" else patches
    root = _tree(tmp_path / "tree", chosen)
    probe_dir = tmp_path / "probe"
    env = {**os.environ, "PYTHONPATH": f"{PROBE}{os.pathsep}{root}", "VERL_LAB_PROBE_DIR": str(probe_dir)}
    res = subprocess.run([str(verl_python), str(CHECK)], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    found = json.loads(lines[-1][len("RESULT "):])
    records = [json.loads(line) for f in probe_dir.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert any(r["event"] == "generate" and r["sampled"] for r in records)
    if tree == "patched":
        assert found["gap"] < 1e-4, found
    else:
        assert found["gap"] > 0.1, found
