"""The env against its lock and the trainer's imports, without importing them (verl_lab_box/env_lock.py, run by
env_prove.py in the quick re-check and at build).

On made-up metadata and a made-up verl tree: each way a distribution can be missing or wrong is named with who
needs it. On the real thing (the cached CPU test env with verl 0.5.0 installed editable, tests/fixtures/standins/
env.py ``overlay_env``): with codetiming gone as ``pip uninstall`` leaves it, ``import verl.trainer.ppo.ray_trainer``
fails, the RECORD check (today's quick check) sees nothing, and the lock and the imports name codetiming.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from verl_lab_box import env_lock

REPO = Path(__file__).resolve().parents[2]
BOX = REPO / "verl_lab_box"


def dist(site: Path, name: str, version: str, *requires: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n\nRequires-Dist: not-a-header\n")


@pytest.fixture
def site(tmp_path):
    s = tmp_path / "site"
    dist(s, "verl", "0.5.0", "codetiming", "ray[default]>=2.41.0", "numpy<2.0.0", "pytest; extra == 'test'")
    dist(s, "codetiming", "1.4.0")
    dist(s, "ray", "2.46.0", "click>=7.0", "aiohttp>=3.7; extra == \"default\"", "fastapi; extra == \"serve\"")
    dist(s, "click", "8.1.8")
    dist(s, "aiohttp", "3.12.14", "yarl<2.0,>=1.17.0")
    dist(s, "yarl", "1.20.1")
    dist(s, "numpy", "1.26.4")
    dist(s, "torch", "2.6.0+cu118", "filelock")
    dist(s, "filelock", "3.18.0")
    return s


PINS = ["codetiming==1.4.0", "ray==2.46.0", "numpy==1.26.4", "torch==2.6.0"]


def check(site, pins=PINS, roots=("verl",)):
    return env_lock.lock_problems(list(pins), list(roots), path=[str(site)])


def test_an_env_as_its_lock_says_has_no_problem(site):
    count, problems = check(site)
    assert problems == [] and count == 9            # pytest (extra test) and fastapi (extra serve) not wanted


def test_a_pin_that_is_not_installed_is_named(site):
    (site / "codetiming-1.4.0.dist-info" / "METADATA").unlink()
    (site / "codetiming-1.4.0.dist-info").rmdir()
    assert check(site)[1] == ["codetiming: not installed (the lock pins codetiming==1.4.0)"]


def test_a_pin_at_another_version_is_named(site):
    (site / "numpy-1.26.4.dist-info").rename(site / "numpy-2.0.1.dist-info")
    problems = check(site)[1]
    assert "numpy: 2.0.1 installed, the lock pins 1.26.4" in problems
    assert "numpy: 2.0.1 installed, verl 0.5.0: numpy<2.0.0" in problems


def test_what_an_extra_needs_is_followed_to_the_bottom(site):
    for name in ("yarl-1.20.1",):
        (site / f"{name}.dist-info" / "METADATA").unlink()
        (site / f"{name}.dist-info").rmdir()
    assert check(site)[1] == ["yarl: not installed (needed by aiohttp 3.12.14: yarl<2.0,>=1.17.0)"]


def test_a_transitive_version_it_does_not_accept_is_named(site):
    (site / "yarl-1.20.1.dist-info").rename(site / "yarl-2.1.0.dist-info")
    assert check(site)[1] == ["yarl: 2.1.0 installed, aiohttp 3.12.14: yarl<2.0,>=1.17.0"]


def test_a_local_build_matches_a_pin_without_its_label_only(site):
    assert check(site, pins=["torch==2.6.0"])[1] == []
    assert check(site, pins=["torch==2.6.0+cu124"])[1] == ["torch: 2.6.0+cu118 installed, the lock pins 2.6.0+cu124"]


def verl_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in {"verl/__init__.py": "", "verl/trainer/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_imports_a_module_runs_when_it_loads_are_followed(tmp_path):
    root = verl_tree(tmp_path, {
        "verl/trainer/main.py": "import json\nfrom . import helpers\nfrom verl.utils import timing\n"
                                "def later():\n    import not_installed_but_late\n"
                                "try:\n    import optional_thing\nexcept ImportError:\n    pass\n"
                                "if False:\n    import conditional_thing\n",
        "verl/trainer/helpers.py": "from ..utils.timing import Timer\n",
        "verl/utils/__init__.py": "",
        "verl/utils/timing.py": "from codetiming_missing import Timer\nimport json, os.path\n",
    })
    count, problems = env_lock.import_problems(str(root), ("verl.trainer.main",))
    assert problems == ["module codetiming_missing: not found (imported by verl.utils.timing when it loads)"]
    assert count == 6                                # main, helpers, utils, utils.timing and the two packages


def test_a_verl_module_that_is_gone_is_named(tmp_path):
    root = verl_tree(tmp_path, {"verl/trainer/main.py": "from verl.trainer import gone\nimport verl.utils.nothing\n"})
    assert env_lock.import_problems(str(root), ("verl.trainer.main",))[1] == [
        f"verl.utils.nothing: no such module under {root}", f"verl.utils: no such module under {root}"]


# ------------------------------------------------------------------ the real env, one package uninstalled

def prove(python: Path, expect: dict, cwd: Path) -> dict:
    """The quick re-check as the PythonEnv fact sends it: env_lock.py then env_prove.py, one program on stdin."""
    program = (BOX / "env_lock.py").read_text() + "\n" + (BOX / "env_prove.py").read_text()
    out = subprocess.run([str(python), "-", json.dumps(expect)], input=program, capture_output=True, text=True,
                         cwd=cwd, timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["checks"]


def lock_lines() -> list[str]:
    from tasks.env import BUILD_TOOLS, REQUIREMENTS, constraint_lines
    return constraint_lines(["torch==2.13.0"], REQUIREMENTS, BUILD_TOOLS)


@pytest.fixture(scope="module")
def verl_envs(tmp_path_factory, request):
    """The CPU test env with the patched verl installed editable: whole, and with codetiming uninstalled."""
    request.getfixturevalue("verl_python")        # builds the cached env first (skips where it cannot)
    from tests.fixtures.standins.env import overlay_env, patched_verl_tree
    tmp = tmp_path_factory.mktemp("lock")
    root = patched_verl_tree(tmp / "src")
    return root, overlay_env(tmp / "whole", root), overlay_env(tmp / "without", root, hide=("codetiming",))


def test_an_uninstalled_need_of_verl_is_found_without_importing(verl_envs, tmp_path):
    root, whole, without = verl_envs
    expect = {"quick": True, "torch": "2.13.0", "cuda": "none", "gpu_cc": None, "vllm": None, "vllm_skip": "test",
              "verl": "0.5.0", "verl_src": str(root), "compose": False, "overrides": [], "lock": lock_lines()}
    # what the issue saw: the trainer does not load without codetiming
    broken = subprocess.run([str(without), "-c", "import verl.trainer.ppo.ray_trainer"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)
    assert broken.returncode != 0 and "No module named 'codetiming'" in broken.stderr, broken.stderr[-500:]
    good, bad = prove(whole, expect, tmp_path), prove(without, expect, tmp_path)
    assert good["lock"]["ok"] and good["imports"]["ok"], (good["lock"], good["imports"])
    # today's quick check, the RECORD scan, reads what is installed: the uninstall leaves it as it was
    # (the links of overlay_env leave the wheels' bin/ scripts out of reach: the same in both)
    assert re.sub(r"of \d+ installed", "", bad["files"]["detail"]) == re.sub(r"of \d+ installed", "",
                                                                            good["files"]["detail"])
    assert bad["verl"]["ok"]
    assert not bad["lock"]["ok"] and "codetiming: not installed (the lock pins codetiming==1.4.0)" in \
        bad["lock"]["detail"], bad["lock"]
    assert not bad["imports"]["ok"] and "module codetiming: not found (imported by verl.workers.fsdp_workers" in \
        bad["imports"]["detail"], bad["imports"]


def test_the_prove_script_finds_its_sibling_when_run_as_a_file(tmp_path):
    """At build time the env stage runs prove-env.py with env_lock.py placed beside it."""
    expect = {"quick": True, "torch": "0", "cuda": "none", "gpu_cc": None, "vllm": None, "vllm_skip": "x",
              "verl": "0.5.0", "verl_src": "/nonexistent", "compose": False, "overrides": [], "lock": ["nosuch==1"]}
    out = subprocess.run([sys.executable, str(BOX / "env_prove.py"), json.dumps(expect)], capture_output=True,
                         text=True, cwd=tmp_path, timeout=120, check=True).stdout
    lock = json.loads(out)["checks"]["lock"]
    assert not lock["ok"] and "nosuch: not installed (the lock pins nosuch==1)" in lock["detail"], lock


@pytest.mark.filterwarnings("ignore::SyntaxWarning")      # verl's own invalid escapes, as ast reads them
def test_the_line_reading_of_imports_is_pythons_own_on_every_file_of_verl(patched_verl_root):
    """top_imports reads lines, not Python's grammar: on the code it reads (the patched verl 0.5.0) it answers
    as ast does, file by file; and on the cases it hands to ast."""
    files = sorted(patched_verl_root.glob("verl/**/*.py"))
    assert len(files) > 250
    for path in files:
        text = path.read_text()
        assert env_lock.top_imports(text) == env_lock.ast_imports(text), path
    tricky = ('x = """\nimport inside_a_string\n"""\nimport os, json as j\nfrom . import (a,\n  b)  # c\n'
              'def f():\n    import late\nfrom ..x import y as z\nimport p; import q\n')
    assert env_lock.top_imports(tricky) == env_lock.ast_imports(tricky) == [
        (0, "os", []), (0, "json", []), (1, "", ["a", "b"]), (2, "x", ["y"]), (0, "p", []), (0, "q", [])]
