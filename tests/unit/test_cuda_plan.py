"""The CUDA stage's pure planning: pre-checks, the install/adopt/done decision, and the commands."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from tasks import cuda
from tasks.cuda import CudaFacts, cuda_want, plan_cuda, runfile_command, script_values
from tasks.settings import load_settings
from tasks.target import decide_compiler

BOOKWORM = {"ID": "debian", "VERSION_ID": "12", "PRETTY_NAME": "Debian GNU/Linux 12 (bookworm)"}
JAMMY = {"ID": "ubuntu", "VERSION_ID": "22.04", "PRETTY_NAME": "Ubuntu 22.04.4 LTS"}
ROOMY = {"filesystem": "/dev/vda", "mount": "/", "free_mib": 80000, "size_mib": 250000}
P40 = {"version": "535.104.05", "source": "nvidia-smi", "error": None,
       "gpus": [{"driver": "535.104.05", "name": "Tesla P40", "compute_cap": "6.1"}]}
GCC12 = {"gcc": "12.2.0", "gcc-11": None, "g++-11": None}
GCC12_WITH_11 = {"gcc": "12.2.0", "gcc-11": "/usr/bin/gcc-11", "g++-11": "/usr/bin/g++-11"}
DONE_TOOLKIT = {"nvcc": {"release": "11.8", "version": "11.8.89"}, "cudnn": "8.9.7", "in_progress": False}


def settings(**data):
    return load_settings("box1", data)


def want(**data):
    return cuda_want(settings(**data))


def facts(**changes) -> CudaFacts:
    w = want()
    base = CudaFacts(
        os_release=BOOKWORM, driver=P40, toolkits={"link": None, "toolkits": {}},
        disk={w.tmpdir: ROOMY, w.prefix: ROOMY, w.box_cache: ROOMY},
        compiler=decide_compiler(BOOKWORM, GCC12_WITH_11), marker=None,
    )
    return dataclasses.replace(base, **changes)


def done_marker(w):
    return {"prefix": w.prefix, "cuda_version": "11.8.0", "cudnn_version": "8.9.7.29"}


# ---------------------------------------------------------------- pre-checks


def test_fresh_box_installs_and_fetches_both():
    plan = plan_cuda(want(), facts())
    assert plan.action == "install" and plan.fetch == ("cuda_runfile", "cudnn_archive")
    assert not plan.problems and not plan.wipe_partial


@pytest.mark.parametrize("release", [
    {"ID": "debian", "VERSION_ID": "11"}, {"ID": "ubuntu", "VERSION_ID": "20.04"},
    {"ID": "ubuntu", "VERSION_ID": "24.04"}, JAMMY, BOOKWORM,
])
def test_supported_distros(release):
    assert cuda.check_distro(release) is None


@pytest.mark.parametrize("release", [
    {"ID": "debian", "VERSION_ID": "10"}, {"ID": "ubuntu", "VERSION_ID": "18.04"},
    {"ID": "rocky", "VERSION_ID": "9.3", "PRETTY_NAME": "Rocky Linux 9.3 (Blue Onyx)"},
    {"ID": "debian", "PRETTY_NAME": "Debian GNU/Linux trixie/sid"}, {},
])
def test_unsupported_distro_refused(release):
    plan = plan_cuda(want(), facts(os_release=release))
    assert plan.action == "refuse"
    assert "unsupported distribution" in plan.problems[0] and "Ubuntu 22.04" in plan.problems[0]


def test_too_old_driver_names_driver_need_and_fix():
    old = {"version": "470.82.01", "source": "proc", "gpus": [], "error": None}
    plan = plan_cuda(want(), facts(driver=old))
    assert plan.action == "refuse"
    msg = plan.problems[0]
    assert "470.82.01" in msg and "520.61.05" in msg and "11.8" in msg
    assert "branch 520 or newer" in msg and "580" in msg and "driver = 'install'" in msg


def test_too_old_driver_on_pascal_says_which_branch():
    old = {"version": "515.65.01", "source": "nvidia-smi", "error": None,
           "gpus": [{"driver": "515.65.01", "name": "Tesla P40", "compute_cap": "6.1"}]}
    msg = plan_cuda(want(), facts(driver=old)).problems[0]
    assert "Tesla P40 (compute capability 6.1)" in msg and "535 .. 580" in msg


def test_exact_minimum_driver_is_fine():
    ok = {"version": "520.61.05", "source": "nvidia-smi", "gpus": [], "error": None}
    assert plan_cuda(want(), facts(driver=ok)).action == "install"


def test_pascal_on_a_driver_branch_that_dropped_it():
    new = {"version": "590.10.01", "source": "nvidia-smi", "error": None,
           "gpus": [{"driver": "590.10.01", "name": "Tesla V100-SXM2-32GB", "compute_cap": "7.0"}]}
    msg = plan_cuda(want(), facts(driver=new)).problems[0]
    assert "branch 590" in msg and "580 or older" in msg


def test_no_driver_refused_with_the_setting_named():
    plan = plan_cuda(want(), facts(driver=None))
    assert plan.action == "refuse"
    assert "no NVIDIA driver found" in plan.problems[0] and "allow_no_driver=True" in plan.problems[0]


def test_no_driver_allowed_on_a_build_box():
    plan = plan_cuda(want(allow_no_driver=True), facts(driver=None))
    assert plan.action == "install"


def test_smi_without_driver():
    broken = {"version": None, "source": "nvidia-smi", "gpus": [], "error": "NVIDIA-SMI has failed"}
    assert "reports no driver" in plan_cuda(want(), facts(driver=broken)).problems[0]
    assert plan_cuda(want(allow_no_driver=True), facts(driver=broken)).action == "install"


def test_disk_summed_on_a_shared_filesystem():
    w = want()
    tight = {**ROOMY, "free_mib": cuda.TMPDIR_NEED_MIB + cuda.PREFIX_NEED_MIB}  # no room for the cache
    plan = plan_cuda(w, facts(disk={w.tmpdir: tight, w.prefix: tight, w.box_cache: tight}))
    assert plan.action == "refuse"
    msg = plan.problems[0]
    assert "not enough free disk on /" in msg and "18432 MiB free" in msg
    assert f"{w.tmpdir}: 10240 MiB" in msg and f"{w.prefix}: 8192 MiB" in msg and w.box_cache in msg


def test_disk_separate_filesystems_each_checked():
    w = want()
    tmp = {"filesystem": "tmpfs", "mount": "/var/tmp", "free_mib": 4000, "size_mib": 8000}
    plan = plan_cuda(w, facts(disk={w.tmpdir: tmp, w.prefix: ROOMY, w.box_cache: ROOMY}))
    assert "on /var/tmp (tmpfs): 4000 MiB free, 10240 MiB needed" in plan.problems[0]


def test_disk_not_counting_artifacts_already_cached():
    w = want()
    exact = {**ROOMY, "free_mib": cuda.TMPDIR_NEED_MIB + cuda.PREFIX_NEED_MIB}
    plan = plan_cuda(w, facts(disk={w.tmpdir: exact, w.prefix: exact, w.box_cache: exact},
                              cached=frozenset({"cuda_runfile", "cudnn_archive"})))
    assert plan.action == "install"


def test_disk_unmeasured():
    w = want()
    plan = plan_cuda(w, facts(disk={w.tmpdir: None, w.prefix: ROOMY, w.box_cache: ROOMY}))
    assert "could not measure free disk" in plan.problems[0]


def test_system_prefix_refused():
    plan = plan_cuda(want(cuda_prefix="/usr/local"), facts())
    assert "system folder" in plan.problems[0]


def test_all_problems_reported_together():
    plan = plan_cuda(want(), facts(driver=None, os_release={"ID": "arch"}))
    assert len(plan.problems) == 2


# ---------------------------------------------------------------- decision


def test_done_when_marker_and_proofs_agree():
    w = want()
    plan = plan_cuda(w, facts(toolkits={"link": None, "toolkits": {w.prefix: DONE_TOOLKIT}}, marker=done_marker(w)))
    assert plan.action == "done" and plan.fetch == ()


def test_done_skips_disk_check():
    w = want()
    full = {**ROOMY, "free_mib": 10}
    plan = plan_cuda(w, facts(toolkits={"link": None, "toolkits": {w.prefix: DONE_TOOLKIT}},
                              marker=done_marker(w), disk={w.tmpdir: full, w.prefix: full, w.box_cache: full}))
    assert plan.action == "done"


def test_marker_without_the_toolkit_reinstalls():
    w = want()
    assert plan_cuda(w, facts(marker=done_marker(w))).action == "install"


def test_marker_for_another_prefix_or_version_is_not_done():
    w = want()
    tk = {"link": None, "toolkits": {w.prefix: DONE_TOOLKIT}}
    assert plan_cuda(w, facts(toolkits=tk, marker={**done_marker(w), "prefix": "/opt/cuda"})).action == "adopt"
    assert plan_cuda(w, facts(toolkits=tk, marker={**done_marker(w), "cudnn_version": "8.6.0.163"})).action == "adopt"


def test_interrupted_install_is_redone_not_reported_done():
    w = want()
    partial = {**DONE_TOOLKIT, "in_progress": True}  # nvcc works, cuDNN there: still not done
    plan = plan_cuda(w, facts(toolkits={"link": None, "toolkits": {w.prefix: partial}}, marker=done_marker(w)))
    assert plan.action == "install" and plan.wipe_partial and "interrupted" in plan.reason


def test_toolkit_without_cudnn_installs_over():
    w = want()
    tk = {**DONE_TOOLKIT, "cudnn": None}
    plan = plan_cuda(w, facts(toolkits={"link": None, "toolkits": {w.prefix: tk}}))
    assert plan.action == "install" and not plan.wipe_partial


def test_other_cuda_at_the_prefix_refused():
    w = want()
    tk = {"nvcc": {"release": "12.4", "version": "12.4.131"}, "cudnn": None, "in_progress": False}
    plan = plan_cuda(w, facts(toolkits={"link": "/usr/local/cuda-12.4", "toolkits": {w.prefix: tk}}))
    assert plan.action == "refuse" and "already holds CUDA 12.4" in plan.problems[0]


def test_other_toolkits_do_not_matter():
    w = want()
    other = {"nvcc": {"release": "12.4", "version": "12.4.131"}, "cudnn": None, "in_progress": False}
    tk = {"link": "/usr/local/cuda-12.4", "toolkits": {"/usr/local/cuda-12.4": other}}
    assert plan_cuda(w, facts(toolkits=tk)).action == "install"


# ---------------------------------------------------------------- host compiler


def test_nvcc_gets_the_host_targets_compiler():
    """The compiler is decided once for the host (tests/unit/test_target.py); the plan passes it on."""
    plan = plan_cuda(want(), facts(compiler=decide_compiler(BOOKWORM, GCC12)))
    assert plan.host_cc == "/usr/bin/gcc-11" and plan.host_cxx == "/usr/bin/g++-11"
    jammy = decide_compiler(JAMMY, {"gcc": "11.4.0", "gcc-11": None, "g++-11": None})
    assert plan_cuda(want(), facts(os_release=JAMMY, compiler=jammy)).host_cc == "gcc"


# ---------------------------------------------------------------- commands


def test_runfile_command_is_the_documented_one():
    w = want()
    assert runfile_command(w) == [
        "sh", "/opt/verl-lab/cache/cuda_runfile/cuda_11.8.0_520.61.05_linux.run", "--silent", "--toolkit",
        "--installpath=/usr/local/cuda-11.8", "--no-opengl-libs", "--no-man-page", "--no-drm", "--override",
        "--tmpdir=/var/tmp/verl-lab/cuda-11.8.0/runfile",
    ]


def test_prefix_and_tmpdir_follow_settings():
    w = want(cuda_prefix="/opt/cuda-11.8", install_tmpdir="/scratch/tmp")
    cmd = runfile_command(w)
    assert "--installpath=/opt/cuda-11.8" in cmd and "--tmpdir=/scratch/tmp/cuda-11.8.0/runfile" in cmd


@pytest.mark.parametrize("profile,host", [("global", "developer.download.nvidia.com"),
                                          ("cn", "developer.download.nvidia.cn")])
def test_artifact_urls_per_mirror_profile(profile, host):
    s = settings(mirror_profile=profile)
    assert s.url("cuda_runfile") == f"https://{host}/compute/cuda/11.8.0/local_installers/cuda_11.8.0_520.61.05_linux.run"
    assert s.url("cudnn_archive").startswith(f"https://{host}/compute/cudnn/redist/cudnn/linux-x86_64/")


def test_script_values_quote_and_clean_up():
    w = want()
    plan = plan_cuda(w, facts())
    values = script_values(w, plan)
    assert values["q"]["mode"] == "install"
    assert shlex.split(values["runfile_command"]) == runfile_command(w)
    assert values["q"]["remove_after"] == [w.runfile_path, w.runfile_path + ".sha256",
                                           w.cudnn_path, w.cudnn_path + ".sha256"]
    assert values["cudnn_top"] == "cudnn-linux-x86_64-8.9.7.29_cuda11-archive"
    assert values["q"]["installer_log"] == "/tmp/cuda-installer.log"
    adopt = dataclasses.replace(plan, action="adopt", fetch=())
    assert script_values(w, adopt)["q"]["remove_after"] == []


def test_refusal_text_names_the_host_and_every_problem():
    text = cuda.refusal_text("box2", ("driver too old", "disk full"))
    assert text.splitlines() == ["verl-lab cuda: box2: nothing was changed by the CUDA stage:",
                                 "  - driver too old", "  - disk full"]
