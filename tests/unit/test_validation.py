"""The checks before any box changes (tasks/validation.py): the training plan of every host whose
GPU host data gives, the data stage's plan of every host, all problems of all hosts at once; the
plan a box's own GPU gets at its first fact pass (plan_problem)."""

from __future__ import annotations

import pytest

from tasks import hostdata
from tasks.plan import GpuTarget
from tasks.settings import check_clusters, load_settings
from tasks.validation import inventory_problems, plan_problem, training_plan

T4_8GB = {"name": "Tesla T4", "compute_capability": "7.5", "memory_mib": 8192, "count": 1}
TINY = {"name": "NVIDIA T400 4GB", "compute_capability": "7.5", "memory_mib": 4096, "count": 1}
K80 = {"name": "Tesla K80", "compute_capability": "3.7", "memory_mib": 11441, "count": 2}
A100 = {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "memory_mib": 81920, "count": 1}


def problems_of(data: dict) -> list:
    settings = {host: load_settings(host, d) for host, d in data.items()}
    clusters, _ = check_clusters(settings)
    return inventory_problems(settings, clusters)


def test_a_model_the_override_cannot_train_is_refused_naming_what_fits():
    (p,) = problems_of({"box3b": {"gpu_override": T4_8GB, "workload": {"model": "Qwen/Qwen2.5-3B-Instruct"}}})
    assert (p.host, p.key) == ("box3b", "workload")
    assert p.problem.startswith("1 x Tesla T4 (compute capability 7.5, 8192 MiB, from gpu_override): "
                                "qwen2.5-3b-gsm8k (GRPO) does not fit 1 x Tesla T4 (8192 MiB)")
    assert "Models of the catalog that fit, largest first: " in p.fix and "set workload.model" in p.fix
    assert str(p).startswith("host box3b: workload: 1 x Tesla T4") and ". Fix: use a GPU with more memory" in str(p)


def test_a_small_override_is_refused_with_the_shortfall():
    (p,) = problems_of({"tiny": {"gpu_override": TINY}})
    assert p.key == "workload" and "short by" in p.problem and "No model of the catalog fits" in p.fix


def test_an_unsupported_gpu_override_is_refused_under_its_key():
    (p,) = problems_of({"kepler": {"gpu_override": K80}})
    assert (p.host, p.key) == ("kepler", "gpu_override")
    assert "2 x Tesla K80 (compute capability 3.7" in p.problem and "R470" in p.problem
    assert p.fix.startswith("train on GPUs of compute capability 5.0 to 9.x")


def test_hosts_whose_gpu_only_the_box_knows_wait_for_their_fact_pass():
    assert problems_of({"box1": {}, "a100": {"gpu_override": A100}}) == []


def test_the_data_stage_plan_is_checked_for_every_host():
    bad = {"gsm8k": {"files": {"main/x.parquet": {"size": 1, "sha256": "0" * 64}}}}
    (p,) = problems_of({"box1": {"catalog_overrides": bad}})
    assert (p.host, p.key) == ("box1", "catalog_overrides.gsm8k.files") and "train split" in p.problem


def test_a_cluster_is_planned_by_every_member_only_where_host_data_gives_each_gpu():
    lab1 = {"name": "lab1", "head": "h"}
    both = {"h": {"cluster": lab1, "cluster_address": "10.0.0.5", "gpu_override": A100},
            "w": {"cluster": lab1, "gpu_override": K80}}
    found = problems_of(both)
    assert sorted(p.host for p in found) == ["h", "w"], found
    assert all(p.problem.startswith("its cluster's GPUs (h: 1 x NVIDIA A100-SXM4-80GB (compute capability 8.0, "
                                    "81920 MiB); w: 2 x Tesla K80") and "R470" in p.problem for p in found), found
    # a member whose GPU only its box knows: the cluster is planned at the fact pass, not here
    assert problems_of({**both, "w": {"cluster": lab1}}) == []


