"""Fact: a box's last burn-in (its record and its unit), for deploy/burnin.py, deploy/status.py and the doctor."""

from __future__ import annotations

import json
import shlex

from pyinfra.api import FactBase

from tasks.facts.logs import SECTION, _sections


class BurninRecord(FactBase[dict]):
    """The burn-in's record and unit: ``{"unit": {systemctl show property: value}, "record": burnin.json | None,
    "problem": why the record cannot be read | None}``. The record lies in the burn-in's folder, which the train
    user owns: it is read as that user (root follows no name the user controls). ``poll``: a new number asks again
    (facts are cached per arguments within a run). The default: no unit, no record.
    """

    @staticmethod
    def default() -> dict:
        return {"unit": {}, "record": None, "problem": None}

    def command(self, record: str, user: str, unit: str, poll: int = 0) -> str:
        q = shlex.quote
        return "; ".join(([f": poll {int(poll)}"] if poll else []) + [
            f"echo '{SECTION}unit'",
            f"systemctl show -p LoadState -p ActiveState -p SubState -p Result -p ExecMainStatus {q(unit)} 2>/dev/null",
            f"echo '{SECTION}record'",
            f"if id -u {q(user)} >/dev/null 2>&1; then runuser -u {q(user)} -- cat {q(record)} 2>/dev/null; fi; echo"])

    def process(self, output) -> dict:
        sections = _sections(output)
        if not sections:
            return self.default()
        unit = dict(line.partition("=")[::2] for line in sections.get("unit", []) if "=" in line)
        text = "\n".join(sections.get("record", [])).strip()
        if not text:
            return {"unit": unit, "record": None, "problem": None}
        try:
            record = json.loads(text)
        except ValueError as exc:
            return {"unit": unit, "record": None, "problem": f"the record is not JSON ({exc})"}
        if not isinstance(record, dict):
            return {"unit": unit, "record": None, "problem": "the record is not a JSON object"}
        return {"unit": unit, "record": record, "problem": None}
