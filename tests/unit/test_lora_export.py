"""verl_lab_box/lora_export.py: a LoRA run's export (the adapter merged into the base, and the adapter alone in
PEFT's format) and its proof, on checkpoints written by verl 0.5.0's own worker on CPU.

The checkpoints: tests/fixtures/lora_worker_run.py (the FSDP1 P40 plan and the FSDP2 + CPUOffloadPolicy GTX 1080
plan with LoRA, tests/unit/test_lora_worker.py): one update, then ``save_checkpoint``; and the same two with the
actor's frozen base in bf16 (FSDP1) and fp16 (FSDP2), as the LoRA plans of bf16 and fp16 cards load it
(``model_dtype``, ``param_dtype`` and the rollout's dtype the card's), the adapters fp32 as peft keeps them. On each,
tests/fixtures/lora_export_run.py runs verl's own model merger, then lora_export, and judges the result by the
training run itself: the actor's log-probs of the step-2 sequences after the update (computed by verl in training)
against PEFT loading the exported adapter onto the original base model folder, and against the merged folder
loaded by transformers alone; the folder's adapted weights against PEFT's own merge (bit for bit: merged in fp32,
rounded once); the adapter loaded by ``AutoPeftModelForCausalLM`` from its config alone (the catalog's repository and
revision, which the data stage's stamp beside the model folder names; offline, from a Hugging Face cache holding
that revision). What verl's merger alone writes for a LoRA checkpoint is measured too (the base model, an adapter
whose alpha is 0), and that the export's current proof refuses it.

The config checks (which adapter configs the merge computes exactly) run here without torch.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tasks.catalog import default_catalog
from tasks.verl import source as verl_source
from tests.unit.test_fsdp2_gather import tiny_model
from tests.unit.test_hf_rollout import _tree
from tests.unit.test_lora_worker import plan_overrides, runs_forked
from verl_lab_box import hf_snapshot, lora_export

EXPORT_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "lora_export_run.py"
# each checkpoint: (card, the actor's model_dtype / param_dtype, the rollout's dtype)
CHECKPOINTS = {"fsdp1": ("fsdp1", "fp32", "float32"), "fsdp2": ("fsdp2", "fp32", "float32"),
               "fsdp1-bf16": ("fsdp1", "bf16", "bfloat16"), "fsdp2-fp16": ("fsdp2", "fp16", "float16")}


# ---------------------------------------------------------------- the adapter config, without torch

def _actor(tmp_path: Path, **config) -> Path:
    folder = tmp_path / "actor" / "lora_adapter"
    folder.mkdir(parents=True)
    values = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM", "use_dora": False,
              "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}
    values.update(config)
    (folder / "adapter_config.json").write_text(json.dumps(values))
    return tmp_path / "actor"


def test_the_run_s_adapter_config_is_read_and_scaled_as_peft_does(tmp_path):
    actor = _actor(tmp_path)
    assert lora_export.is_lora_checkpoint(str(actor)) and not lora_export.is_lora_checkpoint(str(tmp_path))
    config = lora_export.adapter_config(str(actor))
    assert lora_export.scaling(config) == 2.0
    assert lora_export.scaling({**config, "use_rslora": True}) == 16 / 8 ** 0.5


@pytest.mark.parametrize("change, words", [
    ({"lora_alpha": 0}, "lora_alpha 0 is not positive (verl's model merger writes 0"),
    ({"r": 0}, "r 0 is not a positive integer"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"use_dora": True}, "use_dora True"),
    ({"bias": "all"}, "bias 'all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save is set"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern is set"),
])
def test_an_adapter_config_the_merge_cannot_compute_exactly_is_refused(tmp_path, change, words):
    actor = _actor(tmp_path, **change)
    with pytest.raises(lora_export.LoraExportError) as err:
        lora_export.adapter_config(str(actor))
    assert words in str(err.value) and "adapter_config.json" in str(err.value)


def test_a_checkpoint_without_verls_adapter_config_says_what_is_missing(tmp_path):
    with pytest.raises(lora_export.LoraExportError) as err:
        lora_export.adapter_config(str(tmp_path))
    assert "lora_adapter/adapter_config.json" in str(err.value) and "alpha is unknown" in str(err.value)


# ---------------------------------------------------------------- verl's checkpoints, exported

def _in_dtype(overrides: list[str], dtype: str, rollout: str) -> list[str]:
    """The actor's frozen base loaded and computed in ``dtype``, the rollout in ``rollout``."""
    swap = {"+actor_rollout_ref.actor.fsdp_config.model_dtype": dtype,
            "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": dtype,
            "actor_rollout_ref.rollout.dtype": rollout}
    out = [f"{line.split('=', 1)[0]}={swap[line.split('=', 1)[0]]}" if line.split("=", 1)[0] in swap else line
           for line in overrides]
    assert sum(line.split("=", 1)[0] in swap for line in out) == 3, overrides
    return out


