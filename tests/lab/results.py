"""What a pyinfra run did: ``DeployResult``, parsed from pyinfra 3.10's own output.

Two parseable modes, neither needs ``--debug``:
- ``json`` (the default): ``pyinfra --json -y`` prints the human log on stderr and, at the
  end, one JSON document on stdout (pyinfra_cli.prints.build_results_json): per operation the
  hosts with ``success`` (= changed), ``no_change`` and ``error``, the totals and
  ``failed_hosts``.
- ``text``: the plain human output; per host the ``[host] Success`` / ``[host] No changes``
  lines the executor logs for each operation (pyinfra.api.operations), the
  ``[host] Error...`` lines, and the results table's ``Grand total`` row.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


@dataclass
class DeployResult:
    command: list[str]
    rc: int
    stdout: str
    stderr: str
    hosts: list[str]
    mode: str = "json"
    results: dict[str, Any] | None = None     # pyinfra's JSON results (json mode, when it ran)
    changed: int | None = None               # changed operation-host pairs, all hosts
    changed_by_host: dict[str, int] = field(default_factory=dict)
    no_change_by_host: dict[str, int] = field(default_factory=dict)
    errors_by_host: dict[str, int] = field(default_factory=dict)
    failed_hosts: list[str] = field(default_factory=list)
    ran_operations: bool = False             # pyinfra reached "Beginning operation run"
    changed_ops: list[tuple[str, str]] = field(default_factory=list)   # (host, operation name)

    @property
    def output(self) -> str:
        """stderr (the human log) then stdout, without colour codes."""
        return strip_ansi(self.stderr + ("\n" + self.stdout if self.stdout.strip() else ""))

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.failed_hosts

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])

    def assert_ok(self) -> DeployResult:
        assert self.ok, f"pyinfra failed (rc {self.rc}, failed hosts {self.failed_hosts}):\n{self.tail()}"
        return self

    def assert_idempotent(self) -> DeployResult:
        self.assert_ok()
        assert self.changed == 0, (
            f"second run changed {self.changed} operations: {self.changed_ops}\n{self.tail()}")
        return self

    def __str__(self) -> str:
        return (f"DeployResult(rc={self.rc}, changed={self.changed}, by_host={self.changed_by_host}, "
                f"failed={self.failed_hosts})")


def parse(command, rc, stdout, stderr, hosts, mode="json") -> DeployResult:
    res = DeployResult(command=list(command), rc=rc, stdout=stdout, stderr=stderr, hosts=list(hosts), mode=mode)
    log = strip_ansi(stderr)
    res.ran_operations = "--> Beginning operation run" in log
    if mode == "json":
        doc = _last_json(stdout)
        if doc is not None and isinstance(doc.get("results"), dict):
            _from_json(res, doc["results"])
            return res
    _from_text(res, log + "\n" + strip_ansi(stdout))
    return res


def _last_json(stdout: str) -> dict | None:
    text = stdout.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        start = text.find("{")   # something printed before the document (a print() in a deploy)
        while start != -1:
            try:
                return json.loads(text[start:])
            except ValueError:
                start = text.find("{", start + 1)
    return None


def _from_json(res: DeployResult, results: dict) -> None:
    res.results = results
    changed = {h: 0 for h in res.hosts}
    same = {h: 0 for h in res.hosts}
    errors = {h: 0 for h in res.hosts}
    for op in results.get("operations", []):
        for h in op.get("success", []):
            changed[h] = changed.get(h, 0) + 1
            res.changed_ops.append((h, op.get("name", "?")))
        for h in op.get("no_change", []):
            same[h] = same.get(h, 0) + 1
        for h in op.get("error", []):
            errors[h] = errors.get(h, 0) + 1
    res.changed_by_host, res.no_change_by_host, res.errors_by_host = changed, same, errors
    res.changed = int(results.get("totals", {}).get("success", sum(changed.values())))
    failed = set(results.get("failed_hosts", [])) | {h for h, n in errors.items() if n}
    res.failed_hosts = sorted(failed)


_STATUS = re.compile(r"^\s*\[(?P<host>[^\]]+)\]\s+(?:nested\s+)?(?P<status>Success|No changes|Error)\b")
_TOTAL = re.compile(r"^\s*Grand total\s+(?P<hosts>\S+)\s+(?P<success>\S+)\s+(?P<error>\S+)\s+(?P<same>\S+)\s*$")


def _from_text(res: DeployResult, log: str) -> None:
    changed = {h: 0 for h in res.hosts}
    same = {h: 0 for h in res.hosts}
    errors = {h: 0 for h in res.hosts}
    total = None
    for line in log.splitlines():
        m = _STATUS.match(line)
        if m:
            h, status = m.group("host").strip(), m.group("status")
            bucket = {"Success": changed, "No changes": same, "Error": errors}[status]
            bucket[h] = bucket.get(h, 0) + 1
            if status == "Success":
                res.changed_ops.append((h, "?"))
            continue
        t = _TOTAL.match(line)
        if t:
            total = t
    res.changed_by_host, res.no_change_by_host, res.errors_by_host = changed, same, errors
    if total is not None:
        res.changed = 0 if total.group("success") == "-" else int(total.group("success"))
    elif not res.ran_operations:
        res.changed = 0          # stopped before any operation ran (e.g. a bad inventory)
    else:
        res.changed = sum(changed.values()) if res.rc == 0 else None
    failed = {h for h, n in errors.items() if n}
    for line in log.splitlines():
        m = re.match(r"^\s*\[(?P<host>[^\]]+)\]\s+(Could not connect|Connection error|Authentication error)", line)
        if m:
            failed.add(m.group("host").strip())
    res.failed_hosts = sorted(failed)
