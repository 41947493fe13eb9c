"""Checkpoints: the predicted bytes of one save and of the export (tasks/checkpoints.py), what the
plan keeps and how often, the setting, and the disk check (verl_lab_box/checkpoints.py) that the
train stage (from a fact) and the launcher's preflight make.

Pure decisions are tested on plain values. ``test_prediction_matches_verls_own_save`` is the
behaviour test of the prediction: verl 0.5.0's FSDPCheckpointManager (the patched tree the boxes
run) saves a tiny Qwen2 with tied embeddings on CPU, FSDP1 and FSDP2, one and two ranks, the
critic too (tests/fixtures/verl_checkpoint_probe.py, with the config and tokenizer of a model
folder); every file's size is compared with the prediction for that shape, ``huggingface/`` with
the prediction from the model folder's own files (what the plan reads from the catalog). Not tested here: a save on a GPU (bench/gpu: the lead's run), torch 2.6
itself (the CPU torch here is 2.13; the state-dict code read for both is cited in tasks/checkpoints.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tasks import checkpoints as ck
from tasks.memory import ModelShape
from tasks.plan import GpuTarget, make_plan, workload_for
from tasks.settings import SettingsError, load_settings
from verl_lab_box import checkpoints as box
from verl_lab_box import train_launcher as tl

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "fixtures" / "verl_checkpoint_probe.py"
QWEN_05B = json.loads((REPO / "files/models/qwen2.5-0.5b-instruct/config.json").read_text())
QWEN_15B = json.loads((REPO / "files/models/qwen2.5-1.5b-instruct/config.json").read_text())
TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1003, tie_word_embeddings=True, model_type="qwen2")
P40 = GpuTarget("Tesla P40", "6.1", 24576)
GTX1080 = GpuTarget("NVIDIA GeForce GTX 1080", "6.1", 8192)
GiB = 2 ** 30


def shape(cfg=QWEN_05B) -> ModelShape:
    return ModelShape.from_config(dict(cfg))


def plan_for(gpu=P40, **data):
    s = load_settings("box1", data)
    return make_plan(gpu, workload_for(s))


# ---------------------------------------------------------------- the prediction, on plain values

@pytest.mark.parametrize("cfg", [QWEN_05B, QWEN_15B, TINY, {**TINY, "tie_word_embeddings": False}])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_tensor_list_counts_the_models_parameters(cfg, role):
    s = shape(cfg)
    named = ck.tensors(s, role)
    tied = role == "actor" and s.tied_embeddings
    assert sum(ck.numel(d) for n, d in named) - (s.embed_params if tied else 0) == s.params(role)
    assert len({n for n, _ in named}) == len(named)


def test_the_05b_has_the_parameter_count_of_its_catalog_facts():
    assert shape().params("actor") == 494_032_768     # Qwen/Qwen2.5-0.5B-Instruct's model card


def test_fsdp1_stores_a_tied_embedding_twice_fsdp2_once():
    s = shape()
    fsdp1 = ck.role_save(s, "actor", "fsdp", 1, 4, 0)
    fsdp2 = ck.role_save(s, "actor", "fsdp2", 1, 4, 0)
    entries = len(ck.tensors(s, "actor")) * ck.MODEL_ENTRY_BYTES
    assert fsdp1.model_bytes[0] - entries == (s.params("actor") + s.embed_params) * 4
    assert fsdp2.model_bytes[0] - entries == s.params("actor") * 4
    # AdamW's exp_avg and exp_avg_sq: the embedding once in both layouts
    for r in (fsdp1, fsdp2):
        assert 2 * 4 * s.params("actor") <= r.optim_bytes[0] < 2 * 4 * s.params("actor") + 2 ** 20


def test_the_critic_has_no_tied_head_and_its_score_head():
    s = shape()
    critic = ck.role_save(s, "critic", "fsdp", 1, 4, 0)
    assert critic.model_bytes[0] - len(ck.tensors(s, "critic")) * ck.MODEL_ENTRY_BYTES == s.params("critic") * 4


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ranks_split_every_tensor_as_torch_chunk_does(world):
    s = shape()
    one = ck.role_save(s, "actor", "fsdp", 1, 4, 0)
    many = ck.role_save(s, "actor", "fsdp", world, 4, 0)
    entries = len(ck.tensors(s, "actor")) * ck.MODEL_ENTRY_BYTES
    assert sum(b - entries for b in many.model_bytes) == one.model_bytes[0] - entries
    assert many.model_bytes[0] == max(many.model_bytes)          # rank 0 gets torch.chunk's larger chunks
    assert [ck.chunk_rows(10, 4, r) for r in range(4)] == [3, 3, 3, 1]
    assert [ck.chunk_rows(2, 4, r) for r in range(4)] == [1, 1, 0, 0]


def test_one_save_of_the_05b_ppo_and_grpo_rungs():
    """PPO (actor and critic, FSDP1, fp32): 12.43 GB. The issue's first estimate (about 11.9 GB)
    left out FSDP1's second copy of the tied embedding (0.54 GB). GRPO on FSDP2: the actor alone."""
    side = ck.side_files_bytes(None)
    ppo = ck.predict_save(shape(), critic=True, actor_layout="fsdp", world_size=1, param_bytes=4, side_files_bytes=side)
    grpo = ck.predict_save(shape(), critic=False, actor_layout="fsdp2", world_size=1, param_bytes=4,
                           side_files_bytes=side)
    assert 12.40e9 < ppo.total_bytes < 12.45e9
    assert 5.92e9 < grpo.total_bytes < 5.95e9
    assert [r.role for r in ppo.roles] == ["actor", "critic"] and [r.role for r in grpo.roles] == ["actor"]
    assert ppo.box_bytes(1) == ppo.total_bytes


