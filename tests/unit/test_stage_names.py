"""One name per stage: deploy/<stage>.py runs tasks/<stage>.py's install_<stage> (tasks/<stage>/stage.py's
where the stage is a folder), whose proofs end in the marker markers/<stage>.done. A box provisioned when the
env stage was called "pyenv" keeps its proven env: the marker under the old name is read when the new one is
missing."""

from __future__ import annotations

import ast
import importlib
import subprocess
from pathlib import Path

import pytest

from tasks.facts.files import Marker
from tasks.settings import LEGACY_STAGE_NAMES, load_settings

REPO = Path(__file__).resolve().parents[2]
STAGES = ("driver", "cuda", "env", "data", "train")


def stage_module(stage: str) -> str:
    """tasks/<stage>.py, or tasks/<stage>/stage.py where the stage is a folder (docs/architecture.md)."""
    return f"tasks.{stage}.stage" if (REPO / "tasks" / stage).is_dir() else f"tasks.{stage}"


@pytest.mark.parametrize("stage", STAGES)
def test_deploy_file_module_and_operation_share_the_stage_name(stage):
    module = importlib.import_module(stage_module(stage))
    assert callable(getattr(module, f"install_{stage}")), f"{module.__file__} has no install_{stage}"
    tree = ast.parse((REPO / "deploy" / f"{stage}.py").read_text())
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert f"install_{stage}" in called
    full = {n.func.id for n in ast.walk(ast.parse((REPO / "deploy" / "full.py").read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert f"install_{stage}" in full


def test_no_stage_module_keeps_an_old_name():
    for old in ("pyenv", "hfdata", "training"):
        assert not (REPO / "tasks" / f"{old}.py").exists()
        assert not (REPO / "tasks" / "facts" / f"{old}.py").exists()


def _read_marker(tmp_path, path, legacy=None):
    out = subprocess.run(["sh", "-c", Marker().command(path, legacy)], capture_output=True, text=True, check=True)
    return Marker().process(out.stdout.splitlines())


def test_env_marker_falls_back_to_the_old_name_only_when_missing(tmp_path):
    s = load_settings("box1", {"lab_root": str(tmp_path)})
    assert LEGACY_STAGE_NAMES == {"env": "pyenv"}
    new, old = s.marker("env"), s.legacy_marker("env")
    assert new.endswith("/markers/env.done") and old.endswith("/markers/pyenv.done")
    assert s.legacy_marker("cuda") is None
    Path(new).parent.mkdir(parents=True)
    assert _read_marker(tmp_path, new, old) is None
    Path(old).write_text("stamp=old\n")
    assert _read_marker(tmp_path, new, old) == {"stamp": "old"}
    assert _read_marker(tmp_path, new) is None                  # without the fallback: missing
    Path(new).write_text("stamp=new\n")
    assert _read_marker(tmp_path, new, old) == {"stamp": "new"}


def test_env_build_replaces_the_old_marker_after_writing_its_own():
    from tests.unit import test_env as env_test

    s = env_test.settings()
    text = env_test._build_script(s, env_test.envstage.plan_env(s, env_test.gpus(), env_test.BUILD))
    write = text.index(f"mv -f {s.marker('env')}.part {s.marker('env')}")
    assert text.index(f"rm -f {s.legacy_marker('env')}") > write


def test_one_marker_writer_writes_whole_lines_and_box_values(tmp_path):
    """tasks.placed.marker_command, the one writer of every stage's marker: literal values survive
    the shell as written (spaces, quotes, $), OnBox values are worked out on the box, the marker
    under an old name goes, and the reader (the Marker fact) gets back exactly what was written."""
    from tasks.placed import OnBox, marker_command

    path, old = tmp_path / "markers" / "env.done", tmp_path / "markers" / "pyenv.done"
    old.parent.mkdir()
    old.write_text("stamp=old\n")
    fields = [("stamp", "abc"), ("reason", "it's $HOME \"quoted\" `x`"), ("n", 3),
              ("generation", OnBox("$name")), ("when", OnBox("$(echo made-on-box)"))]
    command = marker_command(str(path), fields, drop=str(old))
    subprocess.run(["sh", "-c", f"name=verl.gen7; {command}"], check=True)
    assert _read_marker(tmp_path, str(path)) == {"stamp": "abc", "reason": "it's $HOME \"quoted\" `x`", "n": "3",
                                                 "generation": "verl.gen7", "when": "made-on-box"}
    assert not old.exists() and not Path(f"{path}.part").exists()


def test_one_marker_writer_fails_loudly_and_leaves_no_marker(tmp_path):
    from tasks.placed import marker_command

    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    done = subprocess.run(["sh", "-c", marker_command(str(blocked / "x.done"), [("stage", "x")])],
                          capture_output=True)
    assert done.returncode != 0 and not (blocked / "x.done").exists()



def test_no_stage_renders_a_marker_template():
    """Every stage writes its marker through tasks.placed.marker_command (cuda's and env's build
    scripts, the data and train stages' operations); no per-stage marker template is left."""
    assert not list((REPO / "files" / "templates").glob("*.done*"))
    for stage in STAGES:
        assert "marker_command" in (REPO / f"{stage_module(stage).replace('.', '/')}.py").read_text(), stage
