"""The training stage's wait for a unit it started (tasks.train.wait_until_training), against a
stand-in host whose TrainingRun answers change from poll to poll. The e2e tests show the failing
path on real systemd (tests/e2e/test_status.py, test_doctor.py); the passing one needs a box whose
preflight passes (a GPU), so it is shown here only."""

from __future__ import annotations

from tasks import train
from tests.unit import test_train_launcher as launcher_test

RUNNING = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "0",
           "ExecMainStartTimestampMonotonic": "5"}
LOOPING = {**RUNNING, "ActiveState": "activating", "SubState": "auto-restart", "NRestarts": "1", "Result": "exit-code"}
FAILED_CHECK = "  FAIL  data marker: /opt/verl-lab/markers/data.done missing: the model and data stage has not finished\n"


class Host:
    name = "box1"

    def __init__(self, answers):
        self.answers, self.polls, self.logged = list(answers), [], []

    def get_fact(self, fact, poll, **args):
        self.polls.append(poll)
        unit, journal = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return {"unit": unit, "journal": journal, "plan": None, "markers": {}, "preflight": ""}

    def log_styled(self, text, **kw):
        self.logged.append(text)


def test_passes_once_the_preflight_passed():
    host = Host([(RUNNING, "verl-lab preflight on box1 ...\n"), (RUNNING, "verl-lab preflight passed on box1\n")])
    assert train.wait_until_training(None, host, launcher_test.settings_for(), seconds=30, poll_s=0) is True
    assert host.polls == [1, 2] and "past its preflight" in host.logged[-1]


def test_a_crash_loop_fails_the_host_with_the_doctors_verdict():
    host = Host([(RUNNING, ""), (LOOPING, FAILED_CHECK)])
    assert train.wait_until_training(None, host, launcher_test.settings_for(), seconds=30, poll_s=0) is False
    assert "did not start training: activating (auto-restart), 1 restarts" in host.logged[-1]
    assert "[stage-not-finished]" in host.logged[-1]
    # the run's summary line says the unit crash-loops, not "started" (mutation: the wait's note_for dropped)
    from tasks import run_summary
    assert run_summary._RECORD["box1"]["unit"].startswith("crash-looping, not training (activating (auto-restart)")


def test_no_pass_in_time_fails_the_host():
    host = Host([(RUNNING, "still probing the env\n")])
    assert train.wait_until_training(None, host, launcher_test.settings_for(), seconds=0.05, poll_s=0.01) is False
    assert "no preflight pass within 0 s" in host.logged[-1]