def test_a_box_of_a_cluster_holds_its_ranks_shards():
    s = ck.predict_save(shape(), critic=True, actor_layout="fsdp", world_size=4, param_bytes=4, side_files_bytes=0)
    assert s.box_bytes(2) < s.total_bytes < 2 * s.box_bytes(2)
    assert s.box_bytes(4) >= s.total_bytes


def test_export_is_bf16_with_the_tied_head_and_the_side_files():
    s = shape()
    e = ck.predict_export(s, side_files_bytes=1000)
    assert e - 1000 - len(ck.tensors(s, "actor")) * ck.SAFETENSORS_ENTRY_BYTES == (s.params("actor") + s.embed_params) * 2


def test_side_files_are_the_catalogs_non_weight_files():
    from tasks.catalog import default_catalog

    files = default_catalog().artifact("qwen_model").get("files")
    assert ck.side_files_bytes(files) == 659 + 242 + 1671839 + 7031645 + 7305 + 2776833
    assert ck.side_files_bytes({"model-00001-of-00002.safetensors": {"size": 9}, "model.safetensors.index.json":
                                {"size": 5}, "tokenizer.json": {"size": 7}}) == 7


@pytest.mark.parametrize("every, steps, saves", [(10, None, None), (10, 29, 3), (10, 30, 3), (1, 2, 2), (5, 5, 1)])
def test_saves_in_a_run(every, steps, saves):
    assert ck.saves_in_run(every, steps) == saves


def test_keep_counts_whole_saves_verl_keeps_one_more():
    cp = ck.plan_checkpoints(shape(), critic=True, actor_layout="fsdp", world_size=1, param_dtype="fp32",
                             side_files_bytes=0, keep=1, every=10)
    assert (cp.keep, cp.max_to_keep) == (1, 2)
    assert cp.disk_bytes(1) == 2 * cp.save.total_bytes + cp.export_bytes
    over = dict((k, v) for k, v, _ in ck.retention_overrides(cp))
    assert over == {"trainer.save_freq": 10, "trainer.test_freq": 10, "trainer.max_actor_ckpt_to_keep": 2,
                    "trainer.max_critic_ckpt_to_keep": 2}
    grpo = ck.plan_checkpoints(shape(), critic=False, actor_layout="fsdp2", world_size=1, param_dtype="fp32",
                               side_files_bytes=0, keep=3, every=5, total_steps=2)
    assert "trainer.max_critic_ckpt_to_keep" not in dict((k, v) for k, v, _ in ck.retention_overrides(grpo))
    assert (grpo.every, grpo.saves_in_run, grpo.max_to_keep) == (2, 1, 4)
    assert grpo.disk_bytes(1) == grpo.save.total_bytes + grpo.export_bytes      # a 2-step run saves once
    with pytest.raises(ValueError, match="keep and every"):
        ck.plan_checkpoints(shape(), critic=False, actor_layout="fsdp", world_size=1, param_dtype="fp32",
                            side_files_bytes=0, keep=0)