def test_plan_problem_at_the_fact_pass():
    s = load_settings("box1", {"workload": {"model": "Qwen/Qwen2.5-3B-Instruct"}})
    p = plan_problem(s, GpuTarget("Tesla T4", "7.5", 8192), "nvidia-smi")
    assert p.key == "workload" and "from nvidia-smi" in p.problem
    none = plan_problem(s, None, "none", "no usable NVIDIA GPU: nvidia-smi is not installed")
    assert none.key == "GPU (nvidia-smi)" and none.problem.startswith("no usable NVIDIA GPU") and "gpu_override" in none.fix
    assert plan_problem(load_settings("b", {}), GpuTarget("NVIDIA H200", "9.0", 143771), "nvidia-smi") is None
    k80 = plan_problem(s, GpuTarget("Tesla K80", "3.7", 11441, 2), "nvidia-smi")
    assert k80.key == "GPU (nvidia-smi)" and "R470" in k80.problem
    missing = plan_problem(s, GpuTarget("NVIDIA H200", "9.0", 143771), "nvidia-smi",
                           cluster_targets={"box1": GpuTarget("NVIDIA H200", "9.0", 143771), "box2": None})
    assert missing.key == "cluster" and "no GPU target on box2" in missing.problem


def test_the_plan_checked_is_the_plan_placed():
    s = load_settings("b", {})
    gpu = GpuTarget("Tesla P40", "6.1", 24576)
    assert training_plan(s, gpu).to_dict() == training_plan(s, gpu).to_dict()
    assert training_plan(s, gpu).override_lines[0].startswith("data.train_files=/opt/verl-lab/data/gsm8k/")


def test_the_inventory_check_lists_settings_and_plan_problems_of_every_host_at_once(monkeypatch):
    from pyinfra.api import Inventory

    for name, value in (("_CHECKED", False), ("_CACHE", {}), ("_CLUSTERS", {})):
        monkeypatch.setattr(hostdata, name, value)
    inv = Inventory(([("box3b", {"gpu_override": T4_8GB, "workload": {"model": "Qwen/Qwen2.5-3B-Instruct"}}),
                      ("kepler", {"gpu_override": K80}),
                      ("typos", {"train_steps": 0, "artifact_mode": "torrent"}),
                      ("fine", {})], {}))
    with pytest.raises(hostdata.InventoryError) as exc:
        hostdata.check_inventory(list(inv))
    lines = str(exc.value).splitlines()
    assert lines[0] == "verl-lab: the inventory has errors; nothing was changed on any host:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["host typos", "host typos", "host box3b",
                                                                  "host kepler"], lines
    assert not any("fine" in line for line in lines)


# ------------------------------------------------------------------ the run's checks (tasks/base.py check_run)

def _gpu(name, cc, mib, driver="535.104.05", count=1):
    from tasks.facts.gpu import Gpu, GpuInventory
    return GpuInventory(gpus=tuple(Gpu(index=i, name=name, compute_capability=cc, memory_total_mib=mib,
                                       memory_free_mib=mib - 300, driver_version=driver) for i in range(count)))


LAB_RAM = {"total_mib": 24105, "available_mib": 22926}     # this machine's /proc/meminfo, as the lab's boxes read it


def _answers(inventory, free_mib=100_000, memory=LAB_RAM):
    disk = {"mount": "/", "free_mib": free_mib}
    return [inventory, None, None, disk, {"free": {"path": "/opt/verl-lab", "free_bytes": free_mib * 2**20}, "tracker": None, "saves": []},
            memory]


def test_box_problems_every_problem_of_every_box_at_once():
    from tasks.base import box_problems
    settings = {"p40": load_settings("p40", {"workload": {"rollout": "vllm", "train_batch_size": 10000}}),
                "k80": load_settings("k80", {}), "t4": load_settings("t4", {})}
    answers = {"p40": _answers(_gpu("Tesla P40", "6.1", 24576)),
               "k80": _answers(_gpu("Tesla K80", "3.7", 11441, driver="470.256.02", count=2)),
               "t4": _answers(_gpu("Tesla T4", "7.5", 15360), free_mib=100)}
    found = [(p.host, p.key) for p in box_problems(settings, answers)]
    assert found == [("p40", "workload.rollout"), ("p40", "workload.train_batch_size"),
                     ("k80", "driver (nvidia-smi)"), ("k80", "GPU (nvidia-smi)"), ("t4", "disk (model and data)"),
                     ("t4", "disk (checkpoints)")], found
    texts = {(p.host, p.key): str(p) for p in box_problems(settings, answers)}
    assert "NVIDIA driver 470.256.02 is too old for CUDA 11.8" in texts[("k80", "driver (nvidia-smi)")]
    assert "not enough free disk" in texts[("t4", "disk (model and data)")]


