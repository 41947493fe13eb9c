"""bench/gpu/make_model.py makes a model over save_pretrained's shard size as transformers shards it (the 3B on
the device), and keeps a complete folder of either kind on a re-run; an index with a shard missing is made
again. Real transformers (the unit tests' cached env) on a tiny Qwen2 config with a small shard size standing
in for the 3B's 6 GB."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.fixtures.standins.hf_endpoint import write_tiny_model

REPO = Path(__file__).resolve().parents[2]
MAKE = REPO / "bench" / "gpu" / "make_model.py"


def _make(verl_python, out: Path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([str(verl_python), str(MAKE), "--out", str(out), "--tokenizer", str(model), "--config",
                           str(model / "config.json"), "--device", "cpu", *extra], capture_output=True, text=True,
                          env=env, timeout=600)


def test_a_model_over_the_shard_size_is_sharded_and_kept(verl_python, tmp_path):
    model = write_tiny_model(tmp_path / "tiny")
    (model / "special_tokens_map.json").write_text("{}")             # the payload's tokenizer folder has one
    out = tmp_path / "made"
    res = _make(verl_python, out, model, "--max-shard-size", "200KB")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and not (out / "model.safetensors").exists()
    assert "loaded Qwen2ForCausalLM" in res.stdout                    # transformers reads the shards back
    again = _make(verl_python, out, model, "--max-shard-size", "200KB")
    assert again.returncode == 0 and "already has config.json and its weights: kept" in again.stdout
    (out / shards[-1]).unlink()                                       # an index without its shard is not a model
    made = _make(verl_python, out, model, "--max-shard-size", "200KB")
    assert made.returncode == 0 and "kept" not in made.stdout and (out / shards[-1]).is_file()
