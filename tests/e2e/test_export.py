"""A run's end product on a lab box: a checkpoint made there becomes a proven Hugging Face export
and gets its GSM8K score beside the base model's; two exports started together leave one; an export
goes when its save goes.

One P40 box (HF generate: the engine its plan scores with), the shared fleet's (tests/e2e/conftest.py
``fleet_lab``, after test_foundation.py and test_security.py), is converged with deploy/full.py and
every stage's stand-ins (tests/fixtures/standins/fleet.py: real verl 0.5.0 with the project's
patches, the CPU torch standing in for torch 2.6.0+cu118, the tiny Qwen2 model and GSM8K-shaped
data through the HF endpoint stand-in). On the box, as the train user, verl's own
FSDPCheckpointManager saves a tiny checkpoint on CPU (tests/fixtures/tiny_checkpoint.py: FSDP1 on
one rank into the plan's checkpoint folder, three steps, with the plan's own retention,
``trainer.max_actor_ckpt_to_keep`` = keep + 1 = 2; FSDP2 on two gloo ranks beside it); then:

- two exports of step 3 started together: `train-launcher --export` in the background (the
  launcher's ``after_run``, what the unit runs when verl finishes) and, once its merge is under
  way, deploy/export.py (its `train-launcher --export`): the second waits on the step's lock, then
  finds the export proven; both end 0, one merge, no partial folder left, both scores made once;
  files owned by the train user, not world-readable;
- a re-run changes nothing (the same files, the same mtimes), and deploy/export.py reports zero
  changed operations;
- the two-rank FSDP2 checkpoint exports and proves too (verl_lab_export.py directly);
- deploy/status.py shows base -> trained for the box;
- a later run in the same folder (steps 1-5, the same retention) removes step 3's save: the
  CheckpointDisk fact counts step 3's export as one whose save is gone, and the next export (step
  5) prunes it (its folder, proof and score).

Behaviour: the merge, the proof, the score, the lock and the pruning are the real programs on the
real env. Not here: a run that verl finishes by itself under the unit (no GPU in a box: the
launcher's finished path is tests/unit/test_launcher_after_run.py's, with stand-ins, and the GPU
harness's export profiles'), so the first export stands for the unit's after-run by running the
same launcher function by hand; vLLM scoring (its call checked against vLLM 0.8.5's source:
tests/unit/test_gsm8k_score.py), and any GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
BOX = "p40"          # the shared fleet's P40 box (tests/e2e/conftest.py fleet_lab)
TRAIN = "/opt/verl-lab/train"
CKPT = f"{TRAIN}/checkpoints"
PY = "/opt/verl-lab/envs/verl/bin/python"
FIXTURE = "/opt/verl-lab/home/tiny_checkpoint.py"
ROW_LIMIT_NOTE = "the tiny GSM8K test split has 12 rows"


def _keep(plan):
    """verl's max_actor_ckpt_to_keep of the box's plan: the plan's keep + 1."""
    return int(next(o.split("=", 1)[1] for o in plan["overrides"] if o.startswith("trainer.max_actor_ckpt_to_keep=")))


def _checkpoint(box, model, steps, out=CKPT, strategy="fsdp", world=1, keep=None):
    made = box.ssh(f"cd /opt/verl-lab/train/work && {PY} {FIXTURE} --model {model} --out {out} --strategy {strategy} "
                   f"--world-size {world} --steps {steps}" + (f" --keep {keep}" if keep else ""), user="verl",
                   check=False, timeout=900)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-4000:]


@pytest.fixture(scope="module")
def box(fleet_lab):
    fleet_lab.converge.assert_ok()              # deploy/full.py on the fleet: tests/e2e/conftest.py
    box = fleet_lab.box(BOX)
    box.write_text(FIXTURE, (REPO / "tests" / "fixtures" / "tiny_checkpoint.py").read_text())
    plan = json.loads(box.read_text(f"{TRAIN}/plan.json"))
    box.model = next(o.split("=", 1)[1] for o in plan["overrides"] if o.startswith("actor_rollout_ref.model.path="))
    assert _keep(plan) == plan["checkpoints"]["keep"] + 1 == 2
    _checkpoint(box, box.model, 3, keep=_keep(plan))
    _checkpoint(box, box.model, 1, out=f"{TRAIN}/work/ws2", strategy="fsdp2", world=2)
    box.plan = plan
    return box


@pytest.fixture(scope="module")
def exported(fleet_lab, box):
    """Two exports of step 3 at once: the launcher's in the background, deploy/export.py's once the
    first one's merge is under way (its .hf.partial is there)."""
    log = f"{TRAIN}/work/first-export.log"
    box.ssh(f"(/usr/bin/python3 {TRAIN}/train-launcher --export > {log} 2>&1; echo $? > {log}.rc) "
            "> /dev/null 2>&1 < /dev/null &", user="verl")
    box.ssh(f"for i in $(seq 600); do [ -d {CKPT}/global_step_3/.hf.partial ] && exit 0; sleep 0.5; done; exit 1",
            timeout=320)
    second = fleet_lab.deploy("deploy/export.py", hosts=[BOX], extra_args=["-vvv"], timeout=1800)   # with its output
    box.ssh(f"for i in $(seq 1800); do [ -f {log}.rc ] && exit 0; sleep 1; done; exit 1", timeout=1900)
    first = SimpleNamespace(returncode=int(box.read_text(f"{log}.rc").strip()), stdout=box.read_text(log))
    return first, second


def _json(box, path):
    return json.loads(box.read_text(path))


