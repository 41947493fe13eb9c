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


@pytest.fixture(scope="session")
def patched_verl_root(tmp_path_factory):
    """verl 0.5.0's sdist with the project's patches applied (what the boxes run), as a git tree."""
    import subprocess

    from tasks.verl import source as verl_source

    if shutil.which("git") is None:
        pytest.skip("git is missing")
    root = standin.verl_tree(tmp_path_factory.mktemp("verl"))
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    for patch in verl_source.patch_files():
        subprocess.run(["git", "apply", str(patch)], cwd=root, check=True)
    return root


@pytest.fixture(scope="module")
def served(verl_python, tmp_path_factory):
    """Programs run as children of a preloaded interpreter (tests/fixtures/zygote.py): ``served.python(env)`` is the
    ``python`` to run them with under ``env``; one server an environment, ended with the module."""
    from tests.fixtures.zygote import Served

    pool = Served(verl_python, parent=str(tmp_path_factory.getbasetemp()))
    yield pool
    pool.stop()
