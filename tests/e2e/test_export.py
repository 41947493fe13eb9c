"""A run's end product on a lab box: a checkpoint made there becomes a proven Hugging Face export
and gets its GSM8K score beside the base model's.

One P40 box (HF generate: the engine its plan scores with), the shared fleet's (tests/e2e/conftest.py
``fleet_lab``, after test_foundation.py and test_security.py), is converged with deploy/full.py and
every stage's stand-ins (tests/fixtures/standins/fleet.py: real verl 0.5.0 with the project's
patches, the CPU torch standing in for torch 2.6.0+cu118, the tiny Qwen2 model and GSM8K-shaped
data through the HF endpoint stand-in). On the box, as the train user, verl's own
FSDPCheckpointManager saves a tiny checkpoint on CPU (tests/fixtures/tiny_checkpoint.py: FSDP1 on
one rank into the plan's checkpoint folder, with verl's retention keeping one; FSDP2 on two gloo
ranks beside it); then:

- `train-launcher --export` (what a finished run does, on demand): verl's merger, the proof, the
  base score and the export's score, with plan.json's evaluation settings; files owned by the
  train user, not world-readable;
- a re-run changes nothing (the same files, the same mtimes), and deploy/export.py reports zero
  changed operations;
- the two-rank FSDP2 checkpoint exports and proves too (verl_lab_export.py directly);
- deploy/status.py shows base -> trained for the box.

Behaviour: the merge, the proof and the score are the real programs on the real env. Not here: a
run that verl finishes by itself under the unit (no GPU in a box: the launcher's finished path is
tests/unit/test_launcher_after_run.py's, with stand-ins, and the GPU harness's export profiles'),
vLLM scoring (interface only: tests/unit/test_gsm8k_score.py), and any GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
BOX = "p40"          # the shared fleet's P40 box (tests/e2e/conftest.py fleet_lab)
TRAIN = "/opt/verl-lab/train"
CKPT = f"{TRAIN}/checkpoints"
PY = "/opt/verl-lab/envs/verl/bin/python"
FIXTURE = "/opt/verl-lab/home/tiny_checkpoint.py"
ROW_LIMIT_NOTE = "the tiny GSM8K test split has 12 rows"


@pytest.fixture(scope="module")
def box(fleet_lab):
    fleet_lab.converge.assert_ok()              # deploy/full.py on the fleet: tests/e2e/conftest.py
    box = fleet_lab.box(BOX)
    box.write_text(FIXTURE, (REPO / "tests" / "fixtures" / "tiny_checkpoint.py").read_text())
    plan = json.loads(box.read_text(f"{TRAIN}/plan.json"))
    model = next(o.split("=", 1)[1] for o in plan["overrides"] if o.startswith("actor_rollout_ref.model.path="))
    made = box.ssh(f"cd /opt/verl-lab/train/work && {PY} {FIXTURE} --model {model} --out {CKPT} --strategy fsdp "
                   "--world-size 1 --steps 2 --keep 1", user="verl", check=False, timeout=900)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-4000:]
    made = box.ssh(f"cd /opt/verl-lab/train/work && {PY} {FIXTURE} --model {model} --out {TRAIN}/work/ws2 "
                   "--strategy fsdp2 --world-size 2 --steps 1", user="verl", check=False, timeout=900)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-4000:]
    box.plan = plan
    return box


@pytest.fixture(scope="module")
def exported(box):
    out = box.ssh(f"/usr/bin/python3 {TRAIN}/train-launcher --export", user="verl", check=False, timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def _json(box, path):
    return json.loads(box.read_text(path))


def test_verls_retention_kept_the_last_save_only(box):
    assert box.ssh(f"ls {CKPT}").stdout.split() == ["global_step_1", "global_step_2",
                                                    "latest_checkpointed_iteration.txt"]
    assert not box.exists(f"{CKPT}/global_step_1/actor")            # max_ckpt_to_keep=1 removed it


def test_the_latest_checkpoint_is_exported_proven_and_scored(box, exported):
    proof = _json(box, f"{CKPT}/global_step_2/hf.proof.json")
    assert proof["ok"] and proof["step"] == 2 and proof["final"] is False       # on demand: the run is not finished
    assert (proof["fsdp_version"], proof["world_size"], proof["export_dtype"]) == (1, 1, "bfloat16")
    assert proof["max_abs_weight_diff"] == 0.0 and proof["max_abs_logit_diff"] <= proof["logit_tolerance"]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= \
        {f["name"] for f in proof["files"]}
    ev = box.plan["launch"]["evaluation"]
    assert (ev["engine"], ev["dtype"]) == ("hf", "float32")           # the P40 plan's rollout
    base, trained = _json(box, f"{CKPT}/gsm8k-base.json"), _json(box, f"{CKPT}/global_step_2/hf.gsm8k.json")
    for score, label in ((base, "base"), (trained, "global_step_2")):
        assert score["label"] == label and score["rows"] == 12, ROW_LIMIT_NOTE
        assert (score["engine"], score["dtype"], score["batch"]) == ("hf", "float32", ev["batch"])
        assert score["max_new_tokens"] == ev["max_new_tokens"] and score["data"] == ev["test_file"]
        assert 0.0 <= score["accuracy"] <= 1.0 and score["prompts_per_s"] > 0
    assert trained["model"] == f"{CKPT}/global_step_2/hf" and trained["step"] == 2
    assert "verl.model_merger merge --backend fsdp" in exported.stdout
    assert f"(base) -> {trained['accuracy']:.4f} (step 2, not final)" in exported.stdout
    for path in (f"{CKPT}/global_step_2/hf/model.safetensors", f"{CKPT}/global_step_2/hf.proof.json",
                 f"{CKPT}/gsm8k-base.json"):
        mode, owner, group = box.stat(path)
        assert (owner, group) == ("verl", "verl") and mode.endswith("0"), (path, mode)   # not world-readable


def test_a_re_run_changes_nothing(fleet_lab, box, exported):
    files = f"{CKPT}/global_step_2/hf/* {CKPT}/global_step_2/hf.proof.json {CKPT}/global_step_2/hf.gsm8k.json " \
            f"{CKPT}/gsm8k-base.json"
    before = box.ssh(f"stat -c '%n %Y %s' {files}").stdout
    again = box.ssh(f"/usr/bin/python3 {TRAIN}/train-launcher --export", user="verl", check=False, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already proven" in again.stdout and again.stdout.count("already scored") == 2
    assert "model_merger merge" not in again.stdout
    assert box.ssh(f"stat -c '%n %Y %s' {files}").stdout == before
    fleet_lab.deploy("deploy/export.py", hosts=[BOX], timeout=900).assert_idempotent()


def test_a_two_rank_fsdp2_checkpoint_exports_too(box):
    out = box.ssh(f"{PY} {TRAIN}/verl_lab_export.py --checkpoint-dir {TRAIN}/work/ws2", user="verl", check=False,
                  timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    proof = _json(box, f"{TRAIN}/work/ws2/global_step_1/hf.proof.json")
    assert proof["ok"] and (proof["fsdp_version"], proof["world_size"]) == (2, 2)
    assert proof["max_abs_weight_diff"] == 0.0 and proof["max_abs_logit_diff"] <= proof["logit_tolerance"]


def test_status_shows_base_against_trained(fleet_lab, box, exported, tmp_path):
    res = fleet_lab.deploy("deploy/status.py", data={"status_json": str(tmp_path / "lab.json")}, hosts=[BOX],
                           mode="text", timeout=900)
    assert res.rc == 0 and res.changed == 0, res.tail()
    (row,) = json.loads((tmp_path / "lab.json").read_text())["hosts"]
    trained = _json(box, f"{CKPT}/global_step_2/hf.gsm8k.json")
    assert row["gsm8k"]["step"] == 2 and row["gsm8k"]["final"] is False
    assert row["gsm8k"]["trained"] == trained["accuracy"] and row["gsm8k"]["base"] is not None
    line = next(line for line in res.output.splitlines() if line.startswith(BOX))
    assert line.rstrip().endswith("@2?"), line
