"""The Python-env stage on a lab-in-a-box host, a P40 box (venv backend; conda cannot be fetched
here and is tested at the command level in tests/unit/test_env.py).

Stand-ins (tests/fixtures/standins/env.py): the CPU torch 2.13.0 from /opt/wheels under a
test catalog profile (torch.cuda = "none"), an Apex-shaped source tree, the real verl 0.5.0
sdist as a git repo, the vLLM 0.8.5 cu118 wheel and the cu118 index's xformers 0.0.29.post2, all
served by the lab mirror; verl's pinned deps (and the pinned pip) come from the real PyPI once
into the controller's cache and are served to the boxes as the `pypi` source.

converge -> proofs (the ones the build ran and recorded in its generation; a P40: no vLLM, no xformers, each
with its reason) -> idempotence -> a rebuild made to fail leaves the env as it was (the next plain deploy puts
the plan's build files back, building nothing) -> uninstall one of verl's needs (codetiming): a plain deploy's
quick re-check finds it, says why and rebuilds, the old generation kept as .prev. The box is the shared
``env_lab`` (tests/e2e/conftest.py), which drill 5 of tests/e2e/test_drills.py uses after this module: it breaks
the env four ways (torch uninstalled among them) and deploy/rebuild.py restores it, the old generation kept as
.prev and on disk, its summary line per host, then idempotence. A box that gets vLLM and the cu118 xformers (a
T4) is the converged fleet's: tests/e2e/test_foundation.py reads its env with this module's ``marker`` and
``built_proof`` (the same env stand-ins, built by deploy/full.py's env stage).
"""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.shared_labs import ENV_BOX
from tests.fixtures.standins import env as standin

LAB_ROOT = "/opt/verl-lab"
ENV = f"{LAB_ROOT}/envs/verl"
PY = f"{ENV}/bin/python"
MARKER = f"{LAB_ROOT}/markers/env.done"
VERL_SRC = f"{LAB_ROOT}/src/verl"
BOX = ENV_BOX
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def lab(env_lab):
    """The shared env lab (tests/e2e/conftest.py): this module converges it first; drill 5
    (tests/e2e/test_drills.py) breaks its P40 box's env four ways and rebuilds it after this module."""
    return env_lab


def deploy(lab, deploy_file="deploy/env.py", torch_requirements=None, hosts=None, mode="json"):
    overrides = json.loads(json.dumps(lab.pyenv_overrides))
    if torch_requirements:
        overrides["torch"]["requirements"] = torch_requirements
    data = {"mirror_urls": {**lab.mirror_urls, "pypi": standin.pypi_base(lab.mirror_url)},
            "catalog_overrides": overrides, "env_backend": "venv", "venv_python": "python3"}
    started = time.monotonic()
    res = lab.deploy(deploy_file, data=data, hosts=hosts, timeout=900, mode=mode)
    TIMINGS.setdefault(deploy_file, 0.0)
    TIMINGS[deploy_file] += time.monotonic() - started
    print(f"{deploy_file}: {time.monotonic() - started:.0f}s {res}")
    return res


def ssh(lab, cmd, check=True, box=BOX):
    return lab.box(box).ssh(cmd, check=check, timeout=300)


def link(lab, path):
    return ssh(lab, f"readlink {path}", check=False).stdout.strip()


def marker(lab, box=BOX):
    text = lab.box(box).read_text(MARKER)
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def proofs(lab, box=BOX, **expected):
    expect = {"torch": "2.13.0", "cuda": "none", "gpu_cc": "6.1", "vllm": None, "vllm_skip": "test",
              "verl": "0.5.0", "verl_src": VERL_SRC, "compose": True, "overrides": [], **expected}
    out = ssh(lab, f"{PY} {LAB_ROOT}/env-build/prove-env.py '{json.dumps(expect)}'", check=False, box=box)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_converge_builds_a_proven_env(lab):
    res = deploy(lab)
    res.assert_ok()
    assert link(lab, ENV) == "verl.gen1"
    m = marker(lab)
    assert m["generation"] == "verl.gen1" and m["torch"] == "2.13.0" and m["cuda"] == "none"
    assert m["vllm"] == "skipped" and "6.1 < 7.0" in m["vllm_reason"]    # a P40: no vLLM, with the reason
    assert m["torch_cuda_arch_list"] == "6.1"
    # every proof, as this deploy's build ran them on this generation (build-env.sh records them in it and
    # swaps only a healthy one; running them again here would import the same torch and verl a second time),
    # each detail naming what it was proven against: this test's expectation
    p = built_proof(lab)
    assert p["healthy"] and set(p["checks"]) >= {"files", "lock", "imports", "torch", "torch_cuda", "gpu", "apex",
                                                  "vllm", "xformers", "verl", "compose"}, p
    assert p["checks"]["torch"]["detail"].endswith("(pinned 2.13.0)"), p["checks"]["torch"]
    assert p["checks"]["torch_cuda"]["detail"].startswith("CPU torch stand-in")
    assert p["checks"]["gpu"]["detail"] == "skipped: CPU torch stand-in (the box reports compute capability 6.1)"
    assert p["checks"]["apex"]["detail"] == "imported amp_C, fused_layer_norm_cuda, apex_C"
    assert p["checks"]["verl"]["detail"] == f"verl 0.5.0 from {VERL_SRC}/verl (patched)", p["checks"]["verl"]
    assert p["checks"]["compose"]["detail"].startswith("main_ppo --cfg job composed"), p["checks"]["compose"]
    # Apex: the stand-in's extensions were built with this box's arch, the bounded jobs and gcc-11
    info = ssh(lab, f"cd / && {PY} -c 'import amp_C, fused_layer_norm_cuda, apex_C; print(amp_C.build_info())'").stdout
    assert "cpp_ext=1;cuda_ext=1" in info and "TORCH_CUDA_ARCH_LIST=6.1" in info and "CC=/usr/bin/gcc-11" in info
    assert "MAX_JOBS=" + m["max_jobs"] in info
    # the constraints file pins torch for every later install
    constraints = ssh(lab, f"cat {ENV}/verl-lab-constraints.txt").stdout
    assert "torch==2.13.0" in constraints.splitlines() and "transformers==4.54.1" in constraints.splitlines()
    # verl: editable from the patched clone at v0.5.0; the Hydra config composes
    where = ssh(lab, f"cd / && {PY} -c 'import verl, os; print(verl.__version__, os.path.dirname(verl.__file__))'").stdout.split()
    assert where == ["0.5.0", f"{VERL_SRC}/verl"]
    assert "autocast_dtype_of" in ssh(lab, f"cat {VERL_SRC}/verl/workers/actor/dp_actor.py").stdout
    tag = ssh(lab, f"git -C {VERL_SRC} describe --tags --exact-match").stdout.strip()
    assert tag == "v0.5.0"
    job = ssh(lab, f"cd / && {PY} -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=hf "
                   "+critic.model.override_config._attn_implementation=sdpa --cfg job").stdout
    assert "_attn_implementation: sdpa" in job and "name: hf" in job
    # Debian 12's venv brings pip 23.0.1; the build brought it to build-tools.txt's pin first
    assert ssh(lab, f"{PY} -m pip --version").stdout.split()[1] == "25.1.1"
    assert m["xformers"] == "skipped" and "no vLLM" in m["xformers_reason"]
    assert "xformers" not in constraints


