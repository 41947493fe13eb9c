"""The training stage's pure parts and the files it places, run here.

The stage's train-dir files (plan.json, the static launcher verl_lab_box/train_launcher.py, the
GPU reader, train.env) are written into a temporary train dir as the stage would place them, and
the launcher is run with this machine's Python: ``--print-overrides`` against plan.json, and
``--check`` against a fake nvidia-smi and a stand-in env (a ``torch`` / ``verl`` module pair
shaped like the real ones, CPU-only: ``torch.cuda.is_available()`` is False, as on the lab boxes).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api.util import get_template

from tasks import train as train_stage
from tasks.facts.gpu import Gpu, GpuInventory
from tasks.plan import make_plan
from tasks.settings import SettingsError, load_settings
from tasks.target import decide_gpu
from tasks.train import TrainingLayout, training_wanted, training_workload

T4_SMI = "0, Tesla T4, 7.5, 15360, 15102, 535.104.05"


def settings_for(lab_root: str = "/opt/verl-lab", **data):
    return load_settings("box1", {"lab_root": lab_root, "env_prefix": f"{lab_root}/envs/verl", **data})


def t4_inventory():
    return GpuInventory(gpus=(Gpu(0, "Tesla T4", "7.5", 15360, 15102, "535.104.05"),))


def test_gpu_target_from_fact_and_override():
    s = settings_for()
    gpu = decide_gpu(s, t4_inventory())
    assert (gpu.target.name, gpu.target.count, gpu.source) == ("Tesla T4", 1, "nvidia-smi")
    none = decide_gpu(s, GpuInventory(problem="nvidia-smi is not installed (no NVIDIA driver on this box)"))
    assert none.target is None and none.source == "none"
    assert "nvidia-smi is not installed" in none.problem and "gpu_override" in none.problem
    o = settings_for(gpu_override={"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0",
                                   "memory_mib": 81920, "count": 2})
    gpu = decide_gpu(o, GpuInventory(problem="no driver"))
    assert (gpu.target.name, gpu.target.count, gpu.target.compute_capability, gpu.source) == (
        "NVIDIA A100-SXM4-80GB", 2, "8.0", "gpu_override")


@pytest.mark.parametrize("bad", [
    "Tesla T4", {"name": "Tesla T4"}, {"name": "T4", "compute_capability": "7", "memory_mib": 15360},
    {"name": "T4", "compute_capability": "7.5", "memory_mib": "15G"},
    {"name": "T4", "compute_capability": "7.5", "memory_mib": 15360, "count": 0},
    {"name": "T4", "compute_capability": "7.5", "memory_mib": 15360, "vram": 1},
])
def test_bad_gpu_override_is_refused_before_anything_runs(bad):
    with pytest.raises(SettingsError, match="gpu_override"):
        settings_for(gpu_override=bad)


def layout_for(s, inventory=None):
    gpu = decide_gpu(s, inventory or t4_inventory())
    return TrainingLayout(settings=s, plan=make_plan(gpu.target, training_workload(s)), plan_source=gpu.source)


def test_workload_paths_follow_settings():
    s = settings_for(train_steps=7)
    w = training_workload(s)
    assert w.model_path == s.model_dir and w.train_files == f"{s.data_dir}/train.parquet"
    assert w.checkpoint_dir == f"{s.train_dir}/checkpoints" and w.total_training_steps == 7


def test_digest_changes_with_the_plan():
    a = layout_for(settings_for())
    b = layout_for(settings_for(train_steps=50))
    assert a.digest() == layout_for(settings_for()).digest()
    assert a.digest() != b.digest()


@pytest.mark.parametrize("name", ["LAUNCHER", "GPU_MODULE", "UNIT_TEMPLATE", "ENV_TEMPLATE"])
def test_digest_changes_with_the_files_the_box_gets(monkeypatch, tmp_path, name):
    lay = layout_for(settings_for())
    before = lay.digest()
    changed = tmp_path / getattr(train_stage, name).name
    changed.write_bytes(getattr(train_stage, name).read_bytes() + b"\n# changed\n")
    monkeypatch.setattr(train_stage, name, changed)
    assert lay.digest() != before


@pytest.mark.parametrize("name", ["verl_lab_preflight.py", "verl_lab_after_run.py"])
def test_digest_changes_with_the_launchers_parts(monkeypatch, tmp_path, name):
    lay = layout_for(settings_for())
    before = lay.digest()
    changed = tmp_path / train_stage.LAUNCHER_PARTS[name].name
    changed.write_bytes(train_stage.LAUNCHER_PARTS[name].read_bytes() + b"\n# changed\n")
    monkeypatch.setitem(train_stage.LAUNCHER_PARTS, name, changed)
    assert lay.digest() != before


def render(template: Path, values: dict) -> str:
    return get_template(str(template)).render(**values)


def test_unit_and_env_file():
    lay = layout_for(settings_for())
    unit = render(train_stage.UNIT_TEMPLATE, lay.values())
    for line in ("User=verl", "Group=verl", "Restart=on-failure", "RestartSec=30", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "PrivateTmp=yes", "ProtectHome=yes", "StandardOutput=journal",
                 "EnvironmentFile=/opt/verl-lab/train/train.env",
                 "ExecStart=/usr/bin/python3 /opt/verl-lab/train/train-launcher",
                 "WorkingDirectory=/opt/verl-lab/train/work", "WantedBy=multi-user.target"):
        assert line in unit.splitlines(), line
    rw = next(line for line in unit.splitlines() if line.startswith("ReadWritePaths="))
    assert "/opt/verl-lab/train/checkpoints" in rw and "/opt/verl-lab/train/work" in rw
    # GPU access stays possible: nothing hides /dev/nvidia*
    for forbidden in ("PrivateDevices=", "DevicePolicy=", "MemoryDenyWriteExecute="):
        assert not any(line.startswith(forbidden) for line in unit.splitlines())
    env = dict(line.split("=", 1) for line in render(train_stage.ENV_TEMPLATE, lay.values()).splitlines()
               if line and not line.startswith("#"))
    assert env["CUDA_HOME"] == "/usr/local/cuda-11.8"
    assert env["PATH"].startswith("/opt/verl-lab/envs/verl/bin:")
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == "1"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env      # T4: vLLM rollout, sleep mode
    p40 = layout_for(settings_for(), GpuInventory(gpus=(Gpu(0, "Tesla P40", "6.1", 24576, 24400, "535.104.05"),)))
    env40 = render(train_stage.ENV_TEMPLATE, p40.values())
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in env40.splitlines()


def test_launcher_and_gpu_reader_ship_as_they_are():
    lay = layout_for(settings_for())
    placed = {w.path: w for w in training_wanted(lay)}
    launcher = placed[lay.launcher]
    assert launcher.content == train_stage.LAUNCHER.read_bytes() and launcher.mode == "750"
    assert placed[f"{lay.train_dir}/verl_lab_gpu.py"].content == train_stage.GPU_MODULE.read_bytes()
    assert placed[f"{lay.train_dir}/verl_lab_vllm_share.py"].content == train_stage.VLLM_SHARE_MODULE.read_bytes()
    assert placed[f"{lay.train_dir}/verl_lab_checkpoints.py"].content == train_stage.CHECKPOINTS_MODULE.read_bytes()
    for name, part in (("verl_lab_preflight.py", "preflight.py"), ("verl_lab_after_run.py", "after_run.py")):
        assert placed[f"{lay.train_dir}/{name}"].content == (train_stage.BOX_PACKAGE / part).read_bytes()
    assert train_stage.LAUNCHER.parent.name == train_stage.GPU_MODULE.parent.name == "verl_lab_box"
    ast.parse(launcher.content)
    assert launcher.content.startswith(b"#!/usr/bin/env python3\n")


def test_plan_json_launch_section_has_overrides_with_reasons():
    lay = layout_for(settings_for())
    plan = json.loads(lay.plan_json())
    launch = plan["launch"]
    assert [o["override"] for o in launch["overrides"]] == plan["overrides"] == lay.plan.override_lines
    assert [o["why"] for o in launch["overrides"]] == [o.why for o in lay.plan.overrides]
    assert all(o["why"] for o in launch["overrides"])
    assert launch["gpu"] == {"name": "Tesla T4", "count": 1, "memory_mib": 15360, "names": ["Tesla T4"]}
    assert launch["predicted_peak_mib"] == plan["predicted_peak_mib"]
    assert (launch["host"], launch["plan_source"]) == ("box1", "nvidia-smi")
    assert launch["paths"] == {
        "train_dir": "/opt/verl-lab/train", "work_dir": "/opt/verl-lab/train/work",
        "checkpoint_dir": "/opt/verl-lab/train/checkpoints", "env_file": "/opt/verl-lab/train/train.env",
        "env_python": "/opt/verl-lab/envs/verl/bin/python", "env_marker": "/opt/verl-lab/markers/env.done",
        "data_marker": "/opt/verl-lab/markers/data.done",
        "data_files": ["/opt/verl-lab/data/gsm8k/train.parquet", "/opt/verl-lab/data/gsm8k/val_small.parquet"],
        "model_dir": lay.settings.model_dir}


# ---------------------------------------------------------------- the launcher, run here

@pytest.fixture
def box(tmp_path):
    """A train dir for a T4 under tmp_path as the stage places it (plan.json, the launcher, the
    GPU reader, train.env), a fake nvidia-smi, a stand-in env."""
    root = tmp_path / "lab"
    s = settings_for(str(root), launcher_python=sys.executable)
    lay = layout_for(s)
    for want in training_wanted(lay):
        if not want.path.startswith(lay.train_dir):
            continue                                 # the unit, under /etc/systemd
        path = Path(want.path)
        if want.is_dir:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.write_bytes(want.content)
            path.chmod(int(want.mode, 8))
    Path(s.marker_dir).mkdir(parents=True, exist_ok=True)
    train = Path(lay.train_dir)
    assert sorted(p.name for p in train.iterdir() if p.is_file()) == [
        "plan.json", "train-launcher", "train.env", "verl_lab_after_run.py", "verl_lab_checkpoints.py",
        "verl_lab_export.py", "verl_lab_export_proof.py", "verl_lab_gpu.py", "verl_lab_lora_export.py",
        "verl_lab_preflight.py", "verl_lab_score.py", "verl_lab_vllm_share.py"]
    launcher = train / "train-launcher"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{T4_SMI}'\n")
    smi.chmod(0o755)
    return {"settings": s, "layout": lay, "launcher": launcher, "bin": bindir, "tmp": tmp_path}


def run_launcher(box, *args):
    env = {"PATH": f"{box['bin']}:/usr/bin:/bin", "HOME": str(box["tmp"])}
    return subprocess.run([sys.executable, str(box["launcher"]), *args], capture_output=True, text=True, env=env,
                          timeout=120)


def make_env(box, torch_cuda: bool):
    """A stand-in env: a python wrapper whose path has torch (CPU-only or 'CUDA') and verl modules."""
    s = box["settings"]
    site = box["tmp"] / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(
        "__version__ = '2.6.0+cu118'\n"
        "class version:\n    cuda = '11.8'\n"
        "class cuda:\n"
        f"    @staticmethod\n    def is_available():\n        return {torch_cuda}\n"
        "    @staticmethod\n    def device_count():\n        return 1\n"
        "    @staticmethod\n    def get_device_name(i):\n        return 'Tesla T4'\n"
        "    @staticmethod\n    def get_device_capability(i):\n        return (7, 5)\n")
    (site / "verl").mkdir()
    (site / "verl" / "__init__.py").write_text("__version__ = '0.5.0'\n")
    py = Path(s.env_python)
    py.parent.mkdir(parents=True)
    py.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    Path(s.marker("env")).write_text("stage=env\n")


def make_data(box):
    s = box["settings"]
    Path(s.data_dir).mkdir(parents=True)
    for name in ("train.parquet", "val_small.parquet"):
        (Path(s.data_dir) / name).write_bytes(b"PAR1")
    Path(s.marker("data")).write_text("stage=data\n")
    Path(s.model_dir).mkdir(parents=True)
    (Path(s.model_dir) / "config.json").write_text("{}")
    (Path(s.model_dir) / "model.safetensors").write_bytes(b"\0")


def test_print_overrides_matches_plan(box):
    out = run_launcher(box, "--print-overrides", "--against-plan")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == box["layout"].plan.override_lines
    plan = json.loads((Path(box["layout"].plan_file)).read_text())
    plan["overrides"] = plan["overrides"][:-1]
    Path(box["layout"].plan_file).write_text(json.dumps(plan))
    bad = run_launcher(box, "--print-overrides", "--against-plan")
    assert bad.returncode == 1 and "differ" in bad.stderr


def test_check_on_a_bare_box_reports_everything_missing(box):
    out = run_launcher(box, "--check")
    assert out.returncode == 1
    text = out.stdout
    assert "ok    gpu: 1 x Tesla T4, 15360 MiB, driver 535.104.05" in text
    assert "ok    gpu memory: 15102 MiB free" in text or "FAIL  gpu memory" in text
    assert "FAIL  cuda device: no usable CUDA device" in text   # no /dev/nvidia0 here
    assert "FAIL  env marker" in text and "FAIL  env python" in text
    assert "FAIL  data marker" in text and "FAIL  data: missing" in text
    assert "would run (in " in text and "-m verl.trainer.main_ppo" in text
    assert "verl-lab preflight FAILED on box1" in out.stderr


def test_check_with_cpu_torch_says_no_cuda_device(box):
    make_env(box, torch_cuda=False)
    make_data(box)
    out = run_launcher(box, "--check")
    assert out.returncode == 1
    assert "FAIL  torch: no usable CUDA device is visible to torch (torch 2.6.0+cu118, built for CUDA 11.8)" in out.stdout
    assert "ok    verl: verl 0.5.0" in out.stdout
    assert "ok    data:" in out.stdout and "ok    model:" in out.stdout and "ok    env marker" in out.stdout
    assert "ok    train dirs" in out.stdout
    assert "nvml:" in out.stdout


def test_gpu_mismatch_and_low_free_memory(box):
    (box["bin"] / "nvidia-smi").write_text("#!/bin/sh\necho '0, Tesla P40, 6.1, 24576, 2000, 535.104.05'\n")
    out = run_launcher(box, "--check")
    assert "FAIL  gpu: the plan is for Tesla T4, nvidia-smi lists Tesla P40" in out.stdout
    assert "FAIL  gpu memory: 2000 MiB free" in out.stdout
    (box["bin"] / "nvidia-smi").write_text(
        "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; exit 9\n")
    out = run_launcher(box, "--check")
    assert "FAIL  gpu: nvidia-smi: the NVIDIA driver is not loaded" in out.stdout


def test_mixed_box_plan_accepts_its_own_gpus_only(box):
    """plan.json of a box mixing a T4 and a P40 (planned for the P40) names both models: that box's
    nvidia-smi passes the GPU check, a box with only one of them does not."""
    plan_path = Path(box["layout"].train_dir) / "plan.json"
    plan = json.loads(plan_path.read_text())
    plan["launch"]["gpu"] = {"name": "Tesla P40", "count": 2, "memory_mib": 15360, "names": ["Tesla P40", "Tesla T4"]}
    plan_path.write_text(json.dumps(plan))
    (box["bin"] / "nvidia-smi").write_text("#!/bin/sh\necho '0, Tesla P40, 6.1, 24576, 24000, 535.104.05'\n"
                                           "echo '1, Tesla T4, 7.5, 15360, 15000, 535.104.05'\n")
    out = run_launcher(box, "--check")
    assert "ok    gpu: 2 x Tesla P40, 15360 MiB" in out.stdout
    (box["bin"] / "nvidia-smi").write_text("#!/bin/sh\necho '0, Tesla T4, 7.5, 15360, 15000, 535.104.05'\n"
                                           "echo '1, Tesla T4, 7.5, 15360, 15000, 535.104.05'\n")
    out = run_launcher(box, "--check")
    assert "FAIL  gpu: the plan is for Tesla P40, Tesla T4, nvidia-smi lists Tesla T4" in out.stdout


class Rep:
    """The preflight's report, its lines kept: (status, check, text)."""

    def __init__(self):
        self.lines = []

    def ok(self, name, text):
        self.lines.append(("ok", name, text))

    def fail(self, name, text):
        self.lines.append(("fail", name, text))

    def skip(self, name, text):
        self.lines.append(("skip", name, text))