def test_the_3b_on_a_gtx_1080_is_refused_for_host_ram_with_lora_on_a_smaller_model_as_the_fix():
    """The plan is CPU offload (~1055 s a step by the speed model); its offloaded states need 57.5 GiB and the
    export 30.9 GiB of host RAM, on a 23.5 GiB box. LoRA on the 3B does not fit 8 GiB; the 0.5B with LoRA does."""
    from tasks.base import BoxWarning, box_problems
    settings = {"gtx": load_settings("gtx", {"workload": {"model": "Qwen/Qwen2.5-3B-Instruct"}})}
    found = box_problems(settings, {"gtx": _answers(_gpu("NVIDIA GeForce GTX 1080", "6.1", 8192))})
    assert [(p.host, p.key) for p in found] == [("gtx", "run")], found
    text = str(found[0])
    assert "training's host memory (model states offloaded to the CPU or asleep, 58860 MiB) needs 57.5 GiB, " \
           "the box has 23.5 GiB in all (MemTotal)" in text, text
    assert "the export after the run (verl's model merger, then the proof) needs 30.9 GiB" in text, text
    assert "Fix: LoRA on this model does not fit the GPU (short by" in text, text
    assert "a smaller model: workload.model = 'Qwen/Qwen2.5-0.5B-Instruct' (grpo-lora, LoRA rank 32, ~" in text, text
    assert "or a box with 57.5 GiB of RAM or more" in text, text
    assert not any(isinstance(p, BoxWarning) for p in found)


def test_a_run_longer_than_the_bound_is_refused_and_ram_held_by_others_is_a_warning():
    from tasks.base import BoxWarning, box_problems
    settings = {"t4": load_settings("t4", {"workload": {"epochs": 200}, "max_run_days": 1}),
                "p40": load_settings("p40", {})}
    found = box_problems(settings, {"t4": _answers(_gpu("Tesla T4", "7.5", 15360)),
                                    "p40": _answers(_gpu("Tesla P40", "6.1", 24576),
                                                    memory={"total_mib": 24105, "available_mib": 1000})})
    run = [str(p) for p in found if p.key == "run"]
    assert len(run) == 1 and run[0].startswith("host t4: run: the speed model puts a step at "), run
    assert "days, over max_run_days = 1. Fix: " in run[0] and "a shorter run (train_steps, workload.epochs) or a " \
           "longer bound (max_run_days)" in run[0], run
    warned = [p for p in found if isinstance(p, BoxWarning)]
    assert [(p.host, p.key) for p in warned] == [("p40", "host RAM")], found
    assert "the box has 1.0 GiB available now (MemAvailable; 23.5 GiB in all)" in str(warned[0])


def test_a_boxs_problem_refuses_that_box_and_its_cluster_the_others_go_on():
    from tasks.base import BoxProblem, refused_hosts
    run = ["t4", "p40", "head", "wk1", "solo"]
    clusters = {"t4": None, "p40": None, "head": "lab1", "wk1": "lab1", "solo": None, "away": "lab1"}
    told = [BoxProblem("p40", "workload.rollout", "no vLLM below 7.0"), BoxProblem("p40", "disk (checkpoints)", "x"),
            BoxProblem("wk1", "driver (nvidia-smi)", "too old")]
    refused = refused_hosts(told, run, clusters, inventory=False)
    assert sorted(refused) == ["head", "p40", "wk1"], refused         # t4 and solo go on
    assert refused["p40"].startswith("its 2 problems above (workload.rollout, disk (checkpoints)); nothing on this")
    assert refused["head"].startswith("its Ray cluster 'lab1' trains only when every member can, and wk1 cannot")
    assert "away" not in refused, "a host outside the run (--limit) is not this run's to refuse"
    # an inventory value's problem: the file is wrong, every host of the run is refused (nothing runs anywhere)
    assert sorted(refused_hosts(told[:1], run, clusters, inventory=True)) == sorted(run)
    assert refused_hosts([], run, clusters, inventory=False) == {}