def test_rerun_changes_nothing(lab):
    deploy(lab).assert_idempotent()


def test_failed_rebuild_leaves_the_env_as_it_was(lab):
    before = marker(lab)
    res = deploy(lab, "deploy/rebuild.py", torch_requirements=["torch==0.0.1"], hosts=[BOX])
    assert not res.ok and BOX in res.failed_hosts
    assert link(lab, ENV) == "verl.gen1"
    assert marker(lab) == before
    assert proofs(lab)["healthy"]
    # the failed run left its own build files (constraints, script); the next plain deploy puts the plan's
    # back and keeps this env: nothing is built
    res = deploy(lab, hosts=[BOX]).assert_ok()
    assert res.changed and "building a new env generation" not in res.output, res.tail()
    assert link(lab, ENV) == "verl.gen1" and marker(lab) == before


def test_an_uninstalled_need_of_verl_is_found_by_the_quick_check_and_rebuilt_with_the_reason(lab):
    """pip uninstall of codetiming (one of verl's needs): the RECORD scan sees nothing (its files and RECORD went
    together) and verl's trainer no longer loads; the quick re-check of a plain deploy finds it (the env's lock,
    the trainer's imports), says why without -v and builds a new generation, which loads the trainer."""
    ssh(lab, f"{PY} -m pip uninstall -y -q codetiming")
    gone = ssh(lab, f"cd / && {PY} -c 'import verl.trainer.ppo.ray_trainer'", check=False)
    assert gone.returncode != 0 and "No module named 'codetiming'" in gone.stderr, gone.stderr[-500:]
    quick = proofs(lab, quick=True, compose=False, lock=lock_of(lab))
    assert quick["checks"]["files"]["ok"], quick["checks"]["files"]
    assert "codetiming: not installed (the lock pins codetiming==1.4.0)" in quick["checks"]["lock"]["detail"], quick
    assert "module codetiming: not found (imported by verl.workers.fsdp_workers" in \
        quick["checks"]["imports"]["detail"], quick
    before = link(lab, ENV)
    res = deploy(lab, hosts=[BOX], mode="text")
    res.assert_ok()
    said = [line for line in res.output.splitlines() if "verl-lab env: building a new env generation" in line]
    assert len(said) == 1 and "the env is broken (" in said[0] and \
        "codetiming: not installed (the lock pins codetiming==1.4.0)" in said[0], res.tail()
    # and the operation's name, printed when it starts (the build's minutes follow), names it too (issue 44)
    started = [ln for ln in res.output.splitlines() if "Starting operation" in ln and "Python env" in ln]
    assert len(started) == 1 and "Python env: rebuilt (the env is broken (" in started[0] and \
        "codetiming" in started[0], res.tail()
    assert link(lab, ENV) not in (before, "") and link(lab, f"{ENV}.prev") == before
    ssh(lab, f"cd / && {PY} -c 'import verl.trainer.ppo.ray_trainer'")
    deploy(lab, hosts=[BOX]).assert_idempotent()
    print("timings (s):", {k: round(v) for k, v in TIMINGS.items()})


def built_proof(lab, box=BOX) -> dict:
    """The proofs (prove-env.py's JSON) the build ran on the env's current generation before it swapped it in
    (files/templates/env-build.sh.j2 keeps them in the generation: verl-lab-proof.json)."""
    return json.loads(lab.box(box).read_text(f"{ENV}/verl-lab-proof.json"))


def lock_of(lab, box=BOX) -> list[str]:
    """The env's lock as the env stage placed it (its constraints file)."""
    text = ssh(lab, f"cat {LAB_ROOT}/env-build/constraints.txt", box=box).stdout
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