def preflight_part():
    """verl_lab_box/preflight.py as the launcher loads it (its ``launcher`` handed in)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "launcher_mod", Path(__file__).resolve().parents[2] / "verl_lab_box" / "train_launcher.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.preflight_module()


def test_host_ram_check_fails_a_box_too_small_for_the_offloaded_states(tmp_path):
    """The CPU-offload rung keeps the model's states in host RAM: the preflight compares the plan's
    figure with /proc/meminfo's MemTotal (here a written copy)."""
    preflight = preflight_part()

    class Launch:
        predicted_host_ram_mib = 49_000

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32768000 kB\nMemFree:        1000 kB\n")
    rep = Rep()
    preflight.check_host_ram(rep, Launch(), str(meminfo))
    assert rep.lines == [("fail", "host ram", "the plan keeps 49000 MiB of model states in host RAM (CPU offload), "
                          "the box has 32000 MiB in all: train a smaller model (workload.model) or add RAM")]
    meminfo.write_text("MemTotal:       65536000 kB\n")
    rep = Rep()
    preflight.check_host_ram(rep, Launch(), str(meminfo))
    assert rep.lines[0][0] == "ok"
    rep = Rep()
    preflight.check_host_ram(rep, Launch(), str(tmp_path / "missing"))
    assert rep.lines[0][0] == "skip"


