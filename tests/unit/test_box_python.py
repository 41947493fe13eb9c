"""The box's programs run with the box's own python3: 3.8 on Ubuntu 20.04 and 3.9 on Debian 11, both supported
distros (tasks/target.py). What Python 3.10 added at run time must not reach them; ruff's pyupgrade and bugbear
(.ci/lint, target py310) would add it (``zip(..., strict=...)``: pyproject.toml leaves B905 out for verl_lab_box/).

Proves: no ``zip`` call with ``strict=`` in verl_lab_box/ (mutation: one added back fails the first test); every
box module imports under the oldest Python found on this machine (pyenv's 3.8 or 3.9; skipped where none is),
third-party imports (torch, ray, ...) aside; and, wherever this runs, every box module parses with Python 3.8's
grammar (``ast.parse(feature_version=(3, 8))``: a ``match`` statement or parenthesized context managers fail it), so
a machine without an old Python still checks the syntax.
"""

from __future__ import annotations

import ast
import glob
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BOX = sorted((REPO / "verl_lab_box").glob("*.py"))
THIRD_PARTY = ("torch", "ray", "safetensors", "transformers", "numpy", "pyarrow", "peft", "accelerate", "vllm")


def test_no_box_program_calls_zip_with_strict():
    found = [f"{path.relative_to(REPO)}:{node.lineno}"
             for path in BOX for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "zip"
             and any(k.arg == "strict" for k in node.keywords)]
    assert not found, f"zip(strict=...) is Python 3.10's; the box's python3 may be 3.8: {found}"


def test_every_box_module_parses_with_python_3_8s_grammar():
    refused = []
    for path in BOX:
        try:
            ast.parse(path.read_text(), filename=str(path), feature_version=(3, 8))
        except SyntaxError as exc:
            refused.append(f"{path.relative_to(REPO)}:{exc.lineno}: {exc.msg}")
    assert not refused, f"Python 3.8's grammar refuses: {refused}"


def _oldest_python() -> str | None:
    for version in ("3.8", "3.9"):
        found = sorted(glob.glob(f"/root/.pyenv/versions/{version}.*/bin/python")) or sorted(
            glob.glob(f"/usr/bin/python{version}"))
        if found:
            return found[0]
    return None


def test_every_box_module_imports_under_the_oldest_python():
    python = _oldest_python()
    if python is None:
        pytest.skip("no Python 3.8 or 3.9 on this machine")
    probe = ("import importlib, sys\n"
             "failed = []\n"
             "for name in sys.argv[1:]:\n"
             "    sys.argv = [name]\n"
             "    try:\n"
             "        importlib.import_module('verl_lab_box.' + name)\n"
             "    except ModuleNotFoundError as e:\n"
             f"        if e.name.split('.')[0] not in {THIRD_PARTY!r}: failed.append(f'{{name}}: {{e!r}}')\n"
             "    except (SystemExit, IndexError):\n"
             "        pass\n"
             "    except Exception as e:\n"
             "        failed.append(f'{name}: {e!r}')\n"
             "print('\\n'.join(failed))\n")
    res = subprocess.run([python, "-c", probe, *(p.stem for p in BOX if p.stem != "__init__")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and not res.stdout.strip(), f"{python}: {res.stdout}{res.stderr}"
