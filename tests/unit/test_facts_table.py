"""Every fact of tasks/facts/ against what boxes printed, in pyinfra's own way (its tests/facts/<module>.<Fact>/<case>.json).

``tests/fixtures/facts/<module>.<Fact>/<case>.json`` holds the fact's keyword arguments
(``arg``), the shell command they make (``command``: what the box runs, kept byte for byte: the
e2e boxes and the bench rely on it), what the box printed (``output``, one string a line) and
the fact's answer (``fact``); ``note`` says where the output comes from. Outputs were recorded
by running the commands on a dev machine (paths moved under /opt/verl-lab), taken from the lent
H200 box, or are the garbled and partial outputs a fact is written to survive. An empty
``output`` is answered by the fact's ``default()``, as pyinfra does.

Each case is also answered through a bundle of one (tasks/facts/bundle.py), which must give
the same answer. The conventions every fact keeps are checked per class below.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import get_origin

import pytest
from pyinfra.api import FactBase

from tasks.facts.bundle import HEADER, Bundle, _name, _text
from tasks.facts.env import LOCK_SCRIPT, PROVE_SCRIPT

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "facts"
MODULES = ("burnin", "cluster", "data", "disk", "driver", "endpoint", "env", "export", "files", "gpu", "logs", "memory",
           "nvidia")
# a command that carries a file's text carries a name for it in the case instead
PLACEHOLDERS = {PROVE_SCRIPT: "<verl_lab_box/env_prove.py>", LOCK_SCRIPT: "<verl_lab_box/env_lock.py>"}


def fact_classes() -> list[type]:
    found = []
    for name in MODULES:
        module = importlib.import_module(f"tasks.facts.{name}")
        found += [obj for obj in vars(module).values() if isinstance(obj, type) and issubclass(obj, FactBase)
                  and obj.__module__ == module.__name__]
    return found


def fact_dir(cls: type) -> str:
    return f"{cls.__module__.rsplit('.', 1)[1]}.{cls.__name__}"


def cases() -> list:
    classes = {fact_dir(cls): cls for cls in fact_classes()}
    params = []
    for path in sorted(FIXTURES.glob("*/*.json")):
        cls = classes.get(path.parent.name)
        params.append(pytest.param(cls, path, id=f"{path.parent.name}/{path.stem}"))
    return params


def command_of(cls: type, arg: dict) -> str:
    command = _text(cls().command(**arg))
    for path, name in PLACEHOLDERS.items():
        command = command.replace(path.read_text(), name)
    return command


def answer_of(cls: type, output: list[str]):
    """What host.get_fact answers for this output: no output is the default."""
    fact = cls()
    return _plain(fact.process(output) if output else fact.default())


def _plain(answer):
    """The GPU fact answers a GpuInventory: compared as its JSON."""
    return json.loads(answer.to_json()) if hasattr(answer, "to_json") else answer


@pytest.mark.parametrize("cls,path", cases())
def test_fact_case(cls, path):
    assert cls is not None, f"{path.parent.name}: no such fact in tasks/facts/{{{','.join(MODULES)}}}.py"
    case = json.loads(path.read_text())
    assert command_of(cls, case["arg"]) == case["command"]
    answer = answer_of(cls, case["output"])
    assert answer == case["fact"]
    # the same answer when the fact is asked in a bundle (its output framed by header lines)
    assert _text(cls().command(**case["arg"])) in Bundle().command(facts=[(cls, case["arg"])])
    framed = [f"{HEADER} 0 {_name(cls)}", *case["output"], f"{HEADER} end"]
    assert [_plain(a) for a in Bundle().process(framed)] == [answer]


@pytest.mark.parametrize("cls", fact_classes(), ids=fact_dir)
def test_fact_conventions(cls):
    """Typed ``FactBase[T]``; a docstring that names the default; ``default()`` is also what the
    fact makes of no output (alone, pyinfra never calls ``process`` with none; in a bundle the
    same); no ``requires_command`` (each command handles a missing tool itself, and the bundle
    refuses such facts); at least one recorded case."""
    assert any(get_origin(base) is FactBase for base in getattr(cls, "__orig_bases__", ())), \
        f"{cls.__name__} is not FactBase[T]"
    assert "default" in (cls.__doc__ or ""), f"{cls.__name__}'s docstring does not say its default"
    assert cls().process([]) == cls().default()
    assert cls.requires_command is FactBase.requires_command
    assert list((FIXTURES / fact_dir(cls)).glob("*.json")), f"no case for {cls.__name__}"
