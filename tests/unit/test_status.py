"""tasks/status.py on a real verl 0.5.0 console log (the P40 plan's 5 PPO steps on the H200,
captured by the GPU harness: tests/fixtures/verl_logs/p40-plan-h200.log, the same file as
bench/gpu/results/ppo-20261203/call4/p40/console.log), as the journal holds it, and cut or
garbled."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tasks import status
from tasks.status import main, parse_log, read_log

REPO = Path(__file__).resolve().parents[2]
REAL = REPO / "tests" / "fixtures" / "verl_logs" / "p40-plan-h200.log"


@pytest.fixture(scope="module")
def text():
    return REAL.read_text()


def test_real_log_gives_every_step_with_verls_metric_names(text):
    run = parse_log(text)
    assert [s["step"] for s in run.steps] == [1, 2, 3, 4, 5] and run.total_steps == 5
    for s in run.steps:
        m = s["metrics"]
        assert {"timing_s/step", "critic/score/mean", "response_length/mean", "actor/entropy"} <= set(m)
        assert all(isinstance(v, float) for v in m.values())
    assert run.steps[1]["metrics"]["timing_s/step"] == pytest.approx(45.39635156899996)
    # np.float64(...) values are read as numbers, and validation is in the last step
    assert run.steps[4]["metrics"]["val-core/openai/gsm8k/reward/mean@1"] == 0.0
    assert run.steps[4]["metrics"]["timing_s/testing"] == pytest.approx(11.019600873999991)
    s = run.summary()
    assert s["step"] == 5 and s["eta_s"] == 0 and s["validation_step"] == 5
    # the same seconds per step bench/gpu/ppo_results.py reports for this run (docs/training-runs.md)
    assert s["seconds_per_step"] == 44.75
    assert run.problems == []


def test_journal_prefixes_change_nothing(text):
    journal = "\n".join(f"Dec 03 21:3{i % 10}:00 box1 python3[4242]: {line}" for i, line in enumerate(text.splitlines()))
    assert parse_log(journal).steps == parse_log(text).steps


def test_a_log_cut_inside_a_step_line_keeps_what_is_complete_and_says_so(tmp_path, text, capsys):
    at = text.index("step:3 - ")
    mid = at + text[at:].index("critic/vf_loss:np.float64(") + len("critic/vf_loss:np.float64(0.")
    cut = text[:mid]                                  # ends inside critic/vf_loss's value
    log = tmp_path / "cut.log"
    log.write_text(cut)
    run = read_log(log)
    assert [s["step"] for s in run.steps] == [1, 2, 3]
    assert "critic/vf_loss" not in run.steps[2]["metrics"] and "actor/entropy" in run.steps[2]["metrics"]
    assert any("step 3" in p and "cut log" in p for p in run.problems)
    # cut inside a plain number: the half-written value is dropped, not read as a smaller number
    num = at + text[at:].index("global_seqlen/mean:") + len("global_seqlen/mean:98")
    log2 = tmp_path / "cut2.log"
    log2.write_text(text[:num])
    third = read_log(log2).steps[2]["metrics"]
    assert "global_seqlen/mean" not in third and "global_seqlen/min" in third
    assert main([str(log)]) == 0
    out = capsys.readouterr().out
    assert "step 3/5" in out and "note: line" in out


def test_garbled_bytes_are_reported_not_fatal(tmp_path, text, capsys):
    raw = text.encode()
    mid = raw.index(b"step:2 - ")
    log = tmp_path / "garbled.log"
    log.write_bytes(raw[:mid] + b"\xff\xfe\x00\x9c garbage \xc3\n" + raw[mid:])
    run = read_log(log)
    assert [s["step"] for s in run.steps] == [1, 2, 3, 4, 5]
    assert run.problems and "not UTF-8" in run.problems[0]
    junk = tmp_path / "junk.log"
    junk.write_bytes(bytes(range(256)) * 4)
    assert main([str(junk)]) == 2
    err = capsys.readouterr().err
    assert "no verl step lines" in err and "not UTF-8" in err


def test_missing_file_and_empty_log_are_clear_messages(tmp_path, capsys):
    assert main([str(tmp_path / "nope.log")]) == 2
    assert "cannot read" in capsys.readouterr().err
    empty = tmp_path / "empty.log"
    empty.write_text("")
    assert main([str(empty)]) == 2
    assert "has not finished a step yet" in capsys.readouterr().err


def test_json_is_machine_readable_on_its_own(tmp_path, text):
    """--json alone on stdout, valid JSON (a NaN metric, which verl can log, becomes null)."""
    log = tmp_path / "nan.log"
    log.write_text(re.sub(r"actor/pg_loss:[^ ]+", "actor/pg_loss:np.float64(nan)", text, count=1))
    out = subprocess.run([sys.executable, "-m", "tasks.status", "--json", str(log)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert [s["step"] for s in got["steps"]] == [1, 2, 3, 4, 5]
    assert got["steps"][0]["metrics"]["actor/pg_loss"] is None
    assert got["steps"][1]["metrics"]["critic/score/mean"] == 0.0
    assert got["summary"]["seconds_per_step"] == 44.75 and got["total_steps"] == 5


# ------------------------------------------------------------------ a box's status row

@pytest.mark.parametrize("show,state", [
    ({"LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead"}, "not-installed"),
    ({"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success", "NRestarts": "0",
      "ExecMainStartTimestampMonotonic": "0"}, "never-ran"),
    ({"LoadState": "loaded", "ActiveState": "activating", "SubState": "auto-restart", "Result": "exit-code",
      "NRestarts": "7", "ExecMainStartTimestampMonotonic": "91234567"}, "crash-looping"),
    ({"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "Result": "success", "NRestarts": "0",
      "ExecMainStartTimestampMonotonic": "91234567"}, "running"),
    ({"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "exit-code", "NRestarts": "3",
      "ExecMainStartTimestampMonotonic": "91234567"}, "failed"),
    ({"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success", "NRestarts": "0",
      "ExecMainStartTimestampMonotonic": "91234567"}, "finished"),
])
def test_unit_states_are_told_apart(show, state):
    assert status.unit_summary(show)[0] == state


def test_a_box_row_from_the_real_log():
    markers = {"cuda": {"stage": "cuda"}, "env": {"generation": "verl.gen2"}, "data": {"stage": "data"}, "train": None}
    unit = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "0",
            "ExecMainStartTimestampMonotonic": "5"}
    row = status.box_status("p40-box", markers, unit, REAL.read_text(), {"predicted_peak_mib": 22995})
    assert row["stages"] == ["cuda", "env", "data"] and row["env_generation"] == "verl.gen2"
    assert row["unit"] == "running" and row["step"] == 5 and row["total_steps"] == 5
    last = status.parse_log(REAL.read_text()).steps[-1]["metrics"]
    assert row["peak_mib"] == round(last["perf/max_memory_allocated_gb"] * 1024)
    assert row["predicted_peak_mib"] == 22995
    table = status.render_rows([row, status.box_status("new-box", {}, {}, "", None, verdict="unit: never ran")])
    lines = table.splitlines()
    assert lines[1].startswith("p40-box") and " 5/5 " in lines[1] and "verl.gen2" in lines[1]
    assert lines[2].startswith("new-box") and "not-installed" in lines[2] and lines[3].strip() == "unit: never ran"


# systemd's own lines about the unit this boot, as a lab box printed them (tests/fixtures/facts/logs.TrainingRun)
FAILED_RUN = """Started verl-lab-train.service - verl-lab PPO training (1 x Tesla T4).
verl-lab-train.service: Main process exited, code=exited, status=1/FAILURE
verl-lab-train.service: Failed with result 'exit-code'.
Stopped verl-lab-train.service - verl-lab PPO training (1 x Tesla T4)."""
FORGOTTEN = {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success",
             "NRestarts": "0", "ExecMainStartTimestampMonotonic": "0"}


@pytest.mark.parametrize("history,state", [
    ("", "never-ran"),
    (FAILED_RUN, "failed"),
    ("Started ok.\nverl-lab-train.service: Deactivated successfully.", "finished"),
    ("Started x.\nStopping x...\nverl-lab-train.service: Deactivated successfully.\nStopped x.", "stopped"),
    # an earlier run failed, the last one ended well: the last run counts
    (FAILED_RUN + "\nStarted again.\nverl-lab-train.service: Deactivated successfully.", "finished"),
])
def test_a_run_systemd_forgot_is_read_from_its_journal(history, state):
    """A unit that is not enabled is unloaded once inactive: systemd then says what it says of a unit
    that never ran. The journal's history of the unit does not forget (e2e: tests/e2e/test_refusals.py)."""
    got, words = status.unit_summary(FORGOTTEN, history)
    assert got == state
    if state == "failed":
        assert "its last run this boot: verl-lab-train.service: Failed with result 'exit-code'" in words