# ---------------------------------------------------------------- the plan and the setting

def test_the_p40_plan_keeps_one_save_whole_and_records_the_prediction():
    plan = plan_for()
    d = plan.to_dict()
    ov = dict(o.split("=", 1) for o in d["overrides"])
    assert (ov["trainer.save_freq"], ov["trainer.max_actor_ckpt_to_keep"], ov["trainer.max_critic_ckpt_to_keep"]) == (
        "10", "2", "2")
    c = d["checkpoints"]
    assert c["save"]["roles"]["actor"]["layout"] == c["save"]["roles"]["critic"]["layout"] == "fsdp"
    assert c["save_bytes_this_box"] == c["save"]["total_bytes"] == ck.predicted_save_bytes(d)
    assert c["save"]["roles"]["actor"]["huggingface_bytes"] > 11_000_000      # the catalog's tokenizer files
    reasons = {r["setting"]: r for r in d["reasons"]}
    assert "max_actor_ckpt_to_keep = keep + 1 = 2" in reasons["checkpoint_keep"]["why"]
    assert "a tied embedding twice" in reasons["checkpoint_bytes"]["why"]
    assert all(r["why"] for r in d["reasons"])


def test_the_cpu_offload_rung_saves_fsdp2_and_no_critic():
    d = plan_for(GTX1080, workload={"finetune": "full"}).to_dict()
    assert d["rung"] == "grpo-cpu-offload"
    assert d["checkpoints"]["save"]["roles"]["actor"]["layout"] == "fsdp2"
    assert "critic" not in d["checkpoints"]["save"]["roles"]
    assert not any(o.startswith("trainer.max_critic_ckpt_to_keep") for o in d["overrides"])


def test_the_setting_reaches_verls_keys():
    d = plan_for(checkpoints={"keep": 3, "every": 5}).to_dict()
    ov = dict(o.split("=", 1) for o in d["overrides"])
    assert (ov["trainer.save_freq"], ov["trainer.test_freq"], ov["trainer.max_actor_ckpt_to_keep"]) == ("5", "5", "4")
    assert d["checkpoints"]["keep"] == 3 and d["checkpoints"]["max_ckpt_to_keep"] == 4
    capped = plan_for(checkpoints={"every": 50}, train_steps=20).to_dict()
    assert "trainer.save_freq=20" in capped["overrides"] and capped["checkpoints"]["saves_in_run"] == 1


@pytest.mark.parametrize("value, key, words", [
    ({"keep": 0}, "checkpoints.keep", "0 is not a positive integer"),
    ({"every": "10"}, "checkpoints.every", "'10' is not a positive integer"),
    ({"keep": True}, "checkpoints.keep", "True is not a positive integer"),
    ({"kep": 2}, "checkpoints.kep", "did you mean checkpoints.keep"),
    ([1, 2], "checkpoints", "is not a mapping"),
])
def test_bad_checkpoint_settings_stop_before_any_host_changes(value, key, words):
    with pytest.raises(SettingsError) as err:
        load_settings("box7", {"checkpoints": value})
    assert err.value.key == key and err.value.host == "box7"
    assert words in str(err.value) and "Fix:" in str(err.value)


def test_checkpoint_settings_default():
    assert load_settings("box1", {}).checkpoints == {"keep": 1, "every": 10}


# ---------------------------------------------------------------- the disk need (box side)

SAVE, EXPORT = 10 * GiB, 1 * GiB


def found(free, saves=(), tracker=None):
    return {"free": {"path": "/opt/verl-lab/train/checkpoints", "free_bytes": free}, "tracker": tracker,
            "saves": [{"step": s, "roles": {"actor": b}} for s, b in saves]}


def margin(b):
    return int(b * (1 + box.MARGIN_FRACTION)) + box.MARGIN_BYTES


def test_a_fresh_run_needs_the_kept_saves_the_one_written_and_the_export():
    need = box.disk_need(SAVE, 2, EXPORT, 10, found(100 * GiB))
    assert need["need_bytes"] == margin(2 * SAVE + EXPORT) and need["fits"]
    assert not box.disk_need(SAVE, 2, EXPORT, 10, found(need["need_bytes"] - 1))["fits"]
    assert box.disk_need(SAVE, 2, EXPORT, 10, found(need["need_bytes"]))["fits"]


