"""The burn-in's probe (verl_lab_box/burnin_probe.py as ``sitecustomize.py``) in a Python process, as verl's processes
import it: its hooks on modules shaped like verl's (a stand-in package here, the names and calls verl 0.5.0 has: the
real ones run in tests/unit/test_burnin_learning.py), the reward manager registered in the registry, a worker call's
error and a NaN metric recorded; inert without its records folder; and beside the GPU harness's own probe
(bench/gpu/probe/sitecustomize.py, which caps memory on the device): both run, both hook the workers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE_VERL = {
    "verl/__init__.py": "",
    "verl/workers/__init__.py": "",
    "verl/workers/fsdp_workers.py": """
        def register(fn):
            fn.dispatch_mode = "one_to_all"        # what verl's @register leaves on a method
            return fn

        class ActorRolloutRefWorker:
            def init_model(self):
                pass

            @register
            def generate_sequences(self, prompts):
                return prompts * 2

            def compute_log_prob(self, data):
                return data

            def compute_ref_log_prob(self, data):
                return data

            def save_checkpoint(self, path):
                pass

            @register
            def update_actor(self, data):
                raise RuntimeError("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")

        class CriticWorker:
            def init_model(self):
                pass

            def compute_values(self, data):
                return data

            def update_critic(self, data):
                return data

            def save_checkpoint(self, path):
                pass
    """,
    "verl/utils/__init__.py": "",
    "verl/utils/tracking.py": """
        class Tracking:
            def log(self, data, step, backend=None):
                return step
    """,
    "verl/workers/reward_manager/__init__.py": """
        REGISTRY = {}

        def register(name):
            def deco(cls):
                REGISTRY[name] = cls
                return cls
            return deco

        def get_reward_manager_cls(name):
            return REGISTRY[name]
    """,
}
SCRIPT = """
import json
from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker
from verl.utils.tracking import Tracking
from verl.workers.reward_manager import get_reward_manager_cls
w = ActorRolloutRefWorker()
out = {"generated": w.generate_sequences(21), "kept_dispatch": getattr(w.generate_sequences, "dispatch_mode", None)}
try:
    w.update_actor(None)
except RuntimeError:
    out["raised"] = True
Tracking().log({"actor/pg_loss": float("nan"), "critic/score/mean": 0.5, "note": "text"}, 3)
try:
    out["manager"] = get_reward_manager_cls("verl_lab_burnin").__name__
except KeyError:
    out["manager"] = None
print(json.dumps(out))
"""


@pytest.fixture
def tree(tmp_path):
    for name, text in FAKE_VERL.items():
        path = tmp_path / "site" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    probe = tmp_path / "burnin-probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_bytes((REPO / "verl_lab_box" / "burnin_probe.py").read_bytes())
    (probe / "verl_lab_burnin_reward.py").write_bytes((REPO / "verl_lab_box" / "burnin_reward.py").read_bytes())
    return tmp_path


def run(tree: Path, *paths: Path, python=sys.executable, **env) -> dict:
    res = subprocess.run([str(python), "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": ":".join(map(str, [*paths, tree / "site"])), "PATH": "/usr/bin:/bin", **env})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def lines(folder: Path, prefix: str) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob(f"{prefix}-*.jsonl")) for line in f.read_text().splitlines()]


def test_it_records_the_workers_calls_the_metrics_and_registers_the_reward(tree):
    records = tree / "records"
    out = run(tree, tree / "burnin-probe", VERL_LAB_BURNIN_RECORDS=str(records))
    assert out == {"generated": 42, "kept_dispatch": "one_to_all", "raised": True, "manager": "BurninReward"}
    phases = {p["phase"]: p for p in lines(records, "phases")}
    assert set(phases) == {"generate_sequences", "update_actor"}           # compute_values was not called
    assert "OutOfMemoryError" in phases["update_actor"]["error"] and "error" not in phases["generate_sequences"]
    (metrics,) = lines(records, "metrics")
    assert metrics["step"] == 3 and metrics["data"] == {"actor/pg_loss": "nan", "critic/score/mean": 0.5, "note": None}


def test_without_its_records_folder_it_is_inert(tree):
    out = run(tree, tree / "burnin-probe")
    assert out["manager"] is None and out["generated"] == 42


def test_beside_the_gpu_harnesss_probe_both_run(tree, verl_python):
    records, harness = tree / "records", tree / "harness"       # the harness's probe imports torch: the test env's
    out = run(tree, tree / "burnin-probe", REPO / "bench" / "gpu" / "probe", python=verl_python,
              VERL_LAB_BURNIN_RECORDS=str(records), VERL_LAB_PROBE_DIR=str(harness))
    assert out["manager"] == "BurninReward" and out["raised"]
    assert {p["phase"] for p in lines(records, "phases")} == {"generate_sequences", "update_actor"}
    harness_phases = [r for r in lines(harness, "probe") if r.get("event") == "phase"]
    assert {r["phase"] for r in harness_phases} >= {"generate_sequences", "update_actor"}, lines(harness, "probe")