def test_reset_failed_is_not_finished():
    """reset-failed (a deploy's restart does it first) turns a failed result into success."""
    reset = {**FORGOTTEN, "ExecMainStartTimestampMonotonic": "2894492527"}
    assert status.unit_summary(reset)[0] == "finished"          # what systemd alone says
    assert status.unit_summary(reset, FAILED_RUN)[0] == "failed"


@pytest.mark.parametrize("case,state", [("forgotten-failed", "failed"), ("reset-failed", "failed"),
                                        ("never-ran", "never-ran"), ("crash-looping", "crash-looping"),
                                        ("training", "running")])
def test_recorded_boxes_states(case, state):
    from tests.unit.test_facts_table import FIXTURES

    fact = json.loads((FIXTURES / "logs.TrainingRun" / f"{case}.json").read_text())["fact"]
    assert status.unit_summary(fact["unit"], fact["history"])[0] == state
    if case in ("forgotten-failed", "reset-failed"):
        # the run's own lines come back although systemd has no invocation (or an empty one) for it
        assert "FAIL  data marker" in fact["journal"] and fact["preflight"] == ""


def test_a_rows_gsm8k_scores_come_from_the_run_exports_fact():
    """base -> trained from tasks.facts.export.RunExports' recorded answers: a finished run's proven,
    scored export; a run stopped while scoring (no trained score yet); nothing there."""
    from tests.unit.test_facts_table import FIXTURES

    def exports(case):
        return json.loads((FIXTURES / "export.RunExports" / f"{case}.json").read_text())["fact"]

    done = status.box_status("p40-box", {}, {}, REAL.read_text(), None, exports=exports("finished"))
    assert done["gsm8k"] == {"base": 0.0, "trained": 0.0, "step": 2, "final": True, "rows": 12, "engine": "hf"}
    scoring = status.box_status("t4-box", {}, {}, "", None, exports=exports("scoring"))
    assert (scoring["gsm8k"]["base"], scoring["gsm8k"]["trained"], scoring["gsm8k"]["step"]) == (None, None, None)
    nothing = status.box_status("new-box", {}, {}, "", None, exports=exports("nothing"))
    table = status.render_rows([done, scoring, nothing]).splitlines()
    assert "GSM8K base->trained" in table[0]
    assert table[1].endswith("0.000->0.000 @2") and table[2].endswith(" -") and table[3].endswith(" -")
    on_demand = {**done["gsm8k"], "base": 0.312, "trained": 0.355, "step": 20, "final": False}
    assert status.gsm8k_words(on_demand) == "0.312->0.355 @20?"
    assert status.gsm8k_words({**on_demand, "trained": None, "step": None}) == "0.312->-"


