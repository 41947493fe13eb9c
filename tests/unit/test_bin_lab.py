"""bin/lab, the newcomer's way in: it says what is missing instead of a traceback, prints the
plan each box got, and the inventory it writes says what rewrites it."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN_LAB = REPO / "bin" / "lab"


def load_bin_lab():
    loader = importlib.machinery.SourceFileLoader("bin_lab", str(BIN_LAB))
    spec = importlib.util.spec_from_loader("bin_lab", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_up_without_test_extras_names_them_and_the_pip_command(tmp_path):
    bare = tmp_path / "venv"        # a Python with none of the test extras (nor pip)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["VERL_LAB_DIR"] = str(tmp_path / "lab")
    res = subprocess.run([str(bare / "bin" / "python"), str(BIN_LAB), "up", "--gpus", "p40"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert "numpy" in res.stderr and "pip install -e '.[test]'" in res.stderr, res.stderr
    assert not (tmp_path / "lab").exists(), "nothing was started"


def test_stand_in_modules_are_the_test_extras():
    from tasks.catalog import tomllib
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    names = {e.split(">")[0].split("<")[0].split("=")[0].strip() for e in extras}
    assert set(load_bin_lab().STANDIN_MODULES) <= names


def test_plan_summary_reads_the_plan_the_training_stage_writes():
    from tasks.plan import GpuTarget, doc_workload, make_plan
    lab = load_bin_lab()
    p40 = {**make_plan(GpuTarget("Tesla P40", "6.1", 24576), doc_workload()).to_dict(),
           "host": "p40", "plan_source": "nvidia-smi"}
    text = lab.plan_summary("p40", p40)
    assert text.startswith("p40: 1 x Tesla P40 (compute capability 6.1, 24576 MiB")
    assert "\n  model Qwen/Qwen2.5-0.5B-Instruct, rung ppo, full fine-tuning\n" in text
    assert "train fp32, rollout hf (float32)" in text and "HF generation chunk" in text
    assert f"predicted peak {p40['predicted_peak_mib']} MiB" in text
    t4 = make_plan(GpuTarget("Tesla T4", "7.5", 15360), doc_workload()).to_dict()
    assert "rollout vllm (float16), vLLM share 0." in lab.plan_summary("t4", t4)
    assert "None" not in text


@pytest.mark.parametrize("kwargs, says", [({}, "each deploy of the lab rewrites it"),
                                          ({"rewritten_by": "`bin/lab up`"}, "`bin/lab up` rewrites it")])
def test_inventory_says_what_rewrites_it(kwargs, says):
    from tests.lab.inventory import render_inventory
    first = render_inventory([("p40", ["p40"], {"ssh_port": 2222})], **kwargs).splitlines()[0]
    assert says in first and "per deploy" not in first


def test_bin_lab_up_writes_its_inventory_as_its_own():
    assert 'rewritten_by="`bin/lab up`"' in BIN_LAB.read_text()


def test_up_with_a_bad_gpu_name_leaves_the_recorded_lab_running(tmp_path):
    """A typo in `bin/lab up` on a provisioned lab: refused before anything recorded is stopped.
    The recorded box is a real process here (a `sleep`, standing in for the box's systemd-nspawn):
    it must still run, and state.json still name it, after the refused command."""
    import json
    import time

    from tests.lab.box import alive, proc_start_time
    work = tmp_path / "lab"
    work.mkdir()
    box = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while proc_start_time(box.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        state = {"boxes": {"p40": {"pid": box.pid, "pid_start": proc_start_time(box.pid), "port": 1, "gpu": "p40"}},
                 "mirror": {}, "detached": True}
        (work / "state.json").write_text(json.dumps(state))
        env = {**os.environ, "VERL_LAB_DIR": str(work)}
        for gpus, says in (("p40,gtx1090", "unknown GPU 'gtx1090' (did you mean gtx1080?)"),
                           ("", "--gpus names no GPU")):
            res = subprocess.run([sys.executable, str(BIN_LAB), "up", "--gpus", gpus], cwd=REPO,
                                 capture_output=True, text=True, timeout=120, env=env)
            assert res.returncode == 1, res.stdout + res.stderr
            assert says in res.stderr and res.stderr.endswith("\n"), res.stderr
            assert "stopping" not in res.stdout + res.stderr, res.stdout
            assert alive(box.pid, state["boxes"]["p40"]["pid_start"]), "the recorded box was stopped"
            assert json.loads((work / "state.json").read_text()) == state
        res = subprocess.run([sys.executable, str(BIN_LAB), "up", "--gpus", "p40", "--driver", "535"], cwd=REPO,
                             capture_output=True, text=True, timeout=120, env=env)
        assert res.returncode == 1 and "--driver '535' is not a driver version" in res.stderr, res.stderr
        assert alive(box.pid, state["boxes"]["p40"]["pid_start"])
    finally:
        box.kill()
        box.wait()


def test_the_lab_has_8_gb_cards():
    from tests.lab.gpus import GPUS
    small = {k for k, g in GPUS.items() if g.memory_mib <= 8192}
    assert {"gtx1080", "rtx2070", "rtx4060"} <= small


def test_up_on_a_running_lab_refuses_unless_replace_and_down_keeps_the_boxes_settings(tmp_path):
    """`bin/lab up` on a lab that runs (a recorded box alive: a `sleep` stands in for its systemd-nspawn) refuses,
    naming it and the way to replace it, and stops nothing (issue 44; mutation: the `running and not
    args.replace` check dropped: the box is stopped). `bin/lab down` stops it and keeps group_data/, the boxes'
    settings (mutation: down without keep_group_data: the folder is gone)."""
    import json
    import time

    from tests.lab.box import alive, proc_start_time
    work = tmp_path / "lab"
    (work / "group_data").mkdir(parents=True)
    (work / "group_data" / "all.py").write_text("tracking = {'trackers': ['tensorboard']}\n")
    box = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while proc_start_time(box.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        rec = {"pid": box.pid, "pid_start": proc_start_time(box.pid), "port": 1, "gpu": "p40",
               "root": str(tmp_path / "root"), "dir": str(tmp_path / "boxdir")}
        state = {"boxes": {"p40": rec}, "mirror": {}, "detached": True}
        (work / "state.json").write_text(json.dumps(state))
        env = {**os.environ, "VERL_LAB_DIR": str(work)}
        res = subprocess.run([sys.executable, str(BIN_LAB), "up", "--gpus", "t4"], cwd=REPO,
                             capture_output=True, text=True, timeout=120, env=env)
        assert res.returncode == 1, res.stdout + res.stderr
        assert f"bin/lab: a lab is running in {work} (p40)" in res.stderr, res.stderr
        assert "bin/lab up --replace" in res.stderr and "stopping" not in res.stdout + res.stderr
        assert alive(box.pid, rec["pid_start"]) and json.loads((work / "state.json").read_text()) == state
        res = subprocess.run([sys.executable, str(BIN_LAB), "down"], cwd=REPO, capture_output=True, text=True,
                             timeout=120, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        box.wait(timeout=30)
        assert "kept" in res.stdout and (work / "group_data" / "all.py").read_text().startswith("tracking")
        assert not (work / "state.json").exists()
    finally:
        box.kill()
        box.wait()


def test_the_lab_inventory_says_where_the_boxes_settings_go():
    from tests.lab.inventory import render_inventory
    lab = load_bin_lab()
    text = render_inventory([("p40", ["p40"], {"ssh_port": 2222})], rewritten_by="`bin/lab up`",
                            settings_note=lab.SETTINGS_NOTE)
    assert "Do not edit: `bin/lab up` rewrites it." in text.splitlines()[0]
    assert "group_data/all.py beside this file" in text and "--data key=value" in text
    compile(text, "inventory.py", "exec")
