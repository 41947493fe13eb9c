"""GPUs the pinned stack cannot run are refused wherever a plan is made, with the reason
(tasks/gpu_support.py; the facts and their sources: docs/gpu-support.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tasks import gpu_support
from tasks.catalog import default_catalog
from tasks.plan import GpuTarget, PlanError, doc_workload, make_plan

REPO = gpu_support.__file__.rsplit("/tasks/", 1)[0]


def test_the_catalog_holds_torch_cu118_arch_list_and_cudas_minimum_driver():
    # PyTorch's .ci/manywheel/build_cuda.sh, CUDA 11.8: "5.0;6.0;7.0;7.5;8.0;8.6" + ";3.7;9.0", no +PTX
    assert gpu_support.torch_archs() == [(3, 7), (5, 0), (6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (9, 0)]
    assert gpu_support.min_driver() == default_catalog().artifact("cuda_runfile").get("min_driver") == "520.61.05"


@pytest.mark.parametrize("cc, refused", [
    ("2.0", "both"), ("3.0", "both"), ("3.5", "both"), ("3.7", "driver"),
    ("5.0", None), ("5.2", None), ("6.0", None), ("6.1", None), ("7.0", None), ("7.2", None), ("7.5", None),
    ("8.0", None), ("8.6", None), ("8.7", None), ("8.9", None), ("9.0", None),
    ("10.0", "kernels"), ("12.0", "kernels"),
])
def test_each_compute_capability(cc, refused):
    got = gpu_support.refusal([cc])
    if refused is None:
        assert got is None
        return
    reason, fix = got
    assert ("last driver branch" in reason) is (refused in ("driver", "both")), reason
    assert ("no PTX" in reason) is (refused in ("kernels", "both")), reason
    assert fix.startswith("train on GPUs of compute capability 5.0 to 9.x (Maxwell to Hopper)")


def test_a_k80_is_refused_by_its_driver_branch_with_the_reason():
    reason, _ = gpu_support.refusal(["3.7"])
    assert ("compute capability 3.7 (Kepler): NVIDIA's last driver branch for Kepler GPUs is R470, older than "
            "CUDA 11.8 needs (>= 520.61.05)") in reason
    assert "minor-version compatibility does not rescue it" in reason
    assert "sm_37" not in reason          # torch does ship sm_37 code: not the reason


def test_blackwell_has_no_kernels_in_torch_cu118():
    reason, _ = gpu_support.refusal(["10.0"])
    assert "ships GPU code for sm_37, sm_50, sm_60, sm_70, sm_75, sm_80, sm_86, sm_90 and no PTX" in reason
    assert "none of which runs on sm_100 (CUDA 11.8 predates it)" in reason


@pytest.mark.parametrize("gpu", [
    GpuTarget("Tesla K80", "3.7", 11441, 2),
    GpuTarget("NVIDIA B200", "10.0", 183359),
    # a mixed box is planned for its weakest GPU, but every GPU it has must run the stack
    GpuTarget("NVIDIA H100 80GB HBM3", "9.0", 81559, 2, mixed=((1, "NVIDIA H100 80GB HBM3", "9.0", 81559),
                                                                (1, "NVIDIA B200", "10.0", 183359))),
])
def test_make_plan_refuses_before_planning(gpu):
    with pytest.raises(PlanError) as err:
        make_plan(gpu, doc_workload())
    assert err.value.key == "gpu" and "cannot run this GPU" in err.value.reason and err.value.fix
    assert "Change: train on GPUs of compute capability 5.0 to 9.x" in str(err.value)


def test_the_plan_cli_refuses_a_k80():
    res = subprocess.run([sys.executable, "-m", "tasks.plan", "--gpu-name", "Tesla K80", "--compute-capability",
                          "3.7", "--gpu-memory-mib", "11441", "--gpus", "2"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("no plan: the pinned stack (torch 2.6.0+cu118, CUDA 11.8) cannot run this GPU")
    assert "R470" in res.stderr and "Traceback" not in res.stderr


def test_every_gpu_of_the_docs_table_runs_the_stack():
    from tasks.plan import doc_targets

    assert all(gpu_support.refusal(t.arch_list.split(";")) is None for _, t in doc_targets())