def test_saves_verl_removes_count_as_free():
    # a restarted run: tracker 20, saves 10 and 20 whole; the next save is 30 and removes 10 first
    need = box.disk_need(SAVE, 2, EXPORT, 10, found(0, [(10, SAVE), (20, SAVE)], tracker=20))
    assert need["reusable_bytes"] == 2 * SAVE and need["peak_saves_bytes"] == 2 * SAVE
    assert need["need_bytes"] == margin(2 * SAVE + EXPORT) - 2 * SAVE


def test_a_cut_save_at_the_next_step_is_written_over():
    need = box.disk_need(SAVE, 2, EXPORT, 10, found(0, [(10, SAVE), (20, 3 * GiB)], tracker=10))
    assert need["next_save_step"] == 20 and need["reusable_bytes"] == SAVE + 3 * GiB


def test_saves_past_the_next_step_stay_and_bigger_old_saves_raise_the_peak():
    stay = box.disk_need(SAVE, 2, EXPORT, 10, found(0, [(10, SAVE), (40, SAVE)], tracker=10))
    assert stay["staying_bytes"] == SAVE and stay["reusable_bytes"] == SAVE
    # a PPO save (20 GiB) left by an earlier plan stays beside the first GRPO save (max 2 on disk)
    big = box.disk_need(SAVE, 2, EXPORT, 10, found(0, [(10, 2 * SAVE)], tracker=10))
    assert big["peak_saves_bytes"] == 3 * SAVE


def test_a_run_with_fewer_saves_than_kept_needs_only_those():
    need = box.disk_need(SAVE, 3, EXPORT, 10, found(100 * GiB), saves_in_run=1, last_step=2)
    assert need["need_bytes"] == margin(SAVE + EXPORT) and need["new_saves"] == 1 and need["next_save_step"] == 2


def test_the_words_give_the_numbers_and_the_fix():
    need = box.disk_need(SAVE, 2, EXPORT, 10, found(3 * GiB))
    words = box.need_words(need, "/opt/verl-lab/train/checkpoints", keep=1)
    assert words.startswith("/opt/verl-lab/train/checkpoints has 3.0 GiB free, this run needs 22.5 GiB there: "
                            "2 saves of 10.0 GiB (1 kept whole + 1 being written) + the export 1.0 GiB")
    assert "free 19.5 GiB more there, or put lab_root on a larger disk" in words
    assert "checkpoints.keep is 1 already" in words
    three = box.need_words(box.disk_need(SAVE, 3, EXPORT, 10, found(3 * GiB)), "/x", keep=2)
    assert "set checkpoints.keep lower (it is 2; each kept save is 10.0 GiB)" in three
    assert box.gib(64 * 2 ** 20) == "64.0 MiB"


def test_scan_and_the_fact_command_agree(tmp_path):
    d = tmp_path / "checkpoints"
    for step, role, size in ((10, "actor", 300_000), (10, "critic", 100_000), (20, "actor", 50_000)):
        (d / f"global_step_{step}" / role).mkdir(parents=True)
        (d / f"global_step_{step}" / role / "model_world_size_1_rank_0.pt").write_bytes(os.urandom(size))
    (d / "global_step_10" / "data.pt").write_bytes(b"x")
    (d / "global_step_5").mkdir()                       # removed by verl: only data.pt was left
    (d / "global_step_5" / "data.pt").write_bytes(b"x")
    (d / box.TRACKER).write_text("10")
    scanned = box.scan(str(d))
    out = subprocess.run(["sh", "-c", box.fact_command(str(d))], capture_output=True, text=True).stdout
    parsed = box.parse_fact_output(out)
    assert [s["step"] for s in scanned["saves"]] == [10, 20] and scanned["tracker"] == parsed["tracker"] == 10
    assert parsed["saves"] == scanned["saves"]
    assert abs(parsed["free"]["free_bytes"] - scanned["free"]["free_bytes"]) < 64 * 2 ** 20
    assert box.retained_steps(str(d)) == [10, 20]
    assert box.step_bytes(str(d), 10) == 300_000 + 100_000 + 1 and box.step_bytes(str(d), 30) == 0
    assert box.scan(str(tmp_path / "none" / "checkpoints"))["free"]["path"] == str(tmp_path)