def test_box_problems_none_for_boxes_that_can_train_and_a_box_that_did_not_answer():
    from tasks.base import box_problems
    settings = {"t4": load_settings("t4", {}), "gone": load_settings("gone", {})}
    found = box_problems(settings, {"t4": _answers(_gpu("Tesla T4", "7.5", 15360)), "gone": OSError("no route")})
    assert [(p.host, p.key) for p in found] == [("gone", "facts")]


def test_a_misspelt_key_does_not_hide_the_plan():
    s, problems = hostdata.checked_settings("b", {"mirror_profle": "cn", "gpu_override": K80,
                                                  "workload": {"epoks": 2}})
    assert [p.key for p in problems] == ["mirror_profle", "workload.epoks"]
    assert s is not None and s.gpu_override["name"] == "Tesla K80"
    s, problems = hostdata.checked_settings("b", {"hf_token_file": "/nonexistent", "gpu_override": K80})
    assert s is not None and [p.key for p in problems] == ["hf_token_file"]
    s, problems = hostdata.checked_settings("b", {"workload": {"epochs": 0}, "gpu_override": K80})
    assert s is None, "a bad value the plan reads: the plan is checked once it is fixed"


def test_values_get_did_you_mean_like_keys():
    from tasks.settings import SettingsError
    for data, says in (({"driver": "instal"}, "did you mean 'install'?"),
                       ({"workload": {"rollout": "vlm"}}, "did you mean 'vllm'?"),
                       ({"train_unit_state": "stoped"}, "did you mean 'stopped'?")):
        with pytest.raises(SettingsError) as exc:
            load_settings("b", data)
        assert says in str(exc.value), exc.value
    with pytest.raises(SettingsError) as exc:
        load_settings("b", {"driver": "xyz"})
    assert "did you mean" not in str(exc.value)


def test_the_inventory_pass_reports_only_the_hosts_of_the_run(monkeypatch):
    from pyinfra.api import Inventory
    for name, value in (("_CHECKED", False), ("_CACHE", {}), ("_CLUSTERS", {}), ("_PROBLEMS", []), ("_IN_RUN", [])):
        monkeypatch.setattr(hostdata, name, value)
    inv = Inventory(([("a", {"driver": "instal"}), ("b", {"train_steps": 0})], {}))
    found = hostdata.check_inventory([inv.get_host("b")], stop=False, everyone=list(inv))
    assert [(p.host, p.key) for p in found] == [("b", "train_steps")]


def test_what_a_box_told_of_the_endpoint_in_direct_mode():
    from tasks.facts.endpoint import served_problem
    args = ("model repo 'Q/M' at revision abc", "catalog_overrides.qwen_model", "http://hf.example")
    assert served_problem({"status": 200, "json": True}, *args) is None
    assert served_problem({"skipped": True}, *args) is None, "already on the box: the endpoint was not asked"
    assert served_problem({"status": 401, "code": "RepoNotFound"}, *args) is None, "no token on the box: not judged"
    assert "has no such revision. Fix: pin an existing commit in catalog_overrides.qwen_model.revision" in \
        served_problem({"status": 404, "code": "RevisionNotFound"}, *args)
    assert "has no such repo (HTTP 404, RepoNotFound)" in served_problem({"status": 404, "code": "RepoNotFound"}, *args)
    assert "the box cannot reach the HF endpoint http://hf.example (URLError" in \
        served_problem({"error": "URLError: refused"}, *args)
    assert "did not answer the Hub API" in served_problem({"status": 200, "json": False}, *args)
