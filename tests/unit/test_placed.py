"""tasks/placed.py and its PathStates / UnitState facts: the one-command re-run check.

What ``place()`` queues for a PathStates answer is a table: tests/fixtures/placed/<case>.json
(the wanted folders and files, the answer the caller has, what place() asks for the paths it
lacks, the ``{path: why}`` it returns and the operations it queues, in order). The facts'
outputs are tests/unit/test_facts_table.py's."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import subprocess
from io import BytesIO
from pathlib import Path

import pytest

from tasks import env as envstage
from tasks import train
from tasks.facts.files import PathStates, UnitState
from tasks.placed import Wanted, differs, place, rendered, wanted_file
from tests.unit import test_env as env_test
from tests.unit import test_train_launcher as launcher_test

PLACED = Path(__file__).resolve().parents[1] / "fixtures" / "placed"


def run_fact(fact, **kwargs):
    out = subprocess.run(["sh", "-c", fact.command(**kwargs)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return fact.process(out.stdout.splitlines())


def me():
    return pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid()).gr_name


def test_path_states_reads_every_kind_in_one_command(tmp_path):
    folder = tmp_path / "a folder"
    folder.mkdir(mode=0o750)
    os.chmod(folder, 0o750)
    f = folder / "plan.json"
    f.write_bytes(b"{}\n")
    os.chmod(f, 0o640)
    link = tmp_path / "link"
    link.symlink_to(f)
    missing = tmp_path / "not" / "there"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    user, group = me()
    got = run_fact(PathStates(), paths=[str(folder), str(f), str(link), str(missing), str(fifo)])
    assert got[str(folder)] == {"kind": "dir", "mode": "750", "user": user, "group": group}
    assert got[str(f)] == {"kind": "file", "mode": "640", "user": user, "group": group,
                           "sha1": hashlib.sha1(b"{}\n").hexdigest()}
    assert got[str(link)] == {"kind": "link"}
    assert got[str(missing)] is None
    assert got[str(fifo)] == {"kind": "other"}


def test_path_states_of_an_empty_file(tmp_path):
    f = tmp_path / "empty"
    f.write_bytes(b"")
    got = run_fact(PathStates(), paths=[str(f)])
    assert got[str(f)]["sha1"] == hashlib.sha1(b"").hexdigest()


def test_differs_against_a_real_file(tmp_path):
    """What the fact reads of a file written with the wanted bytes matches; one byte off does not."""
    user, group = me()
    want = wanted_file(str(tmp_path / "f"), "F", "body\n", mode="644", user=user, group=group)
    (tmp_path / "f").write_bytes(want.content)
    os.chmod(tmp_path / "f", 0o644)
    state = run_fact(PathStates(), paths=[want.path])[want.path]
    assert differs(state, want) is None
    (tmp_path / "f").write_bytes(b"body!\n")
    assert differs(run_fact(PathStates(), paths=[want.path])[want.path], want) == "other content"


def test_rendered_matches_pyinfra_template_rendering(tmp_path):
    """The bytes placed are the bytes pyinfra's files.template would write (trailing newline kept)."""
    from jinja2 import UndefinedError
    from pyinfra.api.util import get_template

    t = tmp_path / "t.j2"
    t.write_text("a={{ a }}\n{% for x in xs %}{{ x }}\n{% endfor %}\n")
    assert rendered(t, a=1, xs=[2, 3]) == get_template(str(t)).render({"a": 1, "xs": [2, 3]}) == "a=1\n2\n3\n\n"
    with pytest.raises(UndefinedError):
        rendered(t, a=1)              # StrictUndefined, as in files.template


@pytest.mark.parametrize("backend", ["venv", "conda"])
def test_env_stage_asks_for_exactly_the_paths_it_places(backend):
    """The env stage's bundle asks PathStates for env_file_paths before it has a plan; place()
    would ask again for any path missing there (one command more on every run)."""
    s = env_test.settings(env_backend=backend)
    plan = envstage.plan_env(s, env_test.gpus(), env_test.BUILD)
    wanted, condarc = envstage.env_wanted(s, plan, None)
    assert [w.path for w in wanted + condarc] == envstage.env_file_paths(s)
    assert bool(condarc) == (backend == "conda")


def test_training_stage_asks_for_exactly_the_paths_it_places():
    s = launcher_test.settings_for()
    assert [w.path for w in train.training_wanted(launcher_test.layout_for(s))] == train.training_paths(s)


def test_unit_state_command_runs_without_systemd():
    got = run_fact(UnitState(), unit="verl-lab-no-such.service")
    assert got == {"enabled": False, "active": False, "crash_looping": False}


class Recorder:
    """pyinfra's host (its PathStates fact) and the files operations place() calls, recorded."""

    def __init__(self, asked: dict | None):
        self.asked, self.ops = asked, []

    def get_fact(self, cls, paths):
        assert cls is PathStates and self.asked is not None, f"place() asked {cls.__name__} for {paths}"
        assert paths == self.asked["paths"]
        self.asked = {**self.asked, "done": True}
        return self.asked["answer"]

    def op(self, name):
        def record(**kwargs):
            src = kwargs.pop("src", None)
            if isinstance(src, BytesIO):
                kwargs["content"] = src.getvalue().decode()
            self.ops.append([name, kwargs])
        return record


@pytest.mark.parametrize("path", sorted(PLACED.glob("*.json")), ids=lambda p: p.stem)
def test_place_case(path, monkeypatch):
    import pyinfra
    from pyinfra.operations import files

    case = json.loads(path.read_text())
    rec = Recorder(case.get("asked"))
    monkeypatch.setattr(pyinfra, "host", rec)
    for name in ("link", "directory", "put"):
        monkeypatch.setattr(files, name, rec.op(f"files.{name}"))
    wanted = [Wanted(**{**w, "content": None if w["content"] is None else w["content"].encode()})
              for w in case["wanted"]]
    assert place(wanted, case["states"]) == case["result"]
    assert rec.ops == case["operations"]
    assert rec.asked is None or rec.asked.get("done"), "place() did not ask for the paths the answer lacks"
