"""How the README's test command shares the suite among pytest-xdist workers (tests/conftest.py):
the work units, their order, and the shared labs' users (tests/e2e/shared_labs.py), on plain
node ids and on the suite's own collection. Plumbing: what runs where and in which order; that
a shared lab really is booted once and closed after its last user is what a whole run shows
(docs/testing.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LONGEST_FIRST, work_unit
from tests.e2e.shared_labs import SHARED_LABS, shared_lab_of

REPO = Path(__file__).resolve().parents[2]


def test_a_module_is_one_unit_and_a_shared_labs_users_are_one():
    assert work_unit("tests/unit/test_plan.py::test_x[a-b]") == "tests/unit/test_plan.py"
    assert work_unit("tests/e2e/test_drills.py::test_killed_at_a_random_operation_converges_next_run") == \
        "tests/e2e/test_drills.py"
    assert work_unit("tests/e2e/test_drills.py::TestEnvDrill::test_killed_rebuild_leaves_the_old_env_working") == \
        "lab:env_lab"
    assert work_unit("tests/e2e/test_env.py::test_rerun_changes_nothing") == "lab:env_lab"
    assert work_unit("tests/e2e/test_security.py::test_token_in_no_process_argv") == "lab:fleet_lab"
    # a prefix of a user's name is not that user
    assert shared_lab_of("tests/e2e/test_env.pyx::test_a") is None
    assert shared_lab_of("tests/e2e/test_drills.py::TestEnvDrillOther::test_a") is None


def test_every_named_unit_and_user_exists():
    for members in SHARED_LABS.values():
        for member in members:
            module, _, cls = member.partition("::")
            text = (REPO / module).read_text()
            assert not cls or f"class {cls}" in text, member
    for unit in LONGEST_FIRST:
        assert unit.removeprefix("lab:") in SHARED_LABS or (REPO / unit).is_file(), unit


@pytest.fixture(scope="module")
def collected() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "tests"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def test_the_collection_runs_longest_first_and_each_unit_in_one_piece(collected):
    units = [work_unit(nodeid) for nodeid in collected]
    runs = [u for i, u in enumerate(units) if i == 0 or units[i - 1] != u]
    assert len(runs) == len(set(runs)), "a unit's tests are not together"
    assert runs[:len(LONGEST_FIRST)] == list(LONGEST_FIRST)
    first_unit_test = next(i for i, u in enumerate(units) if u.startswith("tests/unit/")
                           and u not in LONGEST_FIRST)
    assert all(not u.startswith(("lab:", "tests/e2e/")) for u in units[first_unit_test:])


def test_a_shared_labs_users_run_in_their_order(collected):
    for lab, members in SHARED_LABS.items():
        places = [shared_lab_of(nodeid)[1] for nodeid in collected if work_unit(nodeid) == f"lab:{lab}"]
        assert places == sorted(places) and set(places) == set(range(len(members))), lab
