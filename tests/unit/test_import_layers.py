"""Layers that only look down (docs/architecture.md, "The layers"): the import graph of tasks/,
top-level and function-level imports alike, has no cycle, and no module imports a stage module
unless it is a stage itself. A stage module is one that defines a pyinfra ``@deploy`` (its
``install_<stage>``, the base stage's ``base_layout``, the env stage's verl source)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KNOWN_STAGES = {"tasks.base", "tasks.driver.stage", "tasks.cuda", "tasks.env", "tasks.data.stage", "tasks.train", "tasks.cluster"}


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


def layer_problems(root: Path) -> list[str]:
    graph, stages = import_graph(root), stage_modules(root)
    # each module of a cycle with the line of its import of the next
    problems = [f"import cycle among {', '.join(among)}: "
                + " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[0]}"
                for among, c in cycles(graph)]
    for name in sorted(graph):
        if name not in stages:
            problems += [f"{name} (line {line}) imports the stage module {target}: a module below the stages "
                         "must not look up; move what it needs below the stages" for target, line
                         in sorted(graph[name].items()) if target in stages]
    return problems


def test_tasks_imports_only_look_down():
    assert KNOWN_STAGES <= stage_modules(REPO), "a stage module no longer defines its @deploy: fix stage_modules"
    problems = layer_problems(REPO)
    assert not problems, "\n".join(problems)


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
                            "tasks/cluster.py": STAGE.format("from tasks import data"),
                            "tasks/data/plan.py": "def plan():\n    pass\n",
                            "tasks/hostdata.py": "import os\n"})
    assert stage_modules(root) == {"tasks.data.stage", "tasks.cluster"}
    assert layer_problems(root) == []               # a stage may import a stage, and anything below it
    (root / "tasks/hostdata.py").write_text("import os\n\n\ndef f():\n    from tasks.cluster import install_s\n")
    assert layer_problems(root) == [
        "tasks.hostdata (line 5) imports the stage module tasks.cluster: a module below the stages must not "
        "look up; move what it needs below the stages"]