def test_plan_records_the_host_ram_its_offload_needs():
    from tasks.plan import GpuTarget, make_plan
    from tests.unit.test_plan import workload

    offload = make_plan(GpuTarget("NVIDIA GeForce GTX 1080", "6.1", 8192), workload(finetune="full")).to_dict()
    assert offload["rung"] == "grpo-cpu-offload"
    # 0.5B: fp32 params + gradients + AdamW m, v (16 bytes a parameter) and the fp32 ref (4)
    assert 9000 < offload["predicted_host_ram_mib"] < 10000
    assert make_plan(GpuTarget("Tesla P40", "6.1", 24576), workload()).to_dict()["predicted_host_ram_mib"] == 0


def test_plain_run_refuses_after_failed_preflight(box):
    out = run_launcher(box)
    assert out.returncode == 1 and "preflight FAILED" in out.stderr


def test_no_preflight_execs_main_ppo_in_work_dir(box):
    make_env(box, torch_cuda=True)
    # a stand-in verl.trainer.main_ppo that reports where and with what it was started
    site = box["tmp"] / "site"
    (site / "verl" / "trainer").mkdir()
    (site / "verl" / "trainer" / "__init__.py").write_text("")
    (site / "verl" / "trainer" / "main_ppo.py").write_text(
        "import json, os, sys\nprint(json.dumps({'cwd': os.getcwd(), 'argv': sys.argv[1:], "
        "'offline': os.environ.get('HF_HUB_OFFLINE')}))\n")
    out = run_launcher(box, "--no-preflight")
    assert out.returncode == 0, out.stderr
    got = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert got["cwd"] == box["layout"].work_dir
    assert got["argv"] == box["layout"].plan.override_lines
    assert got["offline"] == "1"        # read from train.env when run by hand


