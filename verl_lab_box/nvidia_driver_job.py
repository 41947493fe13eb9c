"""A driver change (``install``, ``headers``) runs in a transient systemd service of its own, not in
the SSH session that asked for it, and the session only follows it.

Why systemd-run and not ``setsid nohup``: the job gets its own cgroup, outside the SSH session's
scope, so neither a dropped connection (SIGHUP, a closed pipe: dpkg stopped half-way) nor logind
ending the session reaches apt; systemd refuses a second unit of the same name, so two deploys
cannot run two apt jobs at once (the second follows the first); and the unit's ``ExecStopPost``
runs however the job ended, SIGKILL included, which is where the units are unmasked and the hold and
the pin put back when the program itself could not (``release``). The driver stage needs a systemd
box anyway (the units it guards).

The status file (``plan["job_status"]``, root-only) says what the job is doing: ``starting``,
``running`` (its pid), ``done`` (its exit status and message), whether a caller has reported the
outcome, and what a failure must put back (``restore``). A re-run finds a running job by its unit
and follows it to the end; a job that ended while nobody followed it is reported by the next
caller before anything else happens. Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import subprocess
import sys
import time

try:
    from verl_lab_box.nvidia_driver_log import Failed
    from verl_lab_box.nvidia_driver_state import JOB_UNIT
except ImportError:                     # on a box: the modules lie side by side
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from nvidia_driver_log import Failed
    from nvidia_driver_state import JOB_UNIT

POLL_S = 1.0
NO_RESULT_S = 20        # a unit gone this long without its result written: its ExecStopPost did not run


def read_status(plan: dict) -> dict:
    try:
        with open(plan["job_status"], encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def write_status(plan: dict, **values) -> dict:
    """Merge ``values`` into the status file (written whole, then renamed; mode 600)."""
    status = {**read_status(plan), **values}
    part = plan["job_status"] + ".part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(status, fh, indent=1, sort_keys=True)
    os.replace(part, plan["job_status"])
    return status


def unit_state() -> str:
    res = subprocess.run(["systemctl", "show", "-p", "ActiveState", "--value", JOB_UNIT], capture_output=True, text=True)
    return res.stdout.strip() or "inactive"


def running() -> bool:
    return unit_state() not in ("inactive", "failed")


def outcome(status: dict) -> str:
    rc = status.get("rc")
    return "it succeeded" if rc == 0 else f"it failed (exit {rc}): {status.get('message') or 'see the log'}"


def start(plan: dict, plan_path: str, command: str, program: str, out=None) -> int:
    """Run ``program command --here`` as JOB_UNIT and follow it; a job already running is followed
    instead (whatever it does: its outcome is this call's). Two callers at once: the second waits
    on a lock until the first's unit runs, then follows it (its status is never written over)."""
    out = out or sys.stdout
    with open(plan["job_status"] + ".lock", "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        offset = _begin(plan, plan_path, command, program, out)
    return follow(plan, out, offset)


def _begin(plan: dict, plan_path: str, command: str, program: str, out) -> int | None:
    """Under the lock: the job's unit started (its log offset), or None where one already runs."""
    if running():
        status = read_status(plan)
        _print(out, f"verl-lab driver: a driver {status.get('command', 'change')} started {status.get('started', '?')} "
                    f"is still running here ({JOB_UNIT}): following it (it goes on if this connection drops)")
        return None
    last = read_status(plan)
    if last.get("state") == "done" and not last.get("reported"):
        _print(out, f"verl-lab driver: the last driver {last.get('command')} (started {last.get('started')}) ended "
                    f"while nobody followed it: {outcome(last)}")
        write_status(plan, reported=True)
    offset = _size(plan["log"])
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_status(plan, command=command, state="starting", started=started, log_offset=offset, rc=None, message="",
                 reported=False, restore=None, pid=None)
    py = sys.executable or "/usr/bin/python3"
    release = shlex.join([py, program, "release", "--plan", plan_path])
    argv = ["systemd-run", f"--unit={JOB_UNIT}", "--collect", "--quiet",
            f"--description=verl-lab driver stage: {command} (apt runs here, not in the SSH session)",
            f"--property=ExecStopPost={release}", py, program, command, "--here", "--plan", plan_path]
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        if "already loaded" in res.stderr or "already exists" in res.stderr:     # one started outside this lock
            return None
        write_status(plan, state="done", rc=1, message=res.stderr.strip(), reported=True)
        raise Failed(f"`systemd-run` could not start the driver job ({res.stderr.strip()[:300]}): nothing was "
                     "changed. The driver stage runs apt in a transient systemd unit so that a dropped connection "
                     "cannot stop dpkg half-way; it needs a box booted with systemd")
    _print(out, f"verl-lab driver: apt runs in {JOB_UNIT} (systemd-run): a dropped connection does not stop it; a "
                "re-run follows it")
    return offset


def follow(plan: dict, out=None, offset: int | None = None) -> int:
    """Print the stage log's new lines until the job's status says done; return its exit status."""
    out = out or sys.stdout
    status = read_status(plan)
    offset = status.get("log_offset", 0) if offset is None else offset
    gone = None
    while True:
        offset = _print_new(plan["log"], offset, out)
        status = read_status(plan)
        if status.get("state") == "done":
            _print_new(plan["log"], offset, out)
            write_status(plan, reported=True)
            return int(status.get("rc") or 0)
        if not running():
            gone = gone or time.monotonic()
            if time.monotonic() - gone > NO_RESULT_S:
                raise Failed(f"the driver job ({JOB_UNIT}) ended without writing its result: see `journalctl -u "
                             f"{JOB_UNIT}` and {plan['log']}; the doctor (deploy/doctor.py) says what it left")
        time.sleep(POLL_S)


def exit_words(env=os.environ) -> str:
    """How systemd says the job's main process ended ($SERVICE_RESULT, $EXIT_CODE, $EXIT_STATUS of
    an ExecStopPost): "signal (killed KILL)"."""
    return f"{env.get('SERVICE_RESULT', '?')} ({env.get('EXIT_CODE', '?')} {env.get('EXIT_STATUS', '?')})"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _print_new(path: str, offset: int, out) -> int:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError:
        return offset
    whole = data[:data.rfind(b"\n") + 1]
    if whole:
        _print(out, whole.decode("utf-8", "replace").rstrip("\n"))
    return offset + len(whole)


def _print(out, text: str) -> None:
    try:
        print(text, file=out, flush=True)
    except (BrokenPipeError, OSError):     # the caller is gone; the job is not
        pass
