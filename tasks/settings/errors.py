"""How a bad inventory value is told: ``SettingsError`` (host, key, value, fix), ``SettingsErrors``
(every problem found, not only the first) and ``Problems``, which collects what each checker of
tasks/settings/load.py and the folder's other modules raises; ``did_you_mean`` for a near-miss value.

Pure; imports nothing of the project. ``tasks.settings`` re-exports these names: they are the
errors ``load_settings`` raises.
"""

from __future__ import annotations

import difflib
from typing import Any


class SettingsError(ValueError):
    """A bad inventory value. ``str()`` names the host, the key, the value and the fix."""

    def __init__(self, host: str, key: str, problem: str, fix: str):
        self.host, self.key, self.problem, self.fix = host, key, problem, fix
        super().__init__(f"host {host}: {key}: {problem}. Fix: {fix}")

    @property
    def problems(self) -> list[SettingsError]:
        return [self]


class SettingsErrors(SettingsError):
    """Every problem found (of one host, or of the whole inventory), not only the first: one line
    each in ``str()``; ``problems`` lists them; host/key/problem/fix are the first one's."""

    def __init__(self, problems: list[SettingsError]):
        self._problems = [each for p in problems for each in p.problems]
        first = self._problems[0]
        self.host, self.key, self.problem, self.fix = first.host, first.key, first.problem, first.fix
        ValueError.__init__(self, "\n".join(str(p) for p in self._problems))

    @property
    def problems(self) -> list[SettingsError]:
        return list(self._problems)


class Problems:
    """What is wrong with one host's data, every problem of it. A checker is a function
    ``check(host, *args) -> value`` that raises ``SettingsError`` (or ``SettingsErrors`` for several);
    ``problems.check(checker, *args, default=...)`` records what it raises and gives ``default``
    instead, so the checks after it still run. ``raise_any()`` raises them all at once."""

    def __init__(self, host: str):
        self.host = host
        self.found: list[SettingsError] = []

    def add(self, key: str, problem: str, fix: str) -> None:
        self.found.append(SettingsError(self.host, key, problem, fix))

    def check(self, checker, *args, default=None):
        try:
            return checker(self.host, *args)
        except SettingsError as exc:
            self.found.extend(exc.problems)
            return default

    def raise_any(self) -> None:
        if self.found:
            raise SettingsErrors(self.found)


def did_you_mean(value: Any, allowed) -> str:
    """'did you mean X? ' where ``value`` is a near miss of one of ``allowed`` (values, as keys get)."""
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""
