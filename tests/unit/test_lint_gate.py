"""The lint and type gate (.ci/lint; docs/testing.md, "Lint and types"), which .ci/run runs after installing and
before any test: ruff over the project's code, then mypy (.ci/types.py) with the pure layers clean and the rest held
to .ci/mypy-baseline.txt. Proven on a copy of tasks/, verl_lab_box/, the gate's scripts and pyproject.toml: it passes on the copy
as it is, and fails on one planted lint finding, one planted type error in a pure layer and one elsewhere that the
baseline does not list. Real ruff and mypy, over the pure layers (and what they import); the whole project is what
.ci/run lints."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _types_module():
    spec = importlib.util.spec_from_file_location("ci_types", REPO / ".ci" / "types.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TYPES = _types_module()


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """tasks/, verl_lab_box/ (the plan reads some of its constants), .ci/ and pyproject.toml, copied; mypy's cache
    kept in the copy across this module's runs."""
    root = tmp_path_factory.mktemp("lint-gate")
    for folder in ("tasks", "verl_lab_box"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / ".ci", root / ".ci")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def lint(root: Path) -> subprocess.CompletedProcess:
    """``.ci/lint`` over the pure layers of the tree at ``root``, with this interpreter (the venv's ruff and mypy)."""
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("MYPY_CACHE_DIR", None)
    paths = [p.rstrip("/") for p in TYPES.PURE]
    return subprocess.run(["bash", str(root / ".ci" / "lint"), *paths], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


PLANTS = {
    "unused-import": ("tasks/plan/cli.py", "\nimport os\n", "F401"),
    "type-error-in-a-pure-layer": ("tasks/plan/terms.py", "\n\ndef _planted() -> int:\n    return 'one'\n",
                                   "tasks/plan/terms.py:{line}: in a pure layer (no baseline there): tasks/plan/terms.py:"
                                   " Incompatible return value type (got \"str\", expected \"int\")  [return-value]"),
    "type-error-beyond-the-baseline": ("tasks/placed.py", "\n\ndef _planted() -> int:\n    return 'one'\n",
                                       "tasks/placed.py:{line}: not in .ci/mypy-baseline.txt: tasks/placed.py:"
                                       " Incompatible return value type (got \"str\", expected \"int\")  [return-value]"),
}


def test_the_gate_passes_on_the_tree_as_it_is(tree):
    res = lint(tree)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "lint: ruff clean over tasks/plan" in res.stdout
    assert "types: mypy clean over the pure layers;" in res.stdout
    # what the pure layers import (tasks/placed.py, tasks/facts/) has errors the baseline lists, and they pass
    assert "0 error(s) elsewhere" not in res.stdout, res.stdout


@pytest.mark.parametrize("plant", list(PLANTS))
def test_the_gate_fails_on_a_planted_finding(tree, plant):
    path, text, words = PLANTS[plant]
    target = tree / path
    before = target.read_text()
    try:
        target.write_text(before + text)
        res = lint(tree)
    finally:
        target.write_text(before)
    assert res.returncode != 0, res.stdout
    words = words.format(line=len((before + text).splitlines()))
    assert words in res.stdout + res.stderr, res.stdout + res.stderr
    if plant == "unused-import":
        assert "types:" not in res.stdout          # ruff stops the gate before mypy runs


def test_ci_run_lints_after_installing_and_before_the_tests():
    run = (REPO / ".ci" / "run").read_text()
    install, gate, tests = (run.index("pip install -q -e '.[test]'"), run.index("\nbash .ci/lint\n"),
                            run.index("python -m pytest"))
    assert install < gate < tests
    assert "set -euo pipefail" in run.split("\n", 3)[2]         # a failing gate stops the script
    make = (REPO / "Makefile").read_text()
    assert "\nlint:" in make and "bash .ci/lint" in make


def test_the_baseline_counts_each_entry_and_names_no_line():
    assert TYPES.entry("tasks/x.py", 'Name "f" already defined on line 12', "no-redef") == \
        'tasks/x.py: Name "f" already defined on line N  [no-redef]'
    e = TYPES.entry("tasks/base.py", "Argument 1", "arg-type")
    found = [("tasks/base.py", 10, e), ("tasks/base.py", 90, e), ("tasks/plan/cli.py", 3, "tasks/plan/cli.py: x  [misc]")]
    failing, gone = TYPES.judge(found, Counter({e: 1, "tasks/undo.py: y  [misc]": 1,
                                                "tasks/plan/cli.py: x  [misc]": 1}))
    assert failing == [f"tasks/base.py:90: not in .ci/mypy-baseline.txt: {e}",
                       "tasks/plan/cli.py:3: in a pure layer (no baseline there): tasks/plan/cli.py: x  [misc]"]
    assert gone == Counter({"tasks/undo.py: y  [misc]": 1})


def test_the_baseline_lists_no_pure_layer_and_no_file_that_is_gone():
    listed = TYPES.baseline()
    assert not [e for e in listed if e.startswith(TYPES.PURE)]
    assert all(e.split(":", 1)[0].startswith(("tasks/", "verl_lab_box/")) for e in listed)
    assert all((REPO / e.split(":", 1)[0]).is_file() for e in listed), "an entry names a file that is gone: --cut"