# ---------------------------------------------------------------- the train stage and the launcher

def layout(tmp_path=None, **data):
    from tests.unit.test_train_launcher import layout_for, settings_for

    return layout_for(settings_for(str(tmp_path) if tmp_path else "/opt/verl-lab", **data))


def recorded(case):
    path = REPO / "tests" / "fixtures" / "facts" / "disk.CheckpointDisk" / f"{case}.json"
    return json.loads(path.read_text())["fact"]


def test_the_stage_refuses_a_small_disk_with_the_numbers():
    from tasks.train import checkpoint_disk_short

    lay = layout()
    short = checkpoint_disk_short(lay, recorded("small_filesystem"))
    assert short.startswith("/opt/verl-lab/train/checkpoints has 64.0 MiB free, this run needs 26.0 GiB there")
    assert checkpoint_disk_short(lay, recorded("no_folder_yet")) is None        # 72.8 GiB free
    assert "could not measure" in checkpoint_disk_short(lay, recorded("df_failed"))


def test_the_launch_section_carries_what_the_preflight_checks():
    lay = layout()
    launch = json.loads(lay.plan_json())["launch"]["checkpoints"]
    cp = lay.plan.checkpoints
    assert launch == {"dir": "/opt/verl-lab/train/checkpoints", "save_bytes": cp.save.box_bytes(1), "max_saves": 2,
                      "keep": 1, "every": 10, "export_bytes": cp.export_bytes, "gather_bytes": 0, "saves_in_run": None,
                      "last_step": None, "export_host_ram": cp.export_ram.launch()}


class _Launch:
    def __init__(self, checkpoints):
        self.checkpoints = checkpoints


