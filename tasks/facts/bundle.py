"""Several facts in one remote command.

Every ``host.get_fact`` is one SSH round trip (~50-70 ms on a LAN, more across the world). A
stage that needs five facts to decide that it has nothing to do asks them as one ``Bundle``:
each fact's own command runs in a subshell of one shell script, its stdout is framed by a
header line naming the fact, and each section goes to that fact's own ``process``. So the
answers are exactly what ``host.get_fact`` would have given, with pyinfra's rules kept:

* a section without output gives the fact's ``default()``;
* a fact command that exits non-zero makes the whole bundle exit with that status after
  every section ran (pyinfra then fails this host, as it would for the single fact, and
  prints the output).

Facts with ``requires_command`` are not bundled (their missing-command rule is pyinfra's).
"""

from __future__ import annotations

import importlib
from typing import Any

from pyinfra.api import FactBase, StringCommand

HEADER = "@@verl-lab-bundle@@"


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _load(name: str) -> type:
    module, _, qual = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _text(cmd) -> str:
    return cmd.get_raw_value() if isinstance(cmd, StringCommand) else str(cmd)


class Bundle(FactBase[list]):
    """``facts``: ``[(FactClass, {kwargs}), ...]``; returns their answers, in order, as a list
    (None, pyinfra's default, only where the bundle gave no output: ``ask`` handles it)."""

    def command(self, facts: list) -> str:
        parts = ["rc=0"]
        for i, (cls, kwargs) in enumerate(facts):
            fact = cls()
            if fact.requires_command(**kwargs):
                raise ValueError(f"{cls.__name__} has requires_command: ask it on its own")
            parts.append(f"echo '{HEADER} {i} {_name(cls)}'")
            parts.append(f"( {_text(fact.command(**kwargs))}\n) || rc=$?")
        parts.append(f"echo '{HEADER} end'")
        parts.append("exit $rc")
        return "\n".join(parts)

    def process(self, output) -> list:
        sections: list[tuple[type, list[str]]] = []
        for line in output:
            if line.startswith(HEADER):
                words = line.split()
                if len(words) == 3:
                    sections.append((_load(words[2]), []))
                continue
            if sections:
                sections[-1][1].append(line)
        answers = []
        for cls, lines in sections:
            fact = cls()
            answers.append(fact.process(lines) if lines else fact.default())
        return answers


def ask(*facts: tuple[type, dict]) -> list:
    """The answers of several facts of the current host, in one command."""
    from pyinfra import host

    answers = host.get_fact(Bundle, facts=list(facts))
    if not isinstance(answers, list) or len(answers) != len(facts):
        # the bundle failed (the host is marked failed by pyinfra): give each fact its default
        return [cls().default() for cls, _ in facts]
    return answers
