"""The env re-check's "files" proof (verl_lab_box/env_prove.py, quick mode): every file a
wheel's RECORD lists is present with its recorded size, read straight from the RECORDs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROVE = Path(__file__).resolve().parents[2] / "verl_lab_box" / "env_prove.py"
QUICK = {"quick": True, "torch": "0", "cuda": "none", "gpu_cc": None, "vllm": None, "vllm_skip": "no GPU",
         "verl": "0.5.0", "verl_src": "/nonexistent", "compose": False, "overrides": []}


def prove(cwd: Path, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, str(PROVE), json.dumps(QUICK)], capture_output=True, text=True,
                         cwd=cwd, env=env, timeout=120, check=True).stdout
    return json.loads(out)["checks"]["files"]


def test_agrees_with_importlib_metadata(tmp_path):
    """The fast RECORD scan checks exactly the files importlib.metadata lists (sizes, no .pyc)."""
    count = subprocess.run([sys.executable, "-c", (
        "from importlib import metadata\n"
        "print(sum(1 for d in metadata.distributions() for f in (d.files or ())"
        " if f.size is not None and f.suffix != '.pyc'))")],
        capture_output=True, text=True, cwd=tmp_path, check=True, timeout=120).stdout.strip()
    got = prove(tmp_path)
    assert got["ok"], got
    assert got["detail"] == f"{count} installed files present with their recorded sizes"


def fake_wheel(site: Path) -> None:
    pkg = site / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "data, with comma.bin").write_bytes(b"12345")
    info = site / "demo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
    (info / "RECORD").write_text(
        "demo/__init__.py,sha256=abc,6\n"
        '"demo/data, with comma.bin",sha256=def,5\n'
        "demo/__pycache__/__init__.cpython-311.pyc,,\n"
        "demo-1.0.dist-info/RECORD,,\n")


def test_names_a_truncated_and_a_missing_file(tmp_path):
    site = tmp_path / "site"
    fake_wheel(site)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    assert prove(tmp_path, env)["ok"]
    (site / "demo" / "data, with comma.bin").write_bytes(b"12")
    (site / "demo" / "__init__.py").unlink()
    got = prove(tmp_path, env)
    assert not got["ok"]
    assert "2 of" in got["detail"]
    assert "demo: demo/__init__.py is missing" in got["detail"]
    assert "demo: demo/data, with comma.bin has another size than recorded" in got["detail"]