def test_the_preflight_checks_the_disk(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    free = box.scan(str(d))["free"]["free_bytes"]
    base = {"dir": str(d), "max_saves": 2, "keep": 1, "every": 10, "export_bytes": 2 ** 20, "saves_in_run": None,
            "last_step": None}
    preflight = tl.preflight_module()
    rep = preflight.Report()
    preflight.check_disk(rep, _Launch({**base, "save_bytes": 2 ** 20}))
    preflight.check_disk(rep, _Launch({**base, "save_bytes": free}))
    preflight.check_disk(rep, _Launch(None))
    (ok, _, fine), (fail, _, short), (skip, _, _) = rep.results
    assert (ok, fail, skip) == ("ok", "FAIL", "skip")
    assert "for 2 saves of 1.0 MiB and the export" in fine
    assert f"{d} has " in short and "this run needs" in short and "Fix: free" in short


def test_the_doctor_gives_the_plans_numbers_for_a_full_disk():
    from tasks.doctor import diagnose

    log = (REPO / "tests" / "fixtures" / "doctor" / "checkpoint-disk-full.log").read_text()
    plan = plan_for().to_dict()
    (finding,) = [f for f in diagnose("p40", {"journal": log}, plan).findings if f.rule == "checkpoint-disk-full"]
    d = finding.details
    assert d["save_bytes_this_box"] == plan["checkpoints"]["save_bytes_this_box"]
    assert d["advice"].startswith("one save here is 11.6 GiB; checkpoints keep = 1 holds 2 on disk at once")
    assert "keep = 1 is the fewest" in d["advice"]
    two = plan_for(checkpoints={"keep": 2}).to_dict()
    (f2,) = [f for f in diagnose("p40", {"journal": log}, two).findings if f.rule == "checkpoint-disk-full"]
    assert "keep = 1 needs 11.6 GiB less" in f2.details["advice"]
    (f3,) = [f for f in diagnose("p40", {"journal": log}).findings if f.rule == "checkpoint-disk-full"]
    assert "no plan.json" in f3.details["advice"]


# ---------------------------------------------------------------- verl's own save, on CPU

NORMALIZE = """\
import shutil, sys
from transformers import AutoConfig, AutoTokenizer, GenerationConfig
src, dest = sys.argv[1:3]
AutoConfig.from_pretrained(src).save_pretrained(dest)
GenerationConfig.from_pretrained(src).save_pretrained(dest)
AutoTokenizer.from_pretrained(src).save_pretrained(dest)
shutil.copy(src + "/model.safetensors", dest)
"""


@pytest.fixture(scope="module")
def model_dir(served, tmp_path_factory):
    """The tiny Qwen2 model's folder as a hub repo holds its files: written by transformers'
    ``save_pretrained`` (Qwen2.5's tokenizer.json is indented JSON, as save_pretrained writes it;
    the stand-in endpoint's is compact)."""
    from tests.fixtures.standins.hf_endpoint import write_tiny_model

    tmp = tmp_path_factory.mktemp("probe-model")
    raw = write_tiny_model(tmp / "raw")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run([served.python(env), "-c", NORMALIZE, str(raw), str(tmp / "model")], check=True, timeout=300,
                   env=env)
    return tmp / "model"


def model_files(folder) -> dict:
    """A model folder's files as the catalog lists a repo's: {name: {"size": bytes}}."""
    return {p.name: {"size": p.stat().st_size} for p in Path(folder).iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def saved(served, patched_verl_root, model_dir):
    """Each probe run's files: (world, role, layout, param dtype) -> {relative path: bytes}; the
    model's config and tokenizer are ``model_dir``'s."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    runs = [subprocess.Popen([served.python(env), str(PROBE), "sizes", str(w), str(model_dir)], cwd=patched_verl_root,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            for w in (1, 2)]
    out = {}
    for run in runs:
        stdout, stderr = run.communicate(timeout=900)
        assert run.returncode == 0, stderr[-3000:]
        for line in stdout.splitlines():
            if line.startswith("PROBE "):
                item = json.loads(line[len("PROBE "):])
                out[(item["world"], item["role"], item["layout"], item["param_dtype"])] = item["files"]
    return out


def test_prediction_matches_verls_own_save(saved, model_dir):
    """Every byte predicted: the tensors from the model's shape, ``huggingface/`` (rank 0's config and
    tokenizer files) from the model folder's own files as the plan predicts it from the catalog's
    sizes (``side_files_bytes``), never from what the save wrote."""
    tiny = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    side = ck.side_files_bytes(model_files(model_dir))
    assert 0 < side < sum(f["size"] for f in model_files(model_dir).values())   # the weights are left out
    assert len(saved) == 6
    for (world, role, layout_, dtype), files in saved.items():
        written = sum(b for f, b in files.items() if "/huggingface/" in f or f.endswith("fsdp_config.json"))
        predicted = ck.role_save(tiny, role, layout_, world, 4, side)
        # config.json is written again (the critic's with its label map), the tokenizer's files as they were
        assert abs(predicted.rank0_bytes - written) <= 0.05 * written, (world, role, layout_, predicted.rank0_bytes,
                                                                         written)
        for rank in range(world):
            for kind, want in (("model", predicted.model_bytes[rank]), ("optim", predicted.optim_bytes[rank]),
                               ("extra_state", predicted.extra_bytes)):
                have = files[f"global_step_1/{role}/{kind}_world_size_{world}_rank_{rank}.pt"]
                # the tensors' bytes are exact; torch's per-entry metadata is rounded up in the
                # prediction; the extra state is a constant (RNG and scheduler states, + CUDA's on a GPU)
                slack = 2048 if kind == "extra_state" else have * 0.05
                assert have <= want <= have + slack, (world, role, layout_, dtype, kind, rank, have, want)
        total = sum(files.values())
        assert total <= predicted.total_bytes <= total * 1.05


def test_fsdp1_with_bf16_mixed_precision_saves_fp32_as_without(saved):
    assert saved[(1, "actor", "fsdp", "bf16")] == saved[(1, "actor", "fsdp", "fp32")]


def test_two_ranks_split_the_tensors(saved):
    one = saved[(1, "actor", "fsdp2", "fp32")]["global_step_1/actor/model_world_size_1_rank_0.pt"]
    two = saved[(2, "actor", "fsdp2", "fp32")]
    halves = [two[f"global_step_1/actor/model_world_size_2_rank_{r}.pt"] for r in (0, 1)]
    assert abs(sum(halves) - one) < 0.1 * one


# ---------------------------------------------------------------- the export's host RAM (pure)

def test_the_exports_host_ram_is_the_higher_of_the_merger_and_the_proof():
    """The 0.5B on one rank (FSDP1, fp32): verl's merger holds rank 0's file (the tied embedding
    twice: 2.52 GB) to the end; then the merged bf16 state dict, the empty bf16 model and its
    serialization; the proof the fp32 weights (every name) and three of the largest tensor, + the
    fp32 model where training holds the GPU."""
    s = shape()
    actor = ck.role_save(s, "actor", "fsdp", 1, 4, 0)
    ram = ck.export_host_ram(s, actor, 4)
    every = sum(ck.numel(d) for _, d in ck.tensors(s, "actor"))
    assert every == s.params("actor") + s.embed_params
    rank0 = actor.model_bytes[0]
    assert ram.merge_bytes == rank0 + max(rank0, 2 * 2 * every + 2 * s.params("actor")) + ck.PROCESS_BASE_BYTES
    assert ram.proof_model_on_gpu_bytes == 4 * every + 3 * 4 * s.embed_params + ck.PROCESS_BASE_BYTES
    assert ram.proof_model_on_cpu_bytes - ram.proof_model_on_gpu_bytes == 4 * s.params("actor")
    assert 7.0e9 < ram.merge_bytes < 7.2e9 and 7.1e9 < ram.need_bytes(False) < 7.3e9
    assert ram.need_bytes(True) == ram.merge_bytes          # the merger peaks higher once the GPU is free
    # two ranks: rank 0's file is half; every rank's files are loaded again beside it
    two = ck.export_host_ram(s, ck.role_save(s, "actor", "fsdp", 2, 4, 0), 4)
    assert two.merge_bytes < ram.merge_bytes
    big = ck.export_host_ram(shape(QWEN_15B), ck.role_save(shape(QWEN_15B), "actor", "fsdp", 1, 4, 0), 4)
    assert big.need_bytes(False) > 2.5 * ram.need_bytes(False)
    launch = ram.launch()
    assert launch["gpu_busy_mib"] == -(-ram.need_bytes(False) // 2 ** 20)
    assert launch["gpu_free_mib"] == launch["merge_mib"] <= launch["gpu_busy_mib"]


def test_the_plan_records_the_exports_host_ram_and_why():
    d = plan_for().to_dict()
    ram = d["checkpoints"]["export_host_ram"]
    assert set(ram) == {"merge_mib", "proof_model_on_gpu_mib", "proof_model_on_cpu_mib", "gpu_free_mib",
                        "gpu_busy_mib"}
    reasons = {r["setting"]: r for r in d["reasons"]}
    assert "checked against MemAvailable before it starts" in reasons["export_host_ram"]["why"]
    assert "finds its folder emptied, fails to load and restarts again" in reasons["checkpoint_keep"]["why"]


# ---------------------------------------------------------------- the planned last step (pure)

@pytest.mark.parametrize("overrides, rows, last", [
    (["trainer.total_training_steps=5", "data.train_batch_size=8", "trainer.total_epochs=1"], 7473, 5),
    (["data.train_batch_size=256", "trainer.total_epochs=2"], 7473, 29 * 2),        # drop_last: 29 whole batches
    (["data.train_batch_size=256", "data.gen_batch_size=512", "trainer.total_epochs=1"], 7473, 14),
    (["trainer.total_training_steps=100", "data.train_batch_size=256", "trainer.total_epochs=1"], 7473, 29),
    (["data.train_batch_size=256", "trainer.total_epochs=1"], None, None),           # no marker: not known
    (["trainer.total_training_steps=null", "data.train_batch_size=8", "trainer.total_epochs=1"], 80, 10),
    (["trainer.total_training_steps=3", "trainer.total_training_steps=7"], None, 7),   # the last override wins
    (["+trainer.total_training_steps=4"], None, 4),
])
def test_the_planned_last_step_is_verls(overrides, rows, last):
    assert box.planned_last_step(overrides, rows) == last


# ---------------------------------------------------------------- exports in the scan, pruned with their saves

def _step(d, step, actor=True, export=True, size=200_000):
    folder = d / f"global_step_{step}"
    folder.mkdir(parents=True)
    (folder / "data.pt").write_bytes(b"x")
    if actor:
        (folder / "actor").mkdir()
        (folder / "actor" / "model_world_size_1_rank_0.pt").write_bytes(os.urandom(100_000))
    if export:
        (folder / "hf").mkdir()
        (folder / "hf" / "model.safetensors").write_bytes(os.urandom(size))
        (folder / "hf.proof.json").write_text("{}")
        (folder / "hf.gsm8k.json").write_text("{}")
    return folder


def test_the_scan_and_the_fact_count_exports_and_whether_their_save_is_there(tmp_path):
    d = tmp_path / "checkpoints"
    _step(d, 10, actor=False)
    _step(d, 20)
    _step(d, 30, export=False)
    (d / "global_step_40").mkdir()
    (d / "global_step_40" / ".hf.partial").mkdir()                  # a maker that died
    (d / "global_step_40" / ".hf.partial" / "x").write_bytes(os.urandom(50_000))
    scanned = box.scan(str(d))
    parsed = box.parse_fact_output(subprocess.run(["sh", "-c", box.fact_command(str(d))], capture_output=True,
                                                  text=True).stdout)
    assert [(e["step"], e["save"]) for e in scanned["exports"]] == [(10, False), (20, True), (40, False)]
    assert parsed["exports"] == scanned["exports"]
    assert all(e["bytes"] >= 50_000 for e in scanned["exports"])
    assert scanned["exports"][0]["bytes"] >= 200_000 + 2 * 4096


def test_exports_of_removed_saves_count_as_free_exports_of_kept_ones_stay():
    f = found(0, [(20, SAVE)], tracker=20)
    f["exports"] = [{"step": 10, "bytes": EXPORT, "save": False}, {"step": 20, "bytes": EXPORT, "save": True}]
    need = box.disk_need(SAVE, 2, EXPORT, 10, f)
    assert need["pruned_exports_bytes"] == EXPORT and need["kept_exports_bytes"] == EXPORT
    assert need["reusable_bytes"] == SAVE + EXPORT
    assert need["need_bytes"] == margin(2 * SAVE + EXPORT) - SAVE - EXPORT
    words = box.need_words({**need, "free_bytes": 0}, "/c", keep=1)
    assert "of earlier saves and exports there count as free" in words and "exports of kept saves hold 1.0 GiB" in words


def test_exports_are_pruned_when_their_save_is_gone_and_never_under_a_lock(tmp_path):
    d = tmp_path / "checkpoints"
    gone, kept, busy = _step(d, 10, actor=False), _step(d, 20), _step(d, 30, actor=False)
    said = []
    with box.step_lock(str(busy), "an export under way", say=said.append):
        pruned = box.prune_exports(str(d), say=said.append)
    assert [p["step"] for p in pruned] == [10]
    assert sorted(p.name for p in gone.iterdir()) == [box.LOCK, "data.pt"]              # the step's own files stay
    assert {"hf", "hf.proof.json", "hf.gsm8k.json"} <= {p.name for p in kept.iterdir()}   # its save is there
    assert (busy / "hf").is_dir()                                                        # locked: left for next time
    assert "pruned the export of step 10" in said[-1] and "its save is gone" in said[-1]
    assert [p["step"] for p in box.prune_exports(str(d), say=said.append)] == [30]
    assert box.prune_exports(str(d)) == []


def test_the_step_lock_is_one_holder_at_a_time_and_dies_with_its_holder(tmp_path):
    """A second holder (another process) is refused without ``wait`` and told who holds it; with
    ``wait`` it gets the lock once the first process is killed (the kernel releases flock)."""
    import signal
    import sys
    import textwrap
    import time

    hold = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from verl_lab_box import checkpoints as box
        with box.step_lock(sys.argv[1], "export of step 2"):
            print("held", flush=True)
            time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(box.StepBusy, match=f"pid {holder.pid}: export of step 2 is under way"):
            with box.step_lock(str(tmp_path), "second", wait=False):
                pass
        said = []
        killer = subprocess.Popen(["sh", "-c", f"sleep 1; kill -9 {holder.pid}"])
        start = time.monotonic()
        with box.step_lock(str(tmp_path), "second", say=said.append):
            waited = time.monotonic() - start
            assert (tmp_path / box.LOCK).read_text() == f"pid {os.getpid()}: second\n"
        killer.wait()
        assert waited >= 0.5 and said and f"waiting until pid {holder.pid}: export of step 2 is done" in said[0]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