def test_missing_or_unreadable_plan_fails_the_preflight_clearly(box):
    plan_file = Path(box["layout"].plan_file)
    good = plan_file.read_text()
    plan_file.unlink()
    for args in (["--check"], []):
        out = run_launcher(box, *args)
        assert out.returncode == 1
        assert f"FAIL  plan: the plan {plan_file} cannot be read (No such file or directory)" in out.stdout
        assert "re-run deploy/train.py" in out.stdout and "preflight FAILED" in out.stderr
    out = run_launcher(box, "--print-overrides", "--against-plan")
    assert out.returncode == 1 and not out.stdout and f"the plan {plan_file} cannot be read" in out.stderr
    plan_file.write_text("{not json")
    out = run_launcher(box, "--check")
    assert out.returncode == 1 and f"FAIL  plan: the plan {plan_file} is not JSON" in out.stdout
    plan = json.loads(good)
    del plan["launch"]
    plan_file.write_text(json.dumps(plan))
    out = run_launcher(box, "--no-preflight")
    assert out.returncode == 1 and "has no launch section" in out.stderr
    broken = json.loads(good)
    del broken["launch"]["paths"]["work_dir"]
    plan_file.write_text(json.dumps(broken))
    out = run_launcher(box, "--check")
    assert out.returncode == 1 and "launch section is incomplete (KeyError: 'work_dir')" in out.stdout