def _stamp(model: Path) -> dict:
    """The data stage's stamp beside the model folder (verl_lab_box/hf_snapshot.py writes it after a verified
    download): the catalog's repository and pinned revision of the model the tiny folder stands in for."""
    art = default_catalog().artifacts["qwen_model"]
    stamp = {"digest": "stand-in", "repo": art.repo, "revision": art.revision, "repo_type": "model", "files": {}}
    hf_snapshot.stamp_path(model).write_text(json.dumps(stamp))
    return stamp


@pytest.fixture(scope="module")
def exports(verl_python, served, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-export")
    model = tiny_model(tmp / "model")
    stamp = _stamp(model)
    tree = _tree(tmp / "tree", verl_source.patch_files())
    for name, (card, dtype, rollout) in CHECKPOINTS.items():
        (tmp / f"{name}.json").write_text(json.dumps({"overrides": _in_dtype(plan_overrides(card, model), dtype,
                                                                              rollout)}))
    # the four runs by one process, a forked child each: torch, transformers, peft and verl imported once
    # (the worker's runs served: tests/fixtures/zygote.py; the exports' program not: it sets HF_HUB_CACHE before it
    # imports huggingface_hub, which the server imported already)
    for found, log in runs_forked(served.python(), tree, [(tmp / f"{name}.json", tmp / name) for name in CHECKPOINTS]):
        assert found is not None, log
    # the four exports by one process (one RESULT each, in this order): torch, transformers and peft imported once
    args = [str(a) for name in CHECKPOINTS
            for a in (tmp / name / "global_step_1" / "actor", model, tmp / name / "run.pt", tmp / f"{name}-export")]
    res = subprocess.run([str(verl_python), str(EXPORT_RUN), *args], cwd=tree, capture_output=True, text=True,
                         timeout=600 * len(CHECKPOINTS))
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and len(lines) == len(CHECKPOINTS), res.stdout[-3000:] + res.stderr[-3000:]
    out = {}
    for name, line in zip(CHECKPOINTS, lines, strict=True):
        out[name] = json.loads(line[len("RESULT "):])
        out[name]["_paths"] = {"actor": tmp / name / "global_step_1" / "actor", "tree": tree, "model": model,
                               "stamp": stamp}
    return out


@pytest.mark.parametrize("card", ["fsdp1", "fsdp2"])
def test_verls_merger_alone_writes_the_base_model_and_an_inert_adapter(exports, card):
    merger = exports[card]["merger"]
    assert merger["adapter_alpha"] == 0 and merger["adapter_dtype"] == "torch.bfloat16"
    assert merger["folder_is_base"] and not merger["folder_is_merged"]
    # the export's proof today refuses it (PEFT's names against the folder's), and the LoRA proof says why
    assert merger["export_prove"].startswith("ExportError: the export's tensors differ from the checkpoint's")
    assert merger["lora_prove"].startswith("LoraExportError:") and "not the merged model" in merger["lora_prove"]


@pytest.mark.parametrize("card", list(CHECKPOINTS))
def test_the_export_is_the_merged_model_and_the_adapter_in_peft_format(exports, card):
    found = exports[card]
    assert found["checkpoint"]["fsdp_version"] == (1 if card.startswith("fsdp1") else 2)
    export = found["export"]
    assert (export["lora_rank"], export["lora_alpha"], export["lora_scaling"]) == (4, 8, 2.0)
    assert export["lora_modules"] == 14 and export["adapter_tensors"] == 28 and export["merged_tensors"] > 14
    assert export["verl_adapter_max_abs_diff"] == 0.0          # verl's own lora_adapter/ holds the shards' adapter
    assert export["max_abs_weight_diff"] == 0.0                 # the folder: the merge, bit for bit in bf16
    assert export["export_dtype"] == "bfloat16" and export["tensors"] == export["merged_tensors"]
    assert export["max_abs_logit_diff"] <= export["logit_tolerance"] == 1e-3
    assert export["prompts"] == 3 and export["prompt_tokens"] > 3
    # what training changed is far larger than the folder's bf16 rounding
    assert export["lora_max_abs_logit_diff_adapter_vs_base"] > 10 * export["max_abs_logit_diff_vs_checkpoint_dtype"]
    assert {"model.safetensors", "config.json", "tokenizer.json", "lora_adapter/adapter_config.json",
            "lora_adapter/adapter_model.safetensors"} <= set(found["files"])
    assert found["again_same"]


@pytest.mark.parametrize("card", list(CHECKPOINTS))
def test_the_merged_weights_are_peft_s_merge_bit_for_bit(exports, card):
    """Every adapted weight of the folder is PEFT's merge_and_unload (fp32) of the export's adapter on the checkpoint's
    base, rounded to bf16: for the fp32, the bf16 and the fp16 checkpoint alike (the merge in fp32, rounded once).
    Rounding A and B to the base's dtype first (the export's old merge) made the bf16 and fp16 exports differ here."""
    merge = exports[card]["peft_merge"]
    assert merge["weights"] == 14 and merge["elements"] > 0
    assert merge["differ"] == 0, merge


@pytest.mark.parametrize("card", list(CHECKPOINTS))
def test_the_adapter_names_the_catalog_s_base_model_and_loads_by_it_alone(exports, card):
    """The exported adapter_config.json names the catalog's repository and revision (from the data stage's stamp
    beside the model folder, not the box's folder verl wrote there), and AutoPeftModelForCausalLM loads base and
    adapter from the config alone (offline, from a Hugging Face cache holding that revision): the same log-probs as
    PEFT's adapter on the model folder."""
    stamp, export, auto = exports[card]["_paths"]["stamp"], exports[card]["export"], exports[card]["auto_peft"]
    assert (auto["base_model_name_or_path"], auto["revision"]) == (stamp["repo"], stamp["revision"])
    assert (export["adapter_base_model"], export["adapter_base_revision"]) == (stamp["repo"], stamp["revision"])
    assert export["adapter_base_model_from"].endswith("model.verified.json")
    assert auto["vs_peft_on_folder"] < 1e-6, auto


def test_the_base_model_comes_from_the_option_then_the_stamp_then_the_folder(tmp_path):
    model = tmp_path / "models" / "Qwen--Qwen2.5-0.5B-Instruct"
    model.mkdir(parents=True)
    config = {"base_model_name_or_path": str(model)}
    assert hf_snapshot.stamp_path(model) == Path(str(model) + lora_export.STAMP_SUFFIX)   # the stage's name for it
    assert lora_export.base_model(config) == {"repo": str(model), "revision": None, "source": None}
    rev = "7ae557604adf67be50417f59c2c2f167def9a775"
    hf_snapshot.stamp_path(model).write_text(json.dumps({"repo": "Qwen/Qwen2.5-0.5B-Instruct", "revision": rev,
                                                         "repo_type": "model", "files": {}}))
    assert lora_export.base_model(config) == {"repo": "Qwen/Qwen2.5-0.5B-Instruct", "revision": rev,
                                              "source": str(hf_snapshot.stamp_path(model))}
    given = f"someone/other@{'0' * 40}"
    assert lora_export.base_model(config, given) == {"repo": "someone/other", "revision": "0" * 40,
                                                     "source": "--base-model"}
    for bad in ("Qwen2.5@" + rev, "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct@main"):
        with pytest.raises(lora_export.LoraExportError) as err:
            lora_export.base_model(config, bad)
        assert "REPO@COMMIT" in str(err.value) and repr(bad) in str(err.value)


def test_a_bad_base_model_option_fails_before_anything_is_merged(tmp_path, capsys):
    from verl_lab_box import export

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    assert export.main(["--checkpoint-dir", str(ckpt), "--base-model", "Qwen/Qwen2.5-0.5B-Instruct@main"]) == 1
    assert "REPO@COMMIT" in capsys.readouterr().err
    assert sorted(p.name for p in ckpt.iterdir()) == []


@pytest.mark.parametrize("card", ["fsdp1", "fsdp2"])
def test_the_export_is_the_policy_training_made(exports, card):
    """The actor's own log-probs after the update (verl, in training) against the export: PEFT's adapter on the
    original base model folder equals them within float noise, the merged bf16 folder within bf16 rounding; the
    base model alone is far off."""
    policy = exports[card]["policy"]
    assert policy["tokens"] > 0
    assert policy["peft_adapter_vs_actor"] < 1e-4, policy
    assert policy["merged_folder_vs_actor"] < 2e-2, policy
    assert policy["base_vs_actor"] > 5 * policy["merged_folder_vs_actor"], policy


def test_the_export_program_makes_and_proves_a_lora_checkpoint_s_export(verl_python, exports, tmp_path):
    """verl_lab_box/export.py end to end on the FSDP2 LoRA checkpoint (as the launcher runs it when the run
    finishes): verl's merger, then lora_export's merge and proof through ``prove_export``; its proof JSON records the
    adapter and a re-run is already proven."""
    import os
    import shutil

    paths = exports["fsdp2"]["_paths"]
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(paths["actor"], ckpt / "global_step_1" / "actor")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    export = Path(__file__).resolve().parents[2] / "verl_lab_box" / "export.py"
    env = {**os.environ, "PYTHONPATH": str(paths["tree"]), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = lambda: subprocess.run([str(verl_python), str(export), "--checkpoint-dir", str(ckpt), "--final"],  # noqa: E731
                                 cwd=paths["tree"], capture_output=True, text=True, timeout=600, env=env)
    res = run()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    proof = json.loads((ckpt / "global_step_1" / "hf.proof.json").read_text())
    assert proof["ok"] and proof["lora_rank"] == 4 and proof["max_abs_weight_diff"] == 0.0
    assert (proof["adapter_base_model"], proof["adapter_base_revision"]) == (paths["stamp"]["repo"],
                                                                             paths["stamp"]["revision"])
    assert proof["max_abs_logit_diff"] <= proof["logit_tolerance"]
    assert (ckpt / "global_step_1" / "hf" / "lora_adapter" / "adapter_model.safetensors").is_file()
    assert "merged into the base" in res.stdout
    again = run()
    assert again.returncode == 0 and "already proven" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
