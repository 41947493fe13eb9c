"""The move of tasks/' families into folders (issue 45) was a pure move: proven here from git.

The move came in two steps (``STEPS``): the move itself (``MOVES``), and, after main was merged in, the move of
the module main had added meanwhile (``MERGED_MOVES``: tasks/driver_release.py). In each step, each moved
module's file after it is compared with its file before it, and so is every other file the step changed (the
importers, the docs):

* Python: the syntax trees are equal once every import statement is set aside and the old file's strings
  (docstrings included) read through ``renamed``, the step's module paths (``tasks/driver_plan.py`` ->
  ``tasks/driver/plan.py``, ``tasks.driver_plan`` -> ``tasks.driver.plan``); the comments are equal the
  same way; each import statement binds the same names as before, each to the same object: the module it
  came from, moved (``renamed_module``), or the folder whose ``__init__`` hands that name on from it;
* any other text: the new file is the old one read through ``renamed``.

The only other edit a step made is in its ``edits`` with its reason; what the boxes are sent (``BOX_BYTES``) no
step touched, old module paths in its comments included. The merge between the steps is git's own merge of its
parents but for the files git left in conflict (``CONFLICTS``), each resolved with lines of one side or the other.
``python -m tests.unit.test_pure_move`` prints the comparison of every file; the tests below it show the
comparison fails on a changed body, a changed text, a lost import and an import from elsewhere, and the merge's
check on an unlisted conflict and a line of neither side.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# old module (under tasks/) -> its file in the folder
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
# main's modules merged in after the move (i44driverundo), moved by the second step
MERGED_MOVES = {"driver_release": "driver/release"}
# A module whose name is now its folder's keeps that name in texts where it is not a stage: the folder hands on
# every public name of its modules (``tasks.settings.LabSettings``, ``python -m tasks.doctor`` stay true).
KEEPS_NAME = {"settings", "tracking", "doctor"}
FOLDERS = {new.split("/")[0] for new in MOVES.values()}

# What the boxes are sent (placed files, what a stamp is made of, what units and scripts are rendered from) is not
# touched by the move, its old module paths in comments included: a changed byte there would place files again on
# every box, rebuild every env (files/requirements/ is part of its stamp) and restart a running training (its unit).
BOX_BYTES = ("verl_lab_box/", "files/templates/", "files/requirements/", "files/patches/")


@dataclass(frozen=True)
class Step:
    """One pure move: ``after`` is ``before`` with ``moves`` made. ``paths`` and ``dotted`` are the old modules
    read as moved in texts, by file path (``tasks/driver_plan.py``) and by dotted name (``tasks.driver_plan``);
    ``added`` the files the step may add (a folder's ``__init__``); ``edits`` the one edit beyond imports and
    module paths: new file -> ((old text, new text), ...), and why; ``kept``: file -> the texts in it that name old
    paths on purpose (the move's own account), left as they are."""
    name: str
    before: str
    after: str
    moves: dict
    paths: dict
    dotted: dict
    added: tuple = ()
    edits: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)


STEPS = (
    # The move itself: main before it (c34e42d) -> the move commit.
    Step("the move", "c34e42de5886019b6a0110debc33b69ed552a389", "ff111ad17c1a201f649b27c96b542cc6d1a881d7",
         MOVES, MOVES, MOVES,
         added=tuple(sorted([f"tasks/{f}/__init__.py" for f in FOLDERS] + ["tasks/doctor/__main__.py"])),
         edits={"tasks/tracking/hub.py": (
             (('UNIT_TEMPLATE = Path(__file__).resolve().parent.parent / "files"',
               'UNIT_TEMPLATE = REPO_ROOT / "files"'),
              ("from tasks.placed import place, rendered",
               "from tasks.catalog import REPO_ROOT\nfrom tasks.placed import place, rendered")),
             "the file is a folder deeper: the repository's root from tasks.catalog, as the other stages take it")}),
    # main merged in (MERGE, proven below to be git's merge but for its listed conflicts), then its new module moved
    # and its old paths renamed. The merged tree holds both the folders' names and main's old ones: a dotted name
    # that is now a folder (``tasks.driver``, ``tasks.data``) is read as the folder; main's texts hold none of them
    # as the old module (tasks/driver.py is named by its path there).
    Step("main merged in, moved", "49ba15e42f59782bc0783df81711681727cf47b0", "a8c9f0f6f4d516cefef22a62d10f415b9e3b9485",
         MERGED_MOVES, {**MOVES, **MERGED_MOVES},
         {old: new for old, new in {**MOVES, **MERGED_MOVES}.items() if old not in FOLDERS},
         kept={"docs/architecture.md": ("(`tasks/driver_plan.py` -> `tasks/driver/plan.py`)",
                                        "(`tasks/tracking_hub.py` in the TensorBoard unit,\n`tasks/tracking_copy.py` "
                                        "in the box's copy programs, `tasks/driver.py` in the driver's)")}),
)
MERGE = STEPS[1].before
# each file git's merge left in conflict, and how it was resolved: every line of the result is a line of one side
CONFLICTS = {
    "tasks/driver/stage.py": "the folder's imports, plus main's tasks.driver_release",
    "tests/unit/test_driver.py": "main's check-mode test, with the folder's 'from tasks.driver import stage'",
    "docs/architecture.md": "main's new row of the driver release before the folder's rows of the security table",
}
FIRST = STEPS[0]


def renamed_module(dotted: str, step: Step = FIRST) -> str:
    """``tasks.driver_plan`` -> ``tasks.driver.plan`` (and ``tasks.driver_plan.x`` -> ``tasks.driver.plan.x``):
    where the module now is. Any other name is returned as it is."""
    parts = dotted.split(".")
    if len(parts) >= 2 and parts[0] == "tasks" and parts[1] in step.dotted:
        return ".".join(["tasks", *step.dotted[parts[1]].split("/"), *parts[2:]])
    return dotted


@functools.cache
def _pattern(names: tuple[str, ...]) -> re.Pattern:
    alternatives = "|".join(sorted(names, key=len, reverse=True))
    return re.compile(rf"(?<![\w./-])tasks(?P<sep>[./])(?P<old>{alternatives})(?P<py>\.py)?(?![\w])")


def renamed(text: str, step: Step = FIRST) -> str:
    """A text with the moved modules' paths as they are now: ``tasks/driver_plan.py`` -> ``tasks/driver/plan.py``,
    ``tasks.driver_plan`` -> ``tasks.driver.plan``, ``tasks.driver`` -> ``tasks.driver.stage`` (the stage);
    ``tasks.settings``, ``tasks.tracking`` and ``tasks.doctor`` stay: their folders hand on their names."""
    def one(m: re.Match) -> str:
        old = m["old"]
        if m["sep"] == "/":
            if not m["py"] or old not in step.paths:    # tasks/driver_... without .py: a glob or a folder
                return m[0]
            return f"tasks/{step.paths[old]}.py"
        if old not in step.dotted:
            return m[0]
        return "tasks." + (old if old in KEEPS_NAME else step.dotted[old].replace("/", ".")) + (m["py"] or "")
    return _pattern(tuple({**step.paths, **step.dotted})).sub(one, text)


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
    def __init__(self, step: Step) -> None:
        self.step = step

    def visit_Constant(self, node):
        if isinstance(node.value, str):
            return ast.copy_location(ast.Constant(renamed(node.value, self.step)), node)
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


def import_problems(old: list[ast.stmt], new: list[ast.stmt], path: str, read, step: Step = FIRST) -> list[str]:
    """Where the new file's imports do not bind what the old file's did."""
    if len(old) != len(new):
        return [f"{path}: {len(old)} import statements before, {len(new)} after"]
    problems = []
    package = _package(path)
    for o, n in zip(old, new, strict=True):
        was, now = _targets(o, package), _targets(n, package)
        if [b for b, _ in was] != [b for b, _ in now]:
            problems.append(f"{path}:{n.lineno}: binds {[b for b, _ in now]}, before {[b for b, _ in was]}")
            continue
        for (name, before), (_, after) in zip(was, now, strict=True):
            moved = renamed_module(before, step)
            if after == moved:
                continue
            folder, _, attr = after.rpartition(".")
            if moved.startswith(folder + ".") and _origin(read, after) == _origin(read, moved):
                continue                     # the folder hands on what the module it moved to holds
            problems.append(f"{path}:{n.lineno}: {name} is {after}, before {before} (now {moved})")
    return problems


def _comments(text: str) -> list[str]:
    return [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]


def python_problems(old_text: str, new_text: str, path: str, read, step: Step = FIRST) -> list[str]:
    """What differs between two versions of a Python file beyond imports and module paths."""
    for was, now in step.edits.get(path, ((), ""))[0]:
        assert old_text.count(was) == 1, f"{path}: the listed edit's old text is not once in the old file"
        old_text = old_text.replace(was, now)
    old_imports, new_imports = _Imports(), _Imports()
    old_tree = _Strings(step).visit(old_imports.visit(ast.parse(old_text)))
    new_tree = new_imports.visit(ast.parse(new_text))
    problems = []
    if ast.dump(old_tree) != ast.dump(new_tree):
        old_lines, new_lines = ast.unparse(old_tree).splitlines(), ast.unparse(new_tree).splitlines()
        where = next((i for i, (a, b) in enumerate(zip(old_lines, new_lines, strict=False)) if a != b),
                     min(len(old_lines), len(new_lines)))
        problems.append(f"{path}: the code differs beyond imports and module paths, first at (unparsed) "
                        f"{old_lines[where:where + 1]} -> {new_lines[where:where + 1]}")
    if [renamed(c, step) for c in _comments(old_text)] != _comments(new_text):
        moved = (renamed(c, step) for c in _comments(old_text))
        diff = [(a, b) for a, b in zip(moved, _comments(new_text), strict=False) if a != b][:1]
        problems.append(f"{path}: the comments differ beyond module paths: {diff or 'a comment added or dropped'}")
    return problems + import_problems(old_imports.found, new_imports.found, path, read, step)


class _Git:
    """``git cat-file --batch``: one process answers every read of a file at a commit."""

    def __init__(self) -> None:
        self.proc = None
        self.read: dict[tuple[str, str], str | None] = {}

    def text(self, commit: str, path: str) -> str | None:
        if (commit, path) not in self.read:
            self.read[commit, path] = self._text(commit, path)
        return self.read[commit, path]

    def _text(self, commit: str, path: str) -> str | None:
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


def file_problems(status: str, old: str, new: str, step: Step) -> list[str]:
    read_new = lambda p: git_text(step.after, p)        # noqa: E731
    if status == "A":
        return [] if new in step.added else [f"{new}: added by the move"]  # a folder's __init__ (read below)
    if status == "D":
        return [f"{old}: removed by the move"]
    if status == "R" and f"tasks/{step.moves.get(Path(old).stem, '')}.py" != new:
        return [f"{old} -> {new}: not a move of the step's moves"]
    old_text, new_text = git_text(step.before, old), read_new(new)
    if new.endswith(".py"):
        return python_problems(old_text, new_text, new, read_new, step)
    kept = step.kept.get(new, ())
    for i, text in enumerate(kept):
        assert old_text.count(text) == 1, f"{new}: a kept text is not once in the old file: {text!r}"
        old_text = old_text.replace(text, f"\0{i}\0")
    old_text = renamed(old_text, step)
    for i, text in enumerate(kept):
        old_text = old_text.replace(f"\0{i}\0", text)
    return [] if old_text == new_text else [f"{new}: differs beyond module paths"]


def _have(step: Step) -> Step:
    if any(git_text(commit, "tasks/catalog.py") is None for commit in (step.before, step.after)):
        pytest.skip("the move's commits are not in this checkout's history (a shallow clone or an export)")
    return step


def step_problems(step: Step) -> list[str]:
    rows = changed_files(step.before, step.after)
    moved = {Path(old).stem: new for status, old, new in rows if status == "R"}
    want = {old: f"tasks/{new}.py" for old, new in step.moves.items()}
    problems = [] if moved == want else [f"{step.name}: moved {moved}, not {want}"]
    return problems + [p for row in rows for p in file_problems(*row, step)]


# ---------------------------------------------------------------- the proof


@pytest.mark.parametrize("step", STEPS, ids=[s.name for s in STEPS])
def test_every_module_was_moved_as_it_was(step):
    problems = step_problems(_have(step))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("step", STEPS, ids=[s.name for s in STEPS])
def test_the_boxes_are_sent_what_they_were_sent_before(step):
    step = _have(step)
    touched = [new for _, _, new in changed_files(step.before, step.after) if new.startswith(BOX_BYTES)]
    assert touched == [], f"the move changed what the boxes are sent: {touched}"


@pytest.mark.parametrize("step", STEPS, ids=[s.name for s in STEPS])
def test_only_the_folders_files_were_added(step):
    step = _have(step)
    added = sorted(new for status, _, new in changed_files(step.before, step.after) if status == "A")
    assert added == list(step.added)


def merge_problems(merge: str, conflicts: dict) -> list[str]:
    """Where the merge commit is not git's own merge of its two parents: a file that differs from
    ``git merge-tree``'s result, unless it is one of ``conflicts`` (git left it in conflict) with every line of it a
    line of one side (main's side of a moved file is at its path before the move)."""
    out = subprocess.run(["git", "merge-tree", "--write-tree", "--name-only", f"{merge}^1", f"{merge}^2"], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode not in (0, 1) or not out.stdout:
        pytest.skip(f"git merge-tree --write-tree (git 2.38 or later) failed here: {out.stderr.strip()}")
    tree, *rest = out.stdout.split("\n\n")[0].splitlines()
    in_conflict = set(rest)
    problems = [f"{path}: git left it in conflict, not listed in CONFLICTS" for path in sorted(in_conflict - set(conflicts))]
    problems += [f"{path}: listed in CONFLICTS, but git merged it" for path in sorted(set(conflicts) - in_conflict)]
    differ = subprocess.run(["git", "diff", "--name-only", "--no-renames", tree, merge], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()
    for path in differ:
        if path not in conflicts:
            problems.append(f"{path}: not what git's merge made of it, and git merged it without a conflict")
            continue
        before_move = {f"tasks/{new}.py": f"tasks/{old}.py" for old, new in MOVES.items()}.get(path, path)
        sides = {line for parent, where in ((f"{merge}^1", path), (f"{merge}^2", path), (f"{merge}^2", before_move))
                 for line in (git_text(parent, where) or "").splitlines()}
        invented = [line for line in (git_text(merge, path) or "").splitlines() if line not in sides]
        if invented:
            problems.append(f"{path}: the resolution holds lines of neither side: {invented[:2]}")
    return problems


def test_the_merge_is_gits_own_but_for_its_listed_conflicts():
    problems = merge_problems(_have(STEPS[1]).before, CONFLICTS)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("mutation, problem", [
    ("unlisted", "tasks/driver/stage.py: git left it in conflict, not listed in CONFLICTS"),
    ("listed-but-merged", "README.md: listed in CONFLICTS, but git merged it"),
    ("invented-line", "tests/unit/test_driver.py: the resolution holds lines of neither side: ['    assert True']"),
])
def test_the_merge_check_finds_an_unlisted_conflict_and_an_invented_line(mutation, problem, monkeypatch):
    merge = _have(STEPS[1]).before
    conflicts = dict(CONFLICTS)
    if mutation == "unlisted":
        del conflicts["tasks/driver/stage.py"]
    elif mutation == "listed-but-merged":
        conflicts["README.md"] = "not a conflict"
    else:
        real = git_text

        def text(commit, path):
            found = real(commit, path)
            return found + "    assert True\n" if (commit, path) == (merge, "tests/unit/test_driver.py") else found
        monkeypatch.setattr(sys.modules[__name__], "git_text", text)
    assert problem in merge_problems(merge, conflicts)


def test_the_second_step_finds_a_text_renamed_that_the_move_keeps():
    step = _have(STEPS[1])
    problems = step_problems(Step(step.name, step.before, step.after, step.moves, step.paths, step.dotted))
    assert problems == ["docs/architecture.md: differs beyond module paths"]


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
    failed = False
    for step in STEPS:
        print(f"{step.name}: {step.before[:7]} -> {step.after[:7]}")
        for status, old, new in changed_files(step.before, step.after):
            problems = file_problems(status, old, new, step)
            failed = failed or bool(problems)
            same = "added" if status == "A" else "as it was, but for imports and module paths"
            print(f"  {status} {old}{' -> ' + new if new != old else ''}: {'; '.join(problems) or same}")
    merged = merge_problems(MERGE, CONFLICTS)
    print("the merge:", "; ".join(merged) or f"git's own, but for {len(CONFLICTS)} conflicts resolved with both sides' lines")
    sys.exit(1 if failed or merged else 0)