def test_status_says_why_stages_are_not_installed_and_when_nothing_runs():
    from tasks.status import box_status, not_installed_reason, nothing_to_report, render_rows
    failed = {"when": "2026-12-05 04:00:00 UTC", "ok": False, "stage": "data",
              "message": "verl-lab data: the endpoint has no such repo"}
    why = not_installed_reason(["cuda", "env"], failed)
    assert why.startswith("data, train not installed: the last deploy (2026-12-05 04:00:00 UTC) failed at data: ")
    assert "no such repo" in why
    assert "no deploy/full.py of this box is recorded" in not_installed_reason([], None)
    assert not_installed_reason(["cuda", "env", "data", "train"], failed) is None
    row = box_status("b", {"cuda": {"k": "v"}}, {}, "", None, last=failed)
    assert "    why: env, data, train not installed: the last deploy" in render_rows([row])
    idle = nothing_to_report([row])
    assert idle.startswith("status: no training run to report on 1 box (not-installed: b)"), idle
    assert idle.endswith("the `why:` lines above say what stops a box"), idle
    assert nothing_to_report([{**row, "unit": "running", "step": 3}]) is None
    # no `why:` line printed: none referred to (issue 44; mutation: the old fixed words)
    quiet = nothing_to_report([{**row, "reason": None, "verdict": None, "unit": "enabled"}])
    assert "why:" not in quiet and "preflight" not in quiet and quiet.endswith("on a box with a GPU"), quiet
    looping = nothing_to_report([{**row, "reason": None, "verdict": "the unit never ran", "unit": "never-ran"}])
    assert looping.endswith("; the preflight above says what stops a box"), looping


def test_status_says_a_refused_deploy_changed_nothing_then_not_now():
    """The checks' refusal said "nothing on this box was changed" of its own run; status, read after other
    deploys (deploy/tracking.py made a folder there), says it of that run only (issue 44)."""
    from tasks.base import refused_hosts
    from tasks.settings import SettingsError
    from tasks.status import not_installed_reason
    why = refused_hosts([SettingsError("b", "workload", "bad", "fix")], ["b"], {}, False)["b"]
    assert "nothing on this box was changed" in why
    refused = {"when": "2026-12-05 04:00:00 UTC", "ok": False, "stage": "checks",
               "message": f"verl-lab checks: {why}"}
    words = not_installed_reason([], refused)
    assert words == ("cuda, env, data, train not installed: the last deploy/full.py (2026-12-05 04:00:00 UTC) was "
                     "refused by its checks and changed nothing on this box then: its 1 problem (workload)"), words
    assert "nothing on this box was changed" not in words and "above" not in words
