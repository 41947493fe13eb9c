"""Fixtures shared by the unit tests."""

from __future__ import annotations

import shutil

import pytest

from tests.fixtures.standins import env as standin


@pytest.fixture(scope="session")
def verl_python():
    """A cached Python with the CPU torch and verl 0.5.0's pinned dependencies (no verl itself:
    the tests run verl from a source tree); first build about 2 minutes."""
    if shutil.which("git") is None:
        pytest.skip("git is missing")
    try:
        standin.torch_wheel()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return standin.test_env()