def test_verls_retention_keeps_what_the_plan_keeps(box):
    assert box.ssh(f"ls {CKPT}").stdout.split() == ["global_step_1", "global_step_2", "global_step_3",
                                                    "latest_checkpointed_iteration.txt"]
    kept = [s for s in (1, 2, 3) if box.exists(f"{CKPT}/global_step_{s}/actor")]
    assert kept == [2, 3]                       # max_ckpt_to_keep = keep + 1 = 2 removed step 1's


def test_two_exports_started_together_leave_one_proven_export(box, exported):
    first, second = exported
    assert first.returncode == 0, first.stdout[-4000:]
    second.assert_ok()
    assert first.stdout.count("verl.model_merger merge --backend fsdp") == 1
    assert "model_merger merge" not in second.output                       # the second merged nothing
    assert "global_step_3: waiting until pid " in second.output and ": export of step 3 is done" in second.output
    assert "step 3: already proven" in second.output
    assert sorted(box.ssh(f"ls -A {CKPT}/global_step_3").stdout.split()) == \
        [".export.lock", "actor", "hf", "hf.gsm8k.json", "hf.proof.json"]      # no .hf.partial left
    assert _json(box, f"{CKPT}/global_step_3/hf.proof.json")["ok"]


def test_the_latest_checkpoint_is_exported_proven_and_scored(box, exported):
    first, _ = exported
    proof = _json(box, f"{CKPT}/global_step_3/hf.proof.json")
    assert proof["ok"] and proof["step"] == 3 and proof["final"] is False       # on demand: the run is not finished
    assert (proof["fsdp_version"], proof["world_size"], proof["export_dtype"]) == (1, 1, "bfloat16")
    assert proof["max_abs_weight_diff"] == 0.0 and proof["max_abs_logit_diff"] <= proof["logit_tolerance"]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= \
        {f["name"] for f in proof["files"]}
    ev = box.plan["launch"]["evaluation"]
    assert (ev["engine"], ev["dtype"]) == ("hf", "float32")           # the P40 plan's rollout
    base, trained = _json(box, f"{CKPT}/gsm8k-base.json"), _json(box, f"{CKPT}/global_step_3/hf.gsm8k.json")
    for score, label in ((base, "base"), (trained, "global_step_3")):
        assert score["label"] == label and score["rows"] == 12, ROW_LIMIT_NOTE
        assert (score["engine"], score["dtype"], score["batch"]) == ("hf", "float32", ev["batch"])
        assert score["max_new_tokens"] == ev["max_new_tokens"] and score["data"] == ev["test_file"]
        assert 0.0 <= score["accuracy"] <= 1.0 and score["prompts_per_s"] > 0
    assert trained["model"] == f"{CKPT}/global_step_3/hf" and trained["step"] == 3
    assert f"(base) -> {trained['accuracy']:.4f} (step 3, not final)" in first.stdout
    for path in (f"{CKPT}/global_step_3/hf/model.safetensors", f"{CKPT}/global_step_3/hf.proof.json",
                 f"{CKPT}/gsm8k-base.json", f"{CKPT}/global_step_3/.export.lock"):
        mode, owner, group = box.stat(path)
        assert (owner, group) == ("verl", "verl") and mode.endswith("0"), (path, mode)   # not world-readable


def test_a_re_run_changes_nothing(fleet_lab, box, exported):
    files = f"{CKPT}/global_step_3/hf/* {CKPT}/global_step_3/hf.proof.json {CKPT}/global_step_3/hf.gsm8k.json " \
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
    trained = _json(box, f"{CKPT}/global_step_3/hf.gsm8k.json")
    assert row["gsm8k"]["step"] == 3 and row["gsm8k"]["final"] is False
    assert row["gsm8k"]["trained"] == trained["accuracy"] and row["gsm8k"]["base"] is not None
    line = next(line for line in res.output.splitlines() if line.startswith(BOX))
    assert line.rstrip().endswith("@3?"), line


def test_an_export_is_pruned_with_its_save(box, exported):
    """Last here: it changes the folder. A later run in the same folder (steps 1-5, keep + 1 = 2)
    removes step 3's save; the box's scan counts its export as pruned space; the next export prunes it."""
    from tasks.facts.disk import CheckpointDisk
    from tasks.facts.export import RunExports

    _checkpoint(box, box.model, 5, keep=_keep(box.plan))
    assert [s for s in range(1, 6) if box.exists(f"{CKPT}/global_step_{s}/actor")] == [4, 5]
    scanned = CheckpointDisk().process(box.ssh(CheckpointDisk().command(CKPT)).stdout.splitlines())
    (orphan,) = scanned["exports"]
    assert (orphan["step"], orphan["save"]) == (3, False) and orphan["bytes"] > 100_000
    out = box.ssh(f"/usr/bin/python3 {TRAIN}/train-launcher --export", user="verl", check=False, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "pruned the export of step 3" in out.stdout and "its save is gone" in out.stdout
    assert sorted(box.ssh(f"ls -A {CKPT}/global_step_3").stdout.split()) == [".export.lock"]
    scanned = CheckpointDisk().process(box.ssh(CheckpointDisk().command(CKPT)).stdout.splitlines())
    assert [(e["step"], e["save"]) for e in scanned["exports"]] == [(5, True)]
    facts = RunExports().process(box.ssh(RunExports().command(CKPT)).stdout.splitlines())
    assert [e["step"] for e in facts["exports"]] == [5] and facts["exports"][0]["proof"]["ok"]
