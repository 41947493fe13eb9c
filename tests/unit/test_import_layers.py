"""Layers that only look down (docs/architecture.md, "The layers"): the import graph of tasks/,
top-level and function-level imports alike, has no cycle; no module imports a stage module
unless it is a stage itself (a stage module is one that defines a pyinfra ``@deploy``: its
``install_<stage>``, the base stage's ``base_layout``, the env stage's verl source); and each
folder of tasks/ (or a module alone) is on a floor of ``FLOORS``, importing only from its own floor
and those below. Each module, imported first and alone, loads no stage module unless it is one.

``python -m tests.unit.test_import_layers`` draws the map of the folders and their imports that
docs/architecture.md shows (``draw_map``); a test keeps the two equal."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from itertools import pairwise
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KNOWN_STAGES = {"tasks.base", "tasks.driver.stage", "tasks.cuda", "tasks.env", "tasks.data.stage", "tasks.train",
                "tasks.cluster"}

# The floors, bottom first: (what they hold, the folders and modules on them). A folder's stage modules are on the
# top floor, the stages', whichever folder holds them; the folder's other modules are on its floor.
FLOORS = (
    ("what to install (files/catalog.toml) and verl's console output, read", ("tasks.catalog", "tasks.status")),
    ("what a box has now (one command per fact)", ("tasks.facts",)),
    ("how a stage writes: files in place, a failed host, a verified download",
     ("tasks.placed", "tasks.failure", "tasks.fetch")),
    ("a host's settings, checked first (the tracking setting's folder with them)",
     ("tasks.settings", "tasks.tracking")),
    ("pure decisions (and the readings of a run's logs)",
     ("tasks.plan", "tasks.memory", "tasks.speed", "tasks.checkpoints", "tasks.evaluation", "tasks.gpu_support",
      "tasks.verl", "tasks.data", "tasks.driver", "tasks.burnin", "tasks.doctor", "tasks.plots")),
    ("the host's GPU target, decided once", ("tasks.target",)),
    ("every host's problems, before any host changes", ("tasks.validation",)),
    ("what the stages share: a host's data and cluster, its run's bounds and summary, artifacts on a box",
     ("tasks.hostdata", "tasks.run_bounds", "tasks.run_summary", "tasks.artifacts")),
)
STAGE_FLOOR = "the stages: facts in, operations out (each defines a pyinfra @deploy; a stage may import a stage)"


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package ``root/tasks``: dotted name -> file."""
    found = {}
    for path in sorted((root / "tasks").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """The modules of ``known`` that ``name`` imports anywhere in its file, with the line: ``import
    tasks.x``, ``from tasks.x import y`` (``tasks.x.y`` where it is a module, else ``tasks.x``),
    ``from . import y``. A package a module is imported from runs first anyway: not counted."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            named = [f"{base}.{a.name}" for a in node.names]
            # from a package, its modules only: the package itself where a name is not one of them
            targets = named + [base] * any(n not in known for n in named)
        else:
            continue
        for target in targets:
            while target and target not in known:      # import tasks.facts.gpu.x -> tasks.facts.gpu
                target = target.rpartition(".")[0]
            if target and target != name and target != "tasks":
                found.append((target, node.lineno))
    return found


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of its first such import}."""
    known = modules(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges = graph.setdefault(name, {})
        for target, line in imports(name, path, known):
            edges.setdefault(target, line)
    return graph


def stage_modules(root: Path) -> set[str]:
    """The modules that define a top-level function decorated with pyinfra's ``@deploy(...)``."""
    found = set()
    for name, path in modules(root).items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    call = dec.func if isinstance(dec, ast.Call) else dec
                    if (isinstance(call, ast.Name) and call.id == "deploy") or \
                            (isinstance(call, ast.Attribute) and call.attr == "deploy"):
                        found.add(name)
    return found


def cycles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], list[str]]]:
    """Each set of modules that import each other (a strongly connected component), sorted, with
    one cycle through its first module as a path ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for component in components:            # a shortest way back to the component's first module
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in component and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        found.append((sorted(component), paths[last] + [start]))
    return found


def unit(name: str) -> str:
    """The folder or top-level module a module is in: ``tasks.driver.plan`` -> ``tasks.driver``."""
    return ".".join(name.split(".")[:2])


def floor_problems(graph: dict[str, dict[str, int]], stages: set[str],
                   floors: tuple[tuple[str, tuple[str, ...]], ...]) -> list[str]:
    """Each folder or module on no floor, and each import of a module on a higher floor than the importer's."""
    floor_of = {u: i for i, (_, units) in enumerate(floors) for u in units}
    placed = {name for name in graph if name == "tasks" or name in stages or unit(name) in floor_of}
    problems = [f"{u} is on no floor of FLOORS (tests/unit/test_import_layers.py): put it on the lowest floor "
                "at or above everything it imports, and in docs/architecture.md's map"
                for u in sorted({unit(n) for n in graph if n not in placed})]
    for name in sorted(placed - stages - {"tasks"}):
        mine = floor_of[unit(name)]
        for target, line in sorted(graph[name].items()):
            if target in stages or target == "tasks" or unit(target) not in floor_of:
                continue
            theirs = floor_of[unit(target)]
            if theirs > mine:
                problems.append(f"{name} (line {line}) imports {target}, on the floor of {floors[theirs][0]!r}, above "
                                f"its own ({floors[mine][0]!r}): a module looks only down; move what it needs "
                                "down, or the folder up (FLOORS)")
    return problems


