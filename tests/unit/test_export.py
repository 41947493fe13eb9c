"""The export (verl_lab_box/export.py) on checkpoints that verl 0.5.0's own FSDPCheckpointManager
made here on CPU (tests/fixtures/tiny_checkpoint.py: FSDP1 and FSDP2, two ranks on gloo, two update
steps), merged by verl's own ``python -m verl.model_merger`` and proven.

Behaviour, with real parts: verl 0.5.0 (the sdist with the project's patches), transformers and
safetensors of verl's pinned set, and the CPU torch standing in for torch 2.6.0+cu118 (the unit
tests' cached env). What stands in: CPU and gloo for the GPUs and NCCL, a tiny Qwen2 model
(tests/fixtures/standins/hf_endpoint.py), plain next-token steps for PPO's. The failures are made
for real (a shard removed, another model's config, no fsdp_config.json) and the doctor must name
what verl's merger, torch and transformers printed. Not here: checkpoints made on a GPU, and the
0.5B's size and time (the GPU harness's export profiles, docs/training-runs.md).

The programs run as children of a preloaded interpreter (tests/fixtures/zygote.py; a fresh one's imports cost ~5
CPU-s a run): the export, the fixtures' checkpoint maker and the library calls, and verl's merger, which the export
starts with ``sys.executable``, but in the ``exported`` fixture: there it starts fresh, so the proof's
``merge_peak_rss_mib`` (which a test reads) is its own peak RSS. The test that reads the first export's PID from the
second one's output starts the first fresh.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.doctor import diagnose
from tests.fixtures.standins import env as standin
from tests.fixtures.standins.hf_endpoint import write_tiny_model
from tests.fixtures.zygote import Zygote

REPO = Path(__file__).resolve().parents[2]
EXPORT = REPO / "verl_lab_box" / "export.py"
CHECKPOINT = REPO / "tests" / "fixtures" / "tiny_checkpoint.py"
STEPS = 2


@pytest.fixture(scope="module")
def lab(verl_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    root = standin.patched_verl_tree(tmp / "verl")
    model = write_tiny_model(tmp / "model")
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO / 'verl_lab_box'}", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with Zygote(verl_python, env) as zygote:

        def run(*args, timeout=600, merger_fresh=False):
            python = zygote.python if merger_fresh else zygote.python_serving_children
            return subprocess.run([python, *map(str, args)], cwd=tmp, env=env, capture_output=True, text=True,
                                  timeout=timeout)

        yield SimpleNamespace(tmp=tmp, model=model, run=run, python=str(verl_python), env=env)


@pytest.fixture(scope="module")
def checkpoints(lab):
    """{strategy: (checkpoint folder, the parameters' sha256 per step as FSDP gathered them)}."""
    made = {}
    for strategy in ("fsdp", "fsdp2"):
        out = lab.tmp / f"ckpt-{strategy}"
        res = lab.run(CHECKPOINT, "--model", lab.model, "--out", out, "--strategy", strategy, "--world-size", 2,
                      "--steps", STEPS)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        made[strategy] = (out, json.loads(res.stdout.strip().splitlines()[-1])["digests"])
    return made


@pytest.fixture(scope="module")
def exported(lab, checkpoints):
    """The export of each checkpoint's last step, made once: {strategy: (folder, proof, output)}."""
    found = {}
    for strategy, (ckpt, _) in checkpoints.items():
        res = lab.run(EXPORT, "--checkpoint-dir", ckpt, "--final", merger_fresh=True)     # its proof's RSS is read
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        step = ckpt / f"global_step_{STEPS}"
        found[strategy] = (step, json.loads((step / "hf.proof.json").read_text()), res.stdout)
    return found


@pytest.fixture(scope="module")
def library(lab, checkpoints, exported, tmp_path_factory):
    """export.py's functions called in one process (not the program: its runs below are their own processes):
    the sha256 of each parameter as export.full_weights rebuilds it from each checkpoint's shards; export.prove of
    two folders that are not the FSDP1 checkpoint's export (one weight moved; the same weights under another
    config: rope_theta changed); last, as it changes the process, export.prove of the real export with the limits
    taken to zero. {"digests": {strategy: {name: sha256}}, "prove": {folder: "proven" or the error}, "bf16_limit":
    "proven" or the error}."""
    tmp = tmp_path_factory.mktemp("export-library")
    step = exported["fsdp"][0]
    moved, config = tmp / "moved", tmp / "config"
    shutil.copytree(step / "hf", moved)
    shutil.copytree(step / "hf", config)
    cfg = json.loads((config / "config.json").read_text())
    cfg["rope_theta"] = 10000.0
    (config / "config.json").write_text(json.dumps(cfg))
    spec = {"actors": {s: str(ckpt / f"global_step_{STEPS}" / "actor") for s, (ckpt, _) in checkpoints.items()},
            "folders": [str(moved), str(config)], "hf": str(step / "hf"), "actor": str(step / "actor")}
    code = ("import hashlib, json, sys, export\n"
            "from safetensors.torch import load_file, save_file\n"
            "spec = json.loads(sys.argv[1])\n"
            "found = {'digests': {}, 'prove': {}}\n"
            "for strategy, actor in spec['actors'].items():\n"
            "    w, _ = export.full_weights(actor)\n"
            "    found['digests'][strategy] = {k: hashlib.sha256(v.float().contiguous().numpy().tobytes()).hexdigest() "
            "for k, v in w.items()}\n"
            "path = spec['folders'][0] + '/model.safetensors'\n"
            "t = load_file(path); t['model.norm.weight'][0] += 0.5; save_file(t, path, metadata={'format': 'pt'})\n"
            "for folder in spec['folders']:\n"
            "    try:\n        export.prove(folder, spec['actor']); found['prove'][folder] = 'proven'\n"
            "    except export.ExportError as exc:\n        found['prove'][folder] = str(exc)\n"
            "export._proof.BF16_RELATIVE_TOLERANCE = 0.0\n"
            "export._proof.SAME_DTYPE_TOLERANCE = 0.0\n"
            "try:\n    export.prove(spec['hf'], spec['actor']); found['bf16_limit'] = 'proven'\n"
            "except export.ExportError as exc:\n    found['bf16_limit'] = str(exc)\n"
            "print(json.dumps(found))")
    res = lab.run("-c", code, json.dumps(spec))
    assert res.returncode == 0, res.stderr[-3000:]
    found = json.loads(res.stdout.strip().splitlines()[-1])
    return {**found, "moved": str(moved), "config": str(config)}


@pytest.mark.parametrize("strategy,fsdp_version", [("fsdp", 1), ("fsdp2", 2)])
def test_the_latest_checkpoint_becomes_a_proven_hugging_face_folder(lab, checkpoints, exported, strategy,
                                                                    fsdp_version):
    step, proof, out = exported[strategy]
    assert proof["ok"] and proof["step"] == STEPS and proof["final"] is True
    assert (proof["fsdp_version"], proof["world_size"]) == (fsdp_version, 2)
    assert (proof["checkpoint_dtype"], proof["export_dtype"]) == ("float32", "bfloat16")
    # the export holds exactly the checkpoint's weights in bf16, its logits are theirs under the checkpoint's
    # config, and the fp32 checkpoint's own within the limit for a bf16 export of it (the rounding, recorded)
    assert proof["max_abs_weight_diff"] == 0.0 and proof["max_abs_logit_diff_in_export_dtype"] <= 1e-3
    assert proof["logit_tolerance"] == pytest.approx(0.25 * proof["max_abs_logit"])
    assert 0 < proof["max_abs_logit_diff"] <= proof["logit_tolerance"]
    assert proof["proof_device"] == "cpu" and proof["format"] == 2
    names = {f["name"] for f in proof["files"]}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert sorted(p.name for p in (step / "hf").iterdir()) == sorted(names)
    assert proof["export_bytes"] == sum((step / "hf" / n).stat().st_size for n in names)
    assert sorted(p.name for p in step.iterdir()) == [".export.lock", "actor", "hf", "hf.proof.json"]  # no partial
    assert "verl.model_merger merge --backend fsdp" in out and "proven" in out


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_the_proof_rebuilds_the_weights_fsdp_itself_gathers(checkpoints, library, strategy):
    """The proof's reference is not the merger's join: each parameter rebuilt from the shards equals,
    bit for bit, what FSDP's own full state dict gave at that step (and step 1's differs: it trained)."""
    digests = checkpoints[strategy][1]
    rebuilt = library["digests"][strategy]
    assert rebuilt == digests[str(STEPS)]
    assert rebuilt["model.norm.weight"] != digests["1"]["model.norm.weight"]


def test_a_re_run_changes_nothing(lab, checkpoints, exported):
    step, proof, _ = exported["fsdp"]
    before = {p.name: p.stat().st_mtime_ns for p in [*(step / "hf").iterdir(), step / "hf.proof.json"]}
    res = lab.run(EXPORT, "--checkpoint-dir", checkpoints["fsdp"][0], "--final")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "already proven" in res.stdout and "model_merger" not in res.stdout
    assert {p.name: p.stat().st_mtime_ns for p in [*(step / "hf").iterdir(), step / "hf.proof.json"]} == before


def test_the_proof_refuses_an_export_that_is_not_the_checkpoint(library):
    """One weight moved (the weight check), or the same weights under another config (the logits)."""
    assert "model.norm.weight differs from the checkpoint's weights" in library["prove"][library["moved"]]
    assert "logits differ from the checkpoint's weights" in library["prove"][library["config"]]


def test_the_bf16_limit_is_enforced(library):
    """The export's gap to the fp32 checkpoint is checked, not only recorded: under a limit of zero the same
    export fails, naming the gap and the limit."""
    assert "logits differ from the checkpoint's own (in float32)" in library["bf16_limit"] and \
        "allowed a bfloat16 export" in library["bf16_limit"], library["bf16_limit"]


def _broken(checkpoints, tmp_path: Path, name: str) -> Path:
    """A copy of the FSDP1 checkpoint's last step, to break."""
    ckpt = tmp_path / name
    shutil.copytree(checkpoints["fsdp"][0] / f"global_step_{STEPS}" / "actor", ckpt / f"global_step_{STEPS}" / "actor")
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    return ckpt


def _fails(lab, ckpt: Path, rule: str, *texts: str) -> str:
    res = lab.run(EXPORT, "--checkpoint-dir", ckpt)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert "verl-lab export FAILED" in res.stderr
    for text in texts:
        assert text in out, out[-3000:]
    step = ckpt / f"global_step_{STEPS}"
    assert sorted(p.name for p in step.iterdir()) == [".export.lock", "actor"]   # nothing half-made beside it
    assert rule in [f.rule for f in diagnose("box", {"journal": out}).findings], out[-3000:]
    return out


def test_a_missing_shard_fails_with_verls_own_error_and_the_doctor_names_it(lab, checkpoints, tmp_path):
    ckpt = _broken(checkpoints, tmp_path, "missing")
    (ckpt / f"global_step_{STEPS}" / "actor" / "model_world_size_2_rank_1.pt").unlink()
    _fails(lab, ckpt, "checkpoint-shard-missing", "FileNotFoundError: [Errno 2] No such file or directory:",
           "model_world_size_2_rank_1.pt")


def test_another_world_size_fails_the_same_way(lab, checkpoints, tmp_path):
    ckpt = _broken(checkpoints, tmp_path, "world")
    (ckpt / f"global_step_{STEPS}" / "actor" / "fsdp_config.json").write_text('{"FSDP_version": 1, "world_size": 4}')
    _fails(lab, ckpt, "checkpoint-shard-missing", "model_world_size_4_rank_0.pt")


def test_a_checkpoint_of_another_model_is_refused(lab, checkpoints, tmp_path):
    """The shards of one model under another model's config.json (the hidden size differs)."""
    ckpt = _broken(checkpoints, tmp_path, "other")
    config = ckpt / f"global_step_{STEPS}" / "actor" / "huggingface" / "config.json"
    cfg = json.loads(config.read_text())
    cfg.update(hidden_size=32, intermediate_size=64)
    config.write_text(json.dumps(cfg))
    _fails(lab, ckpt, "checkpoint-other-model", "size mismatch for")


def test_a_folder_without_fsdp_config_is_no_verl_checkpoint(lab, checkpoints, tmp_path):
    ckpt = _broken(checkpoints, tmp_path, "noconfig")
    (ckpt / f"global_step_{STEPS}" / "actor" / "fsdp_config.json").unlink()
    _fails(lab, ckpt, "checkpoint-not-verl-fsdp", "fsdp_config.json does not exist")


def test_two_exports_of_one_step_started_together_leave_one_proven_export(lab, checkpoints, tmp_path):
    """The second waits on the step's lock (it never removes the first one's .hf.partial), then finds
    the export proven; both end 0."""
    ckpt = _broken(checkpoints, tmp_path, "twice")
    step = ckpt / f"global_step_{STEPS}"
    first = subprocess.Popen([lab.python, str(EXPORT), "--checkpoint-dir", str(ckpt)], cwd=lab.tmp, env=lab.env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (step / ".hf.partial").exists():               # the first one's merge is under way
            assert first.poll() is None and time.monotonic() < deadline, "the first export ended before merging"
            time.sleep(0.05)
        second = lab.run(EXPORT, "--checkpoint-dir", ckpt)
        out_first = first.communicate(timeout=600)[0]
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0 and second.returncode == 0, out_first[-3000:] + second.stdout[-3000:]
    assert "verl.model_merger merge" in out_first and "proven" in out_first
    assert f"waiting until pid {first.pid}: export of step {STEPS} is done" in second.stdout
    assert f"step {STEPS}: already proven" in second.stdout and "model_merger" not in second.stdout
    assert sorted(p.name for p in step.iterdir()) == [".export.lock", "actor", "hf", "hf.proof.json"]


def test_an_export_prunes_the_exports_of_removed_saves_and_a_deleted_folder_is_no_export(lab, checkpoints, exported,
                                                                                         tmp_path):
    """Step 1's save removed (as verl's retention removes it: the actor folder) beside its export:
    exporting step 2 removes step 1's export; and an export whose hf/ was deleted is no longer
    proven (the files decide), so a re-run makes it again."""
    ckpt = _broken(checkpoints, tmp_path, "pruned")
    old = ckpt / "global_step_1"
    shutil.copytree(exported["fsdp"][0] / "hf", old / "hf")
    (old / "hf.proof.json").write_text(json.dumps({**exported["fsdp"][1], "step": 1}))
    (old / "hf.gsm8k.json").write_text("{}")
    res = lab.run(EXPORT, "--checkpoint-dir", ckpt)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "pruned the export of step 1" in res.stdout
    assert sorted(p.name for p in old.iterdir()) == [".export.lock"]
    step = ckpt / f"global_step_{STEPS}"
    shutil.rmtree(step / "hf")
    again = lab.run(EXPORT, "--checkpoint-dir", ckpt)
    assert again.returncode == 0 and "already proven" not in again.stdout and "proven" in again.stdout
    assert (step / "hf" / "model.safetensors").is_file()



def test_an_export_short_of_host_ram_is_refused_before_the_merge_unless_it_is_proven(lab, checkpoints, exported,
                                                                                      tmp_path):
    """``--host-ram-mib`` (the plan's prediction, from the launcher) above MemAvailable: refused with
    the fix, nothing merged or left; an export proven already needs no RAM and passes. The proof
    records the merger's and this process's peak RSS beside the prediction."""
    proof = exported["fsdp"][1]
    assert proof["merge_peak_rss_mib"] > 100 and proof["proof_peak_rss_mib"] > 100
    assert proof["host_ram_mib_predicted"] is None                  # run by hand: no prediction passed
    ckpt = _broken(checkpoints, tmp_path, "ram")
    res = lab.run(EXPORT, "--checkpoint-dir", ckpt, "--host-ram-mib", 2 ** 40)
    assert res.returncode == 1 and f"step {STEPS}'s export needs about {2 ** 40} MiB of host RAM" in res.stderr
    assert "Fix: stop training first" in res.stderr and "model_merger" not in res.stdout
    assert sorted(p.name for p in (ckpt / f"global_step_{STEPS}").iterdir()) == [".export.lock", "actor"]
    again = lab.run(EXPORT, "--checkpoint-dir", checkpoints["fsdp"][0], "--final", "--host-ram-mib", 2 ** 40)
    assert again.returncode == 0 and "already proven" in again.stdout, again.stderr[-2000:]
