"""The move of tasks/' families into folders (issue 45) was a pure move: proven here from git.

Each moved module's file at the move commit (``MOVE``) is compared with its file at the commit before it
(``BEFORE``), and so is every other file the move commit changed (the importers, the docs):

* Python: the syntax trees are equal once every import statement is set aside and the old file's strings
  (docstrings included) read through ``renamed``, the module paths of ``MOVES`` (``tasks/driver_plan.py`` ->
  ``tasks/driver/plan.py``, ``tasks.driver_plan`` -> ``tasks.driver.plan``); the comments are equal the
  same way; each import statement binds the same names as before, each to the same object: the module it
  came from, moved (``renamed_module``), or the folder whose ``__init__`` hands that name on from it;
* any other text: the new file is the old one read through ``renamed``.

The only other edit the move made is in ``EDITS`` with its reason; what the boxes are sent (``BOX_BYTES``) it
left as it was, old module paths in its comments included. ``python -m tests.unit.test_pure_move``
prints the comparison of every file; the tests below it show the comparison fails on a changed body, a
changed text, a lost import and an import from elsewhere.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BEFORE = "c34e42de5886019b6a0110debc33b69ed552a389"     # main before the move
MOVE = "ff111ad17c1a201f649b27c96b542cc6d1a881d7"     # the move commit

# old module (under tasks/) -> its file in the folder; the stage modules (a pyinfra @deploy) are marked
MOVES = {
    "driver": "driver/stage", "driver_choice": "driver/choice", "driver_plan": "driver/plan",
    "driver_settle": "driver/settle", "driver_sources": "driver/sources", "driver_status": "driver/status",
    "tracking": "tracking/setting", "tracking_copy": "tracking/copy", "tracking_events": "tracking/events",
    "tracking_hub": "tracking/hub", "tracking_sync": "tracking/sync", "tracking_train": "tracking/train",
    "settings": "settings/load", "settings_catalog": "settings/catalog", "settings_cluster": "settings/cluster",
    "settings_errors": "settings/errors", "settings_keys": "settings/keys", "settings_workload": "settings/workload",
    "verl_config": "verl/config", "verl_rules": "verl/rules", "verl_source": "verl/source",
    "data": "data/stage", "data_plan": "data/plan",
    "doctor": "doctor/diagnosis", "doctor_disk": "doctor/disk",
}
STAGES = {"driver", "tracking_copy", "tracking_hub", "tracking_sync", "verl_source", "data"}
# A module whose name is now its folder's keeps that name in texts where it is not a stage: the folder hands on
# every public name of its modules (``tasks.settings.LabSettings``, ``python -m tasks.doctor`` stay true).
KEEPS_NAME = {"settings", "tracking", "doctor"}

# What the boxes are sent (placed files, what a stamp is made of, what units and scripts are rendered from) is not
# touched by the move, its old module paths in comments included: a changed byte there would place files again on
# every box, rebuild every env (files/requirements/ is part of its stamp) and restart a running training (its unit).
BOX_BYTES = ("verl_lab_box/", "files/templates/", "files/requirements/", "files/patches/")

# the one edit beyond imports and module paths: new file -> ((old text, new text), ...), and why
EDITS = {
    "tasks/tracking/hub.py": (
        (('UNIT_TEMPLATE = Path(__file__).resolve().parent.parent / "files"', 'UNIT_TEMPLATE = REPO_ROOT / "files"'),
         ("from tasks.placed import place, rendered",
          "from tasks.catalog import REPO_ROOT\nfrom tasks.placed import place, rendered")),
        "the file is a folder deeper: the repository's root from tasks.catalog, as the other stages take it"),
}


def renamed_module(dotted: str) -> str:
    """``tasks.driver_plan`` -> ``tasks.driver.plan`` (and ``tasks.driver_plan.x`` -> ``tasks.driver.plan.x``):
    where the module now is. Any other name is returned as it is."""
    parts = dotted.split(".")
    if len(parts) >= 2 and parts[0] == "tasks" and parts[1] in MOVES:
        return ".".join(["tasks", *MOVES[parts[1]].split("/"), *parts[2:]])
    return dotted


def _dotted(old: str) -> str:
    return "tasks." + (old if old in KEEPS_NAME else MOVES[old].replace("/", "."))


_OLD = "|".join(sorted(MOVES, key=len, reverse=True))
_TEXT = re.compile(rf"(?<![\w./-])tasks(?P<sep>[./])(?P<old>{_OLD})(?P<py>\.py)?(?![\w])")


def renamed(text: str) -> str:
    """A text with the moved modules' paths as they are now: ``tasks/driver_plan.py`` -> ``tasks/driver/plan.py``,
    ``tasks.driver_plan`` -> ``tasks.driver.plan``, ``tasks.driver`` -> ``tasks.driver.stage`` (the stage);
    ``tasks.settings``, ``tasks.tracking`` and ``tasks.doctor`` stay: their folders hand on their names."""
    def one(m: re.Match) -> str:
        old = m["old"]
        if m["sep"] == "/":
            if not m["py"]:                  # tasks/driver_... without .py: a glob or a folder, not a module
                return m[0]
            return f"tasks/{MOVES[old]}.py"
        return _dotted(old) + (m["py"] or "")
    return _TEXT.sub(one, text)


# ---------------------------------------------------------------- the comparison


class _Imports(ast.NodeTransformer):
    """Sets every import statement aside (a ``pass`` in its place), keeping them in order."""

    def __init__(self) -> None:
        self.found: list[ast.stmt] = []

    def visit_Import(self, node):
        self.found.append(node)
        return ast.copy_location(ast.Pass(), node)

    visit_ImportFrom = visit_Import


class _Strings(ast.NodeTransformer):
    def visit_Constant(self, node):
        if isinstance(node.value, str):
            return ast.copy_location(ast.Constant(renamed(node.value)), node)
        return node


def _package(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts[:-1])


def _targets(node: ast.stmt, package: str) -> list[tuple[str, str]]:
    """(bound name, dotted object) of each name an import statement binds."""
    if isinstance(node, ast.Import):
        return [(a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0]) for a in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [(a.asname or a.name, f"{base}.{a.name}") for a in node.names]


def _origin(read, dotted: str) -> str:
    """Where a name a module holds is defined: ``tasks.driver.choose_branch`` -> ``tasks.driver.choice.choose_branch``,
    following the top-level ``from X import name`` of each module on the way (a folder's ``__init__``, a module's
    re-export). A module itself, or a name defined where it is named, is returned as it is."""
    for _ in range(10):
        module, _, attr = dotted.rpartition(".")
        text = read(module.replace(".", "/") + "/__init__.py") or read(module.replace(".", "/") + ".py")
        if text is None or read(dotted.replace(".", "/") + ".py") is not None:
            return dotted
        source = next((f"{node.module}.{a.name}" for node in ast.parse(text).body
                       if isinstance(node, ast.ImportFrom) and node.module and not node.level
                       for a in node.names if (a.asname or a.name) == attr), None)
        if source is None:
            return dotted
        dotted = source
    return dotted


def import_problems(old: list[ast.stmt], new: list[ast.stmt], path: str, read) -> list[str]:
    """Where the new file's imports do not bind what the old file's did."""
    if len(old) != len(new):
        return [f"{path}: {len(old)} import statements before, {len(new)} after"]
    problems = []
    package = _package(path)
    for o, n in zip(old, new):
        was, now = _targets(o, package), _targets(n, package)
        if [b for b, _ in was] != [b for b, _ in now]:
            problems.append(f"{path}:{n.lineno}: binds {[b for b, _ in now]}, before {[b for b, _ in was]}")
            continue
        for (name, before), (_, after) in zip(was, now):
            moved = renamed_module(before)
            if after == moved:
                continue
            folder, _, attr = after.rpartition(".")
            if moved.startswith(folder + ".") and _origin(read, after) == _origin(read, moved):
                continue                     # the folder hands on what the module it moved to holds
            problems.append(f"{path}:{n.lineno}: {name} is {after}, before {before} (now {moved})")
    return problems


def _comments(text: str) -> list[str]:
    return [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]


def python_problems(old_text: str, new_text: str, path: str, read) -> list[str]:
    """What differs between two versions of a Python file beyond imports and module paths."""
    for was, now in EDITS.get(path, ((), ""))[0]:
        assert old_text.count(was) == 1, f"{path}: the listed edit's old text is not once in the old file"
        old_text = old_text.replace(was, now)
    old_imports, new_imports = _Imports(), _Imports()
    old_tree = _Strings().visit(old_imports.visit(ast.parse(old_text)))
    new_tree = new_imports.visit(ast.parse(new_text))
    problems = []
    if ast.dump(old_tree) != ast.dump(new_tree):
        old_lines, new_lines = ast.unparse(old_tree).splitlines(), ast.unparse(new_tree).splitlines()
        where = next((i for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b),
                     min(len(old_lines), len(new_lines)))
        problems.append(f"{path}: the code differs beyond imports and module paths, first at (unparsed) "
                        f"{old_lines[where:where + 1]} -> {new_lines[where:where + 1]}")
    if [renamed(c) for c in _comments(old_text)] != _comments(new_text):
        diff = [(a, b) for a, b in zip(map(renamed, _comments(old_text)), _comments(new_text)) if a != b][:1]
        problems.append(f"{path}: the comments differ beyond module paths: {diff or 'a comment added or dropped'}")
    return problems + import_problems(old_imports.found, new_imports.found, path, read)


class _Git:
    """``git cat-file --batch``: one process answers every read of a file at a commit."""

    def __init__(self) -> None:
        self.proc = None

    @functools.lru_cache(maxsize=None)
    def text(self, commit: str, path: str) -> str | None:
        if self.proc is None:
            self.proc = subprocess.Popen(["git", "cat-file", "--batch"], cwd=REPO, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE)
        self.proc.stdin.write(f"{commit}:{path}\n".encode())
        self.proc.stdin.flush()
        header = self.proc.stdout.readline().decode().split()
        if len(header) != 3:                         # "<object> missing"
            return None
        data = self.proc.stdout.read(int(header[2]))
        self.proc.stdout.read(1)
        return data.decode()


git_text = _Git().text


def changed_files(before: str, after: str) -> list[tuple[str, str, str]]:
    """(status, old path, new path) of each file the move commit changed."""
    out = subprocess.run(["git", "diff", "--name-status", "-M50%", before, after], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        status, *paths = line.split("\t")
        rows.append((status[0], paths[0], paths[-1]))
    return rows


def file_problems(status: str, old: str, new: str, before: str, after: str) -> list[str]:
    read_new = lambda p: git_text(after, p)        # noqa: E731
    if status == "A":
        return []                                  # the folders' __init__ and __main__ (read by the tests below)
    if status == "D":
        return [f"{old}: removed by the move"]
    if status == "R" and f"tasks/{MOVES.get(Path(old).stem, '')}.py" != new:
        return [f"{old} -> {new}: not a move of MOVES"]
    old_text, new_text = git_text(before, old), read_new(new)
    if new.endswith(".py"):
        return python_problems(old_text, new_text, new, read_new)
    return [] if renamed(old_text) == new_text else [f"{new}: differs beyond module paths"]


def _commits() -> tuple[str, str]:
    if MOVE is None or git_text(MOVE, "tasks/driver/stage.py") is None or git_text(BEFORE, "tasks/driver.py") is None:
        pytest.skip("the move's commits are not in this checkout's history (a shallow clone or an export)")
    return BEFORE, MOVE


# ---------------------------------------------------------------- the proof


def test_every_module_was_moved_as_it_was():
    before, after = _commits()
    rows = changed_files(before, after)
    moved = {Path(old).stem: new for status, old, new in rows if status == "R"}
    assert moved == {old: f"tasks/{new}.py" for old, new in MOVES.items()}
    problems = [p for row in rows for p in file_problems(*row, before, after)]
    assert not problems, "\n".join(problems)


def test_the_boxes_are_sent_what_they_were_sent_before():
    before, after = _commits()
    touched = [new for _, _, new in changed_files(before, after) if new.startswith(BOX_BYTES)]
    assert touched == [], f"the move changed what the boxes are sent: {touched}"


def test_only_the_folders_files_were_added():
    before, after = _commits()
    added = sorted(new for status, _, new in changed_files(before, after) if status == "A")
    folders = sorted({"tasks/" + new.split("/")[0] for new in MOVES.values()})
    assert added == sorted([f"{f}/__init__.py" for f in folders] + ["tasks/doctor/__main__.py"])


# ---------------------------------------------------------------- the comparison fails where it should

OLD = '''"""The plan (tasks/driver_plan.py); see tasks.driver_choice."""
from tasks.driver_choice import choose_branch, load_table  # the table
from tasks import driver_settle as settle

LIMIT = 3


def plan(x):
    # tasks/driver_status.py says so
    from tasks.settings import LabSettings
    return choose_branch(x) + LIMIT
'''
NEW = '''"""The plan (tasks/driver/plan.py); see tasks.driver.choice."""
from tasks.driver import choose_branch, load_table  # the table
from tasks.driver import settle

LIMIT = 3


def plan(x):
    # tasks/driver/status.py says so
    from tasks.settings import LabSettings
    return choose_branch(x) + LIMIT
'''
INIT = {"tasks/driver/__init__.py": "from tasks.driver.choice import choose_branch, load_table\n",
        "tasks/settings/__init__.py": "from tasks.settings.load import LabSettings\n"}


@pytest.mark.parametrize("change, problem", [
    (None, None),
    (("+ LIMIT", "- LIMIT"), "the code differs"),
    (("see tasks.driver.choice", "see tasks.driver.plan"), "the code differs"),
    (("# tasks/driver/status.py says so", "# tasks/driver/choice.py says so"), "the comments differ"),
    (("choose_branch, load_table  #", "choose_branch  #"), "binds ['choose_branch']"),
    (("from tasks.driver import settle", "from tasks.driver import plan as settle"), "settle is tasks.driver.plan"),
    (("from tasks.settings import LabSettings", "from tasks.settings.errors import LabSettings"), "LabSettings is"),
], ids=["as-moved", "body", "docstring", "comment", "lost-import", "other-module", "not-handed-on"])
def test_the_comparison_finds_what_a_move_must_not_change(change, problem):
    new = NEW if change is None else NEW.replace(*change)
    assert new != NEW or change is None
    problems = python_problems(OLD, new, "tasks/driver/plan.py", INIT.get)
    if problem is None:
        assert problems == []
    else:
        assert problems and problem in problems[0], problems


def test_a_name_the_folder_does_not_hand_on_is_an_import_from_elsewhere():
    init = {**INIT, "tasks/driver/__init__.py": "from tasks.driver.choice import choose_branch\n"}
    problems = python_problems(OLD, NEW, "tasks/driver/plan.py", init.get)
    assert problems == ["tasks/driver/plan.py:2: load_table is tasks.driver.load_table, before "
                        "tasks.driver_choice.load_table (now tasks.driver.choice.load_table)"]


def test_renamed_keeps_the_names_the_folders_hand_on_and_no_other_text():
    assert renamed("tasks/driver.py's install_driver; tasks.driver.install_driver; tasks/driver_*.py") == \
        "tasks/driver/stage.py's install_driver; tasks.driver.stage.install_driver; tasks/driver_*.py"
    assert renamed("python -m tasks.doctor; tasks.settings.LabSettings; tasks/settings.py") == \
        "python -m tasks.doctor; tasks.settings.LabSettings; tasks/settings/load.py"
    assert renamed("verl/utils/tracking.py, my_tasks.data, verl_lab_box/tracking_copy.py, tasks.data_plan") == \
        "verl/utils/tracking.py, my_tasks.data, verl_lab_box/tracking_copy.py, tasks.data.plan"


if __name__ == "__main__":
    found = [(row, file_problems(*row, BEFORE, MOVE)) for row in changed_files(BEFORE, MOVE)]
    for (status, old, new), problems in found:
        same = "added" if status == "A" else "as it was, but for imports and module paths"
        print(f"{status} {old}{' -> ' + new if new != old else ''}: {'; '.join(problems) or same}")
    sys.exit(1 if any(problems for _, problems in found) else 0)
