"""The driver stage's box-side log and the failure that stops a step: every step's command and
output go to stdout and to the stage log (``<lab_root>/logs/driver.log``, read by the doctor).
Standard library only."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys


class Failed(RuntimeError):
    """A step that cannot go on: the message says what was found and what to do."""


class Log:
    """Every step's output, to stdout and appended to the stage log."""

    def __init__(self, path: str | None, stream=None):
        self.fh, self.stream = None, stream or sys.stdout
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.fh = open(path, "a", encoding="utf-8")

    def say(self, text: str, stream=None) -> None:
        for line in text.rstrip("\n").splitlines():
            try:
                print(line, file=stream or self.stream, flush=True)
            except (BrokenPipeError, OSError):        # a caller gone (a dropped SSH connection): the log goes on
                pass
            if self.fh:
                self.fh.write(line + "\n")
                self.fh.flush()

    def run(self, argv, check: bool = True, env: dict | None = None, cwd: str | None = None
            ) -> subprocess.CompletedProcess:
        self.say("+ " + shlex.join(argv))
        res = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd)
        self.say(res.stdout + res.stderr)
        if check and res.returncode != 0:
            raise Failed(f"`{shlex.join(argv)}` exited {res.returncode}: " + errors(res.stdout + res.stderr))
        return res


def errors(text: str, limit: int = 600) -> str:
    """apt's and dpkg's error lines of ``text`` (``E:``, ``dpkg: error``, ``Error!``), else its last line."""
    found = [line.strip() for line in text.splitlines()
             if line.startswith(("E:", "dpkg: error", "Error!")) or "returned error exit status" in line]
    if not found:
        found = [line.strip() for line in text.splitlines() if line.strip()][-1:]
    return " ".join(found)[:limit]


class Interrupted(Failed):
    """The job was stopped by a signal: handled as a failure, so what it released is put back."""