def layer_problems(root: Path, floors=None) -> list[str]:
    graph, stages = import_graph(root), stage_modules(root)
    # each module of a cycle with the line of its import of the next
    problems = [f"import cycle among {', '.join(among)}: "
                + " -> ".join(f"{a} (line {graph[a][b]})" for a, b in pairwise(c)) + f" -> {c[0]}"
                for among, c in cycles(graph)]
    for name in sorted(graph):
        if name not in stages:
            problems += [f"{name} (line {line}) imports the stage module {target}: a module below the stages "
                         "must not look up; move what it needs below the stages" for target, line
                         in sorted(graph[name].items()) if target in stages]
    if floors is not None:
        problems += floor_problems(graph, stages, floors)
    return problems


def test_tasks_imports_only_look_down():
    assert KNOWN_STAGES <= stage_modules(REPO), "a stage module no longer defines its @deploy: fix stage_modules"
    problems = layer_problems(REPO, FLOORS)
    assert not problems, "\n".join(problems)


LOAD_ALONE = """
import importlib, json, sys
names, stages, found = json.loads(sys.argv[1]), set(json.loads(sys.argv[2])), []
for name in names:
    for loaded in [m for m in sys.modules if m == "tasks" or m.startswith("tasks.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        found.append(f"{name}, imported first: {type(exc).__name__}: {exc}")
        continue
    up = sorted(stages & set(sys.modules)) if name not in stages else []
    if up:
        found.append(f"{name}, imported first, loads the stage modules {up} (a folder's __init__ importing its stage?)")
print(json.dumps(found))
"""


