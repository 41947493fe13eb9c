"""The one fail-this-host operation (tasks/failure.py): the command it queues fails with the
message on stderr, quoted whatever the message holds."""

from __future__ import annotations

import subprocess

import pytest

from tasks.failure import failing_command


@pytest.mark.parametrize("message,stage,expected", [
    ("no GPU target", "train", "verl-lab train: no GPU target"),
    ("it's $HOME `x` \"q\"; exit 0", "data", "verl-lab data: it's $HOME `x` \"q\"; exit 0"),
    ("verl-lab cuda: box2: nothing was changed", None, "verl-lab cuda: box2: nothing was changed"),
])
def test_failing_command_fails_with_the_message(message, stage, expected):
    cmd = failing_command(message, stage).get_raw_value()
    res = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True)
    assert res.returncode == 1 and res.stdout == "" and res.stderr == expected + "\n"
