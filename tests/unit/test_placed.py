"""tasks/placed.py and its PathStates / UnitState facts: the one-command re-run check."""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import subprocess

import pytest

from tasks.facts.files import PathStates, UnitState
from tasks.placed import differs, rendered, wanted_dir, wanted_file
from tasks import env as envstage, train
from tests.unit import test_env as env_test
from tests.unit import test_train_launcher as launcher_test


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


def test_differs_names_each_mismatch(tmp_path):
    want = wanted_file("/x/launcher", "Launcher", "#!/bin/sh\n", mode="750", group="verl")
    same = {"kind": "file", "mode": "750", "user": "root", "group": "verl", "sha1": want.sha1}
    assert differs(same, want) is None
    assert differs(None, want) == "missing"
    assert differs({**same, "sha1": "0" * 40}, want) == "other content"
    assert differs({**same, "mode": "755"}, want) == "mode 755 != 750"
    assert differs({**same, "group": "root"}, want) == "owner root:root != root:verl"
    assert differs({"kind": "link"}, want) == "a link where a file belongs"
    assert differs({"kind": "dir", "mode": "750", "user": "root", "group": "verl"}, want) == "a dir where a file belongs"
    d = wanted_dir("/x", mode="0750")
    assert differs({"kind": "dir", "mode": "750", "user": "root", "group": "root"}, d) is None
    assert differs({"kind": "file", "mode": "750", "user": "root", "group": "root", "sha1": None}, d) \
        == "a file where a dir belongs"


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


@pytest.mark.parametrize("lines,enabled,active", [
    (["enabled=enabled", "active=active"], True, True),
    (["enabled=disabled", "active=inactive"], False, False),
    (["enabled=", "active=inactive"], False, False),          # no such unit
    (["enabled=enabled", "active=activating"], True, True),
    (["enabled=enabled", "active=failed"], True, False),
])
def test_unit_state(lines, enabled, active):
    assert UnitState().process(lines) == {"enabled": enabled, "active": active}


def test_unit_state_command_runs_without_systemd():
    got = run_fact(UnitState(), unit="verl-lab-no-such.service")
    assert got == {"enabled": False, "active": False}
