"""tests/fixtures/forked_runs.py, the LoRA fixtures' forked children (docs/testing.md "Heavy processes"): a child's
failure is reported as an interpreter reports one, a hung child is killed at the time limit, and no child is forked
over a thread. What the children compute against processes of their own: bench/forked_equivalence.py.

One Python with torch (the unit tests' cached env, no verl) runs every case; each test reads its part.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CASES = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import forked_runs
import torch

tmp = sys.argv[2]
torch.set_num_threads(1)

def fails():
    sys.excepthook = lambda kind, exc, tb: print(f"the child's hook: {kind.__name__}: {exc}", flush=True)
    raise ValueError("the child's own error")

def hangs():
    time.sleep(60)

def writes(path):
    with open(path, "w") as fh:
        fh.write("done")

def attempt(name):
    try:
        return {"codes": forked_runs.run_children([(writes, (f"{tmp}/{name}",), f"{tmp}/{name}.log")], 30)[0]}
    except RuntimeError as exc:
        return {"refused": str(exc), "forked": os.path.exists(f"{tmp}/{name}")}

out = {}
codes, logs = forked_runs.run_children([(fails, (), f"{tmp}/fails.log"), (writes, (f"{tmp}/ok",), f"{tmp}/ok.log")], 60)
out["failed"] = {"codes": codes, "log": logs[0], "other_done": open(f"{tmp}/ok").read()}
start = time.monotonic()
codes, _ = forked_runs.run_children([(hangs, (), f"{tmp}/hangs.log"), (writes, (f"{tmp}/ok2",), f"{tmp}/ok2.log")], 3)
out["hung"] = {"codes": codes, "seconds": time.monotonic() - start}
thread = threading.Thread(target=time.sleep, args=(2,))
thread.start()
out["thread"] = attempt("thread")
thread.join()
torch.set_num_threads(2)
out["pool"] = attempt("pool")
torch.set_num_threads(1)
out["alone"] = attempt("alone")
print("CASES " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def cases(verl_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forked")
    res = subprocess.run([str(verl_python), "-c", CASES, str(FIXTURES), str(tmp)], capture_output=True, text=True,
                         timeout=120)
    lines = [line for line in res.stdout.splitlines() if line.startswith("CASES ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(lines[-1][len("CASES "):])


def test_a_failing_child_exits_1_with_its_exception_through_its_excepthook(cases):
    """As an interpreter ends on an exception: sys.excepthook (torch.distributed's marks each line with the rank,
    which the LoRA tests' logs show), exit code 1; the other child of the run finishes."""
    failed = cases["failed"]
    assert failed["codes"] == [1, 0], failed
    assert "the child's hook: ValueError: the child's own error" in failed["log"], failed["log"]
    assert failed["other_done"] == "done"


def test_a_hung_child_is_killed_at_the_limit_and_reported(cases):
    hung = cases["hung"]
    assert hung["codes"] == ["timeout", 0], hung
    assert hung["seconds"] < 30, hung


@pytest.mark.parametrize("case", ["thread", "pool"])
def test_no_child_is_forked_over_a_thread_or_torchs_pool(cases, case):
    """A fork copies the calling thread alone: a Python thread or a torch intra-op pool larger than one (whose
    threads start at the first parallel op) in the parent is refused before any child starts."""
    assert "cannot fork over threads" in cases[case]["refused"] and not cases[case]["forked"], cases[case]
    assert cases["alone"] == {"codes": [0]}, cases["alone"]
