"""verl-lab: an env against its lock, without importing what it checks (env_prove.py runs it, quick or full).

* ``lock_problems``: every distribution the env's lock pins (the plan's constraints: torch's requirements,
  files/requirements/verl-0.5.0.txt, build-tools.txt, the cu118 xformers) is installed at its pinned version,
  and so is everything those and verl itself need (each one's ``Requires-Dist``, with its extras and markers,
  read from the installed metadata), at a version it accepts.
* ``import_problems``: every module verl's trainer imports when it loads (the module-level imports of
  ``verl.trainer.main_ppo``, ``verl.trainer.ppo.ray_trainer``, the FSDP workers and the HF rollout, followed
  through verl's own modules by reading their source) is found on the env's path.

Both read files only: the dist-info folders on ``sys.path`` and verl's ``.py`` files (``ast``). Requirements
and markers are read with ``packaging`` (the env's own, else the copy inside pip: both are pinned in the lock).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys

# what verl 0.5.0's trainer loads on every plan: the entry point, the trainer, its FSDP workers and the HF
# rollout. verl's vLLM rollout imports vLLM's own needs (pyzmq...): those are vLLM's Requires-Dist, which the
# lock check follows from the vllm distribution
TRAINER_MODULES = ("verl.trainer.main_ppo", "verl.trainer.ppo.ray_trainer", "verl.workers.fsdp_workers",
                   "verl.workers.rollout.hf_rollout")
SHOWN = 6             # problems named in full; the rest counted


def normalize(name: str) -> str:
    """A distribution's name as PEP 503 compares them (``Hydra_Core`` -> ``hydra-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def same_version(have: str, pin: str) -> bool:
    """A pin without a local label (+cu118) matches any local build of that version."""
    return have == pin if "+" in pin else have.split("+", 1)[0] == pin


def installed(path=None) -> dict[str, tuple[str, str]]:
    """Every distribution on ``path`` (default ``sys.path``): normalized name -> (version, its metadata
    file), the first found winning as it does for an import. Read from the folder names
    (``name-version.dist-info``), not by importlib.metadata."""
    found = {}
    for entry in path if path is not None else sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        for folder in os.listdir(entry):
            if folder.endswith(".dist-info"):
                meta = "METADATA"
            elif folder.endswith(".egg-info"):
                meta = "PKG-INFO"
            else:
                continue
            name, _, version = folder.rsplit(".", 1)[0].partition("-")
            version = version.split("-py", 1)[0]
            found.setdefault(normalize(name), (version, os.path.join(entry, folder, meta)))
    return found