def test_plan_option_reads_another_plan(box, tmp_path):
    plan_file = Path(box["layout"].plan_file)
    elsewhere = tmp_path / "other-plan.json"
    plan = json.loads(plan_file.read_text())
    plan["launch"]["overrides"].append({"override": "trainer.save_freq=-1", "why": "by hand"})
    elsewhere.write_text(json.dumps(plan))
    plan_file.unlink()
    for opt in (["--plan", str(elsewhere)], [f"--plan={elsewhere}"]):
        out = run_launcher(box, *opt, "--print-overrides")
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == [*box["layout"].plan.override_lines, "trainer.save_freq=-1"]
    out = run_launcher(box, "--print-overrides", "--against-plan", "--plan", str(elsewhere))
    assert out.returncode == 1 and "differ" in out.stderr
    assert run_launcher(box, "--check", "--plan").returncode == 2


def test_resume_check_refuses_a_save_of_the_other_finetune_and_keeps_it(tmp_path):
    """After workload.finetune changed (LoRA -> full, or back), the latest save is kept (a deploy never deletes a
    trained model) and the preflight says verl cannot resume it, with the fix (issue 44; mutation: `saved ==
    wanted` made always true: the full plan's preflight passes over a LoRA save)."""
    preflight = preflight_part()
    ckpt = tmp_path / "checkpoints"

    class Launch:
        checkpoints = {"dir": str(ckpt)}
        overrides = ["actor_rollout_ref.model.lora_rank=0"]

    def check(overrides):
        Launch.overrides = overrides
        rep = Rep()
        preflight.check_resume(rep, Launch())
        return rep.lines[0]

    assert check([]) == ("ok", "resume", f"no save in {ckpt} to resume: the run starts at step 1")
    (ckpt / "global_step_5" / "actor" / "lora_adapter").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5")
    full = check(["actor_rollout_ref.model.lora_rank=0"])
    assert full[0] == "fail" and "is a LoRA run's and this plan trains with full fine-tuning" in full[2], full
    assert f"mv {ckpt} {ckpt}.lora-step5" in full[2] and "are kept" in full[2]
    assert check(["actor_rollout_ref.model.lora_rank=32"]) == ("ok", "resume", "from step 5 (LoRA, as the plan trains)")
    (ckpt / "global_step_5" / "actor" / "lora_adapter").rmdir()
    assert check(["actor_rollout_ref.model.lora_rank=32"])[0] == "fail"
    assert check([])[0] == "ok"
