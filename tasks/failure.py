"""Failing one host, and only it: the one operation every stage uses when a box cannot go on.

pyinfra runs a host's queued operations in order and stops that host at the first command that
exits non-zero; the other hosts go on. A stage that finds, at prepare time, a condition the
operator must fix on one box (an old driver, no GPU to plan for, a plan that cannot fit)
queues ``fail_host`` with the reason: the box fails with that message on stderr, and nothing
after it is changed on that box.
"""

from __future__ import annotations

import shlex

from pyinfra.api import StringCommand, operation


def failing_command(message: str, stage: str | None = None) -> StringCommand:
    """A command that fails its host with ``message`` on stderr (``verl-lab <stage>: `` before it
    when a stage is named; messages name URLs and paths, never secrets)."""
    text = f"verl-lab {stage}: {message}" if stage else message
    return StringCommand("sh", "-c", shlex.quote(f"printf '%s\\n' {shlex.quote(text)} >&2; exit 1"))


@operation()
def fail_host(message: str, stage: str | None = None):
    """Fail this host (only) with ``message``.

    .. code:: python

        fail_host(name="CUDA pre-checks", message="NVIDIA driver 470.82.01 is too old ...", stage="cuda")
    """
    yield failing_command(message, stage)