def requires(metadata_file: str) -> list[str]:
    """The ``Requires-Dist`` lines of a distribution's metadata (the header part only)."""
    out = []
    try:
        with open(metadata_file, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    break
                if line.startswith("Requires-Dist:"):
                    out.append(line[len("Requires-Dist:"):].strip())
    except OSError:
        pass
    return out


def _packaging():
    """packaging's Requirement: the env's own, else the copy vendored in pip."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def lock_problems(pins: list[str], roots: list[str], path=None) -> tuple[int, list[str]]:
    """(distributions checked, problems): each pin ``name==version`` installed at that version, and every
    requirement of the pinned distributions and of ``roots`` (e.g. ``verl``) installed at a version it
    accepts, followed to the bottom. Each problem names the distribution, what is there and who needs it."""
    have = installed(path)
    requirement = _packaging()
    problems, pinned = [], {}
    for line in pins:
        name, _, version = line.partition("==")
        bare = normalize(name.split("[", 1)[0].strip())
        pinned[bare] = version.strip()
        got = have.get(bare)
        if got is None:
            problems.append(f"{bare}: not installed (the lock pins {bare}=={pinned[bare]})")
        elif not same_version(got[0], pinned[bare]):
            problems.append(f"{bare}: {got[0]} installed, the lock pins {pinned[bare]}")
    todo = [(normalize(r), ("",), "the plan") for r in roots] + [(n, ("",), "the lock") for n in pinned]
    todo += [(normalize(line.split("==", 1)[0].split("[", 1)[0]), tuple(_extras(line)) or ("",), "the lock")
             for line in pins if "[" in line.split("==", 1)[0]]
    seen = set()
    while todo:
        name, extras, wanted_by = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        got = have.get(name)
        if got is None:
            if name not in pinned:
                problems.append(f"{name}: not installed (needed by {wanted_by})")
            continue
        for line in requires(got[1]):
            if _only_for_other_extras(line, extras):
                continue
            try:
                req = requirement(line)
                if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
                    continue
            except ValueError:               # metadata packaging cannot read: pip installed it, not ours to judge
                continue
            dep, by = normalize(req.name), f"{name} {got[0]}: {line.split(';', 1)[0].strip()}"
            there = have.get(dep)
            if there is not None and not _accepts(req.specifier, there[0]):
                problems.append(f"{dep}: {there[0]} installed, {by}")
            if there is None and dep in pinned:
                continue                     # named above, as the lock's
            todo.append((dep, tuple(sorted(req.extras)) or ("",), by))
    return len({n for n, _ in seen}), sorted(dict.fromkeys(problems))


EXTRA_RE = re.compile(r"""\bextra\s*==\s*["']([^"']+)["']""")


def _only_for_other_extras(line: str, extras: tuple[str, ...]) -> bool:
    """Whether a requirement's marker asks only for extras not wanted here (``; extra == "dev"``): most of a
    distribution's lines, skipped before packaging parses them."""
    marker = line.partition(";")[2]
    named = EXTRA_RE.findall(marker)
    return bool(named) and " or " not in marker and not {normalize(n) for n in named} & {normalize(e) for e in extras}


def _accepts(specifier, version: str) -> bool:
    try:
        return not specifier or specifier.contains(version, prereleases=True)
    except ValueError:                       # a version that is not PEP 440's: nothing to compare
        return True


def _extras(line: str) -> list[str]:
    inside = line.split("==", 1)[0].partition("[")[2].rstrip("]")
    return [e.strip() for e in inside.split(",") if e.strip()]


def _source(module: str, root: str) -> str | None:
    """The file of verl's ``module`` under ``root`` (the folder holding ``verl/``), or None."""
    base = os.path.join(root, *module.split("."))
    for candidate in (os.path.join(base, "__init__.py"), base + ".py"):
        if os.path.isfile(candidate):
            return candidate
    return None


TOP_IMPORT = re.compile(r"(?:from[ \t]+(\.*)([\w.]*)[ \t]+import\b|import\b)(.*)", re.S)


def top_imports(source: str) -> list[tuple[int, str, list[str]]]:
    """(level, module, names) of each import at a module's top level: what loading it runs, whatever happens.
    An import inside a function, a class, an ``if`` or a ``try`` is the module's own choice and is not followed.

    Read line by line (such an import starts at column 0, outside a triple-quoted string: several times faster
    than ``ast``); a file this reading is not sure of (a line with both kinds of triple quote, an import with a
    backslash or a ";") is parsed with ``ast`` instead. tests/unit/test_env_lock.py: the same answer as ``ast``
    on every file of the patched verl 0.5.0."""
    out, quote, lines, i = [], None, source.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if '"""' in line and "'''" in line:
            return ast_imports(source)
        if quote:
            quote = None if line.count(quote) % 2 else quote
            continue
        quote = next((q for q in ('"""', "'''") if line.count(q) % 2), None)
        if quote or not line.startswith(("import", "from")) or not TOP_IMPORT.match(line):
            continue
        statement = line.split("#", 1)[0]
        while "(" in statement and ")" not in statement and i < len(lines):
            statement += " " + lines[i].split("#", 1)[0]
            i += 1
        if statement.rstrip().endswith("\\") or ";" in statement:
            return ast_imports(source)
        dots, module, rest = TOP_IMPORT.match(statement).groups()
        names = [n.split()[0] for n in rest.replace("(", " ").replace(")", " ").split(",") if n.strip()]
        out += [(0, n, []) for n in names] if module is None else [(len(dots), module, names)]
    return out


def ast_imports(source: str) -> list[tuple[int, str, list[str]]]:
    """``top_imports`` by Python's own parser."""
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            out += [(0, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or "", [a.name for a in node.names]))
    return out


def _absolute(level: int, name: str, module: str, is_package: bool) -> str:
    if not level:
        return name
    parts = (module if is_package else module.rpartition(".")[0]).split(".")
    base = ".".join(parts[:len(parts) - level + 1])
    return f"{base}.{name}" if name else base


def import_problems(verl_root: str, roots=TRAINER_MODULES) -> tuple[int, list[str]]:
    """(verl modules read, problems): every module the top-level imports of ``roots`` reach, through verl's
    own modules (and their packages' ``__init__``), is found: verl's as a file under ``verl_root``, any
    other by its top-level name on the path (``importlib.util.find_spec`` of a top-level name loads nothing)."""
    todo, seen, outside, problems = list(roots), set(), {}, []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        path = _source(module, verl_root)
        if path is None:
            problems.append(f"{module}: no such module under {verl_root}")
            continue
        with open(path, encoding="utf-8") as fh:
            found = top_imports(fh.read())
        for level, name, names in found:
            name = _absolute(level, name, module, path.endswith("__init__.py"))
            if name.split(".")[0] != "verl":
                outside.setdefault(name.split(".")[0], module)
                continue
            todo += [name] + [f"{name}.{n}" for n in names if _source(f"{name}.{n}", verl_root)]
    for top, by in sorted(outside.items()):
        if top not in sys.builtin_module_names and importlib.util.find_spec(top) is None:
            problems.append(f"module {top}: not found (imported by {by} when it loads)")
    return len(seen), sorted(problems)


def shown(problems: list[str]) -> str:
    """The first problems in full, the rest counted."""
    more = len(problems) - SHOWN
    return "; ".join(problems[:SHOWN]) + (f"; and {more} more" if more > 0 else "")
