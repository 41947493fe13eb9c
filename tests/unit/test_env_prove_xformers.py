"""The env proof's xformers check (verl_lab_box/env_prove.py): vLLM 0.8.5's xformers must be
the cu118 build and load its compiled ops (``xformers._has_cpp_library``, which real xformers
sets when ``torch.ops.load_library(xformers/_C.so)`` succeeded). PyPI's file of the same name
is a CUDA 12.4 build: in a cu118 env its ops cannot load (no libcudart.so.12), and the proof
names that build and the fix.

Two xformers packages: the e2e stand-in wheel (tests/fixtures/standins/env.py), installed
by pip, and a package shaped like PyPI's build whose ops failed to load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.standins import env as standin

PROVE = Path(__file__).resolve().parents[2] / "verl_lab_box" / "env_prove.py"
INDEX = "https://download.pytorch.org/whl/cu118"
WANT = {"torch": "0", "cuda": "none", "gpu_cc": "7.5", "vllm": None, "vllm_skip": "not here",
        "xformers": "0.0.29.post2", "xformers_cuda": "11.8", "xformers_index": INDEX,
        "verl": "0.5.0", "verl_src": "/nonexistent", "compose": False, "overrides": []}
CU124_INIT = '''from . import _cpp_lib
__version__ = "0.0.29.post2"
_has_cpp_library: bool = _cpp_lib._cpp_library_load_exception is None
'''
CU124_CPP_LIB = '''_cpp_library_load_exception = OSError(
    "libcudart.so.12: cannot open shared object file: No such file or directory")
'''
CU124_BUILD = {"version": {"cuda": 1204, "hip": None, "torch": "2.6.0+cu124", "python": "3.11.11"},
               "env": {"XFORMERS_PACKAGE_FROM": "wheel-v0.0.29.post2"}}


def xformers_check(site: Path, cwd: Path, **want) -> dict:
    env = {"PYTHONPATH": str(site), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    out = subprocess.run([sys.executable, str(PROVE), json.dumps({**WANT, **want})], capture_output=True,
                         text=True, cwd=cwd, env=env, timeout=120, check=True).stdout
    return json.loads(out)["checks"]["xformers"]


@pytest.fixture
def standin_site(tmp_path):
    wheel = standin.build_xformers_wheel(tmp_path / "wheels")
    assert wheel.name == "xformers-0.0.29.post2-cp311-cp311-manylinux_2_28_x86_64.whl"
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, timeout=120,
                   env={**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""})
    return site


@pytest.fixture
def cu124_site(tmp_path):
    site = tmp_path / "site"
    pkg = site / "xformers"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(CU124_INIT)
    (pkg / "_cpp_lib.py").write_text(CU124_CPP_LIB)
    (pkg / "cpp_lib.json").write_text(json.dumps(CU124_BUILD))
    info = site / "xformers-0.0.29.post2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: xformers\nVersion: 0.0.29.post2\n")
    return site


@pytest.mark.parametrize("quick", [False, True])
def test_the_cu118_standin_passes(standin_site, tmp_path, quick):
    got = xformers_check(standin_site, tmp_path, quick=quick)
    assert got["ok"], got
    assert "0.0.29.post2" in got["detail"] and "CUDA 11.8 build" in got["detail"]
    assert "stand-in" in got["detail"]
    if not quick:
        assert "compiled ops loaded" in got["detail"]


def test_pypis_cuda_12_4_build_fails_naming_the_build_and_the_fix(cu124_site, tmp_path):
    got = xformers_check(cu124_site, tmp_path)
    assert not got["ok"]
    detail = got["detail"]
    assert "CUDA 12.4 build for torch 2.6.0+cu124" in detail
    assert "_has_cpp_library is False" in detail and "libcudart.so.12" in detail
    assert f"--index-url {INDEX} xformers==0.0.29.post2" in detail and "deploy/rebuild.py" in detail


def test_quick_recheck_finds_the_cuda_12_4_build_without_importing(cu124_site, tmp_path):
    (cu124_site / "xformers" / "__init__.py").write_text("raise SystemExit('imported')\n")
    got = xformers_check(cu124_site, tmp_path, quick=True)
    assert not got["ok"] and "CUDA 12.4 build" in got["detail"] and "expected the CUDA 11.8" in got["detail"]


def test_skipped_where_no_xformers_is_planned(tmp_path):
    got = xformers_check(tmp_path, tmp_path, xformers=None, xformers_skip="no vLLM on this box")
    assert got == {"ok": True, "detail": "skipped: no vLLM on this box"}
    older = {k: v for k, v in WANT.items() if not k.startswith("xformers")}   # an env proven before the check
    out = subprocess.run([sys.executable, str(PROVE), json.dumps(older)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120, check=True).stdout
    assert json.loads(out)["checks"]["xformers"]["ok"]