def modules_loaded_alone(root: Path) -> list[str]:
    """Each module of tasks/ imported first in a process (the tasks modules before it unloaded): what fails,
    and each module below the stages that loads a stage module all the same (an ``__init__`` importing its
    folder's stage runs whenever any module of the folder is imported; an import the AST does not show)."""
    names = sorted(n for n in modules(root) if not n.endswith("__main__"))
    res = subprocess.run([sys.executable, "-c", LOAD_ALONE, json.dumps(names), json.dumps(sorted(stage_modules(root)))],
                         cwd=root, capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def test_each_module_imported_first_works_and_below_the_stages_loads_no_stage():
    problems = modules_loaded_alone(REPO)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ the map docs/architecture.md shows

MAP_START = "<!-- the map: python -m tests.unit.test_import_layers (tests/unit/test_import_layers.py) -->"
MAP_END = "<!-- end of the map -->"


def _label(name: str, stages: set[str], known: dict[str, Path]) -> str:
    """``tasks/driver/`` for a folder's modules below the stages, ``driver/stage.py`` for a stage, ``hostdata.py``."""
    if name in stages:
        return known[name].relative_to(known["tasks"].parent).as_posix()
    u = unit(name)
    return u.split(".")[1] + ("/" if known[u].name == "__init__.py" else ".py")


def draw_map(root: Path, floors=FLOORS) -> str:
    """The folders and their imports, floor by floor from the top: each folder (or module alone) with the folders
    and modules it imports (a stage module on its own line)."""
    graph, stages, known = import_graph(root), stage_modules(root), modules(root)
    edges: dict[str, set[str]] = {}
    for name, targets in graph.items():
        if name == "tasks":
            continue
        mine = _label(name, stages, known)
        edges.setdefault(mine, set()).update(_label(t, stages, known) for t in targets if t != "tasks")
        edges[mine].discard(mine)
    floor_of = {_label(n, stages, known): len(floors) if n in stages else
                next(i for i, (_, units) in enumerate(floors) if unit(n) in units)
                for n in graph if n != "tasks"}
    width = max(map(len, edges)) + 2
    lines = []
    for i in range(len(floors), -1, -1):
        title = STAGE_FLOOR if i == len(floors) else floors[i][0]
        lines.append(f"{i} {title}")
        for label in sorted(l for l in edges if floor_of[l] == i):
            by_floor = sorted(edges[label], key=lambda t: (-floor_of[t], t))
            text = " ".join(by_floor) if by_floor else "(nothing of tasks/)"
            wrapped = textwrap.wrap(text, 116 - width - 5) or [""]
            lines.append(f"  {label.ljust(width)}-> {wrapped[0]}")
            lines += [" " * (width + 5) + rest for rest in wrapped[1:]]
    return "\n".join(lines) + "\n"


def test_the_architecture_map_is_the_import_graph():
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert MAP_START in doc and MAP_END in doc, "docs/architecture.md lost its map's markers"
    shown = doc.split(MAP_START)[1].split(MAP_END)[0].strip().removeprefix("```").removesuffix("```").strip("\n")
    assert shown + "\n" == draw_map(REPO), ("docs/architecture.md's map is not the import graph now: "
                                          "python -m tests.unit.test_import_layers prints it")


PLAN_MODULE_MAX_LINES = 400


@pytest.mark.parametrize("package", ["plan", "memory"])
def test_the_plan_and_the_memory_model_are_packages_of_small_modules(package):
    """tasks/plan/ and tasks/memory/ hold one decision a module (docs/architecture.md, "The plan
    package"); none grows past PLAN_MODULE_MAX_LINES: split it along its next seam instead."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in sorted((REPO / "tasks" / package).glob("*.py"))}
    assert {"__init__.py", "__main__.py", "cli.py"} <= set(sizes), sorted(sizes)
    over = {name: n for name, n in sizes.items() if n > PLAN_MODULE_MAX_LINES}
    assert not over, f"modules of tasks/{package}/ over {PLAN_MODULE_MAX_LINES} lines: {over}"


# ------------------------------------------------------------------ the check itself, on made-up trees


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"tasks/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


STAGE = "from pyinfra.api import deploy\n\n@deploy('s')\ndef install_s():\n    {}\n"


def test_a_cycle_through_a_function_level_import_is_named_edge_by_edge(tmp_path):
    root = _tree(tmp_path, {"tasks/plan/__init__.py": "from tasks.plan.types import X\n",
                            "tasks/plan/types.py": "X = 1\n",
                            "tasks/target.py": "from tasks.plan import X\n",
                            "tasks/validation.py": "def f():\n    from tasks import target\n",
                            "tasks/plan/cli.py": "import tasks.validation\n",
                            "tasks/plan/other.py": "from . import types\n"})
    assert import_graph(root)["tasks.plan.other"] == {"tasks.plan.types": 1}
    assert layer_problems(root) == []
    (root / "tasks/plan/types.py").write_text("X = 1\n\n\ndef g():\n    from tasks.plan.cli import main\n")
    assert layer_problems(root) == [
        "import cycle among tasks.plan, tasks.plan.cli, tasks.plan.types, tasks.target, tasks.validation: "
        "tasks.plan (line 1) -> tasks.plan.types (line 5) -> tasks.plan.cli (line 1) -> "
        "tasks.validation (line 2) -> tasks.target (line 1) -> tasks.plan"]


def test_a_module_below_the_stages_importing_a_stage_is_named_with_its_line(tmp_path):
    root = _tree(tmp_path, {"tasks/data/stage.py": STAGE.format("from tasks.data.plan import plan"),
                            "tasks/cluster.py": STAGE.format("from tasks.data import stage"),
                            "tasks/data/plan.py": "def plan():\n    pass\n",
                            "tasks/hostdata.py": "import os\n"})
    assert stage_modules(root) == {"tasks.data.stage", "tasks.cluster"}
    assert layer_problems(root) == []               # a stage may import a stage, and anything below it
    (root / "tasks/hostdata.py").write_text("import os\n\n\ndef f():\n    from tasks.cluster import install_s\n")
    assert layer_problems(root) == [
        "tasks.hostdata (line 5) imports the stage module tasks.cluster: a module below the stages must not "
        "look up; move what it needs below the stages"]


def test_a_back_import_into_a_folder_on_a_higher_floor_is_named_with_its_line(tmp_path):
    floors = (("settings", ("tasks.settings", "tasks.tracking")), ("decisions", ("tasks.driver", "tasks.plan")))
    root = _tree(tmp_path, {"tasks/settings/__init__.py": "from tasks.settings.errors import SettingsError\n",
                            "tasks/settings/errors.py": "class SettingsError(Exception):\n    pass\n",
                            "tasks/settings/load.py": "from tasks.tracking.setting import Tracking\n",
                            "tasks/tracking/setting.py": "Tracking = 1\n",
                            "tasks/driver/__init__.py": "from tasks.driver.choice import choose\n",
                            "tasks/driver/choice.py": "from tasks.settings import SettingsError\n\n\ndef choose():\n"
                                                      "    from tasks.plan import x\n",
                            "tasks/driver/stage.py": STAGE.format("from tasks.driver import choose"),
                            "tasks/plan/__init__.py": "x = 1\n"})
    assert layer_problems(root, floors) == []     # down, across a floor, and a stage anywhere
    (root / "tasks/tracking/setting.py").write_text("Tracking = 1\n\n\ndef f():\n    from tasks.plan import x\n")
    assert layer_problems(root, floors) == [
        "tasks.tracking.setting (line 5) imports tasks.plan, on the floor of 'decisions', above its own "
        "('settings'): a module looks only down; move what it needs down, or the folder up (FLOORS)"]
    (root / "tasks/verl/rules.py").parent.mkdir()
    (root / "tasks/verl/rules.py").write_text("")
    assert layer_problems(root, floors)[0].startswith("tasks.verl is on no floor of FLOORS")


def test_a_folders_init_that_imports_its_stage_loads_it_with_any_of_its_modules(tmp_path):
    root = _tree(tmp_path, {"tasks/driver/__init__.py": "",
                            "tasks/driver/choice.py": "X = 1\n",
                            "tasks/driver/stage.py": STAGE.format("from tasks.driver.choice import X")})
    assert modules_loaded_alone(root) == []
    (root / "tasks/driver/__init__.py").write_text("import importlib\n\n"
                                                   "importlib.import_module('tasks.driver.stage')\n")
    assert modules_loaded_alone(root) == [
        "tasks.driver, imported first, loads the stage modules ['tasks.driver.stage'] (a folder's __init__ importing "
        "its stage?)",
        "tasks.driver.choice, imported first, loads the stage modules ['tasks.driver.stage'] (a folder's __init__ "
        "importing its stage?)"]


if __name__ == "__main__":
    print(draw_map(REPO), end="")
