"""The box program's guards around a driver change (issue 41): the training and Ray units judged in
any state, masked and stopped; exactly the simulated versions; the hold and the pin after every
failure past apt; the job that runs apt outside the SSH session; the reboot guard. The fake box and
the helpers are tests/unit/test_driver_box.py's.

Plumbing: the commands, their order and the files written, against recorded box states and apt
output. The same steps against real systemd, apt and dpkg on a Debian 12 lab box:
tests/e2e/test_driver.py."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_driver_box import (  # noqa: F401
    SIMULATE,
    UPDATE,
    FakeBox,
    apt_calls,
    box,
    held_names,
    held_state,
    is_hold,
    plan,
    recorded,
    run_main,
    st,
    unit_lines,
    write_old_pin,
)
from verl_lab_box import nvidia_driver_hold as hold
from verl_lab_box import nvidia_driver_install as inst
from verl_lab_box import nvidia_driver_job as job
from verl_lab_box import nvidia_driver_units as units
from verl_lab_box.nvidia_driver_log import Interrupted

TRAIN, RAY = "verl-lab-train.service", "verl-lab-ray.service"
UPDATED = "535.309.01-0+deb12u1"


def masks(plan) -> list[str]:
    found = Path(units.MASK_DIR)
    return sorted(p.name for p in found.iterdir()) if found.exists() else []


def show(unit: str, active: str, sub: str) -> str:
    """``systemctl show -p Id -p LoadState ...`` of one unit, as systemd 252 prints it."""
    return f"Id={unit}\nLoadState=loaded\nActiveState={active}\nSubState={sub}\nUnitFileState=static\n\n"


def reloads(fake) -> int:
    return sum(1 for c in fake.calls if c[:2] == ["systemctl", "daemon-reload"])


# ---------------------------------------------------------------- judging units (pure)


def test_any_state_but_inactive_or_failed_is_busy():
    state = {"units": {TRAIN: {"active": "activating", "sub": "auto-restart"}, RAY: {"active": "failed", "sub": "failed"},
                       "other.service": {"active": "active", "sub": "running"}}}
    assert units.busy_units(state, [TRAIN, RAY]) == [f"{TRAIN} is activating (auto-restart)"]
    assert units.busy_units({"units": {}}, [TRAIN, RAY]) == []            # not known to systemd: inactive
    for active in ("active", "reloading", "deactivating", "activating"):
        assert units.busy_units({"units": {RAY: {"active": active, "sub": "x"}}}, [RAY])


def test_gpu_processes_by_the_unit_they_run_in():
    assert units.unit_of("/system.slice/verl-lab-train.service") == TRAIN
    assert units.unit_of("/user.slice/user-0.slice/session-3.scope") == "session-3.scope"
    assert units.unit_of("") == ""
    state = {"busy": [["10", "python3", f"/system.slice/{TRAIN}"], ["11", "raylet", f"/system.slice/{RAY}"],
                      ["12", "jupyter", "/system.slice/jupyter.service"], ["13", "nvidia-persiste", "/x.service"]]}
    assert units.outside_users(state, [TRAIN, RAY]) == [["12", "jupyter", "/system.slice/jupyter.service"]]
    assert units.busy_reasons(state, [TRAIN, RAY], "stop") == ["processes hold /dev/nvidia* (12 (jupyter, in "
                                                                "jupyter.service))"]
    assert len(units.busy_reasons(state, [TRAIN, RAY], "refuse")[0].split("), ")) == 3


def test_the_fact_reads_each_units_state_and_the_stages_masks():
    text = recorded("debian12_fresh").replace(st.SECTION + "units\n", st.SECTION + "units\n"
                                              + show(TRAIN, "activating", "auto-restart") + show(RAY, "active", "running"))
    text = text.replace(st.SECTION + "masks\n", st.SECTION + f"masks\n{TRAIN}\n")
    state = st.parse_fact_output(text)
    assert state["units"][TRAIN] == {"load": "loaded", "active": "activating", "sub": "auto-restart", "file": "static"}
    assert state["masks"] == [TRAIN]
    cmd = st.fact_command("/pin", [TRAIN, RAY])
    assert f"systemctl show -p Id -p LoadState -p ActiveState -p SubState -p UnitFileState {TRAIN} {RAY} " \
           f"{st.JOB_UNIT}" in cmd
    assert f"readlink {st.MASK_DIR}/$u" in cmd


# ---------------------------------------------------------------- masked, stopped, checked again


def test_the_units_are_masked_for_the_change_and_unmasked_after(monkeypatch, tmp_path, plan):
    fake = FakeBox([recorded("debian12_fresh"), recorded("debian12_held_no_module")])
    seen = {}
    real = inst._change

    def change(*a, **kw):                         # what the units look like while apt runs
        seen["masks"] = masks(plan)
        seen["links"] = {n: (Path(units.MASK_DIR) / n).readlink().as_posix() for n in seen["masks"]}
        return real(*a, **kw)

    monkeypatch.setattr(inst, "_change", change)
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 0
    assert seen["masks"] == sorted([TRAIN, RAY]) and set(seen["links"].values()) == {"/dev/null"}
    assert masks(plan) == [] and not Path(units.RECORD).exists() and reloads(fake) == 2
    log = Path(plan["log"]).read_text()
    assert log.index("masked verl-lab-train.service verl-lab-ray.service") < log.index("+ apt-get update")
    assert log.index("(right before apt-get install)") < log.index("+ apt-get -y install") < log.index("unmasked")


def test_a_unit_that_started_before_the_mask_took_stops_the_change_and_is_unmasked(monkeypatch, tmp_path, plan, capsys):
    started = unit_lines(recorded("debian12_fresh"), TRAIN, "active", "running")
    fake = FakeBox(recorded("debian12_fresh"), then=[("daemon-reload", started)])
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 1
    assert apt_calls(fake) == [] and masks(plan) == [] and reloads(fake) == 2
    assert f"{TRAIN} is active (running) (after masking): no driver package is changed" in capsys.readouterr().err


def test_the_stop_policy_masks_then_stops_the_units_then_installs(monkeypatch, tmp_path, plan, capsys):
    running = unit_lines(unit_lines(recorded("debian12_fresh"), TRAIN, "activating", "auto-restart"), RAY, "active",
                         "running")
    fake = FakeBox([running, recorded("debian12_held_no_module")], then=[("stop", recorded("debian12_fresh"))],
                   units=[show(TRAIN, "activating", "auto-restart"), show(RAY, "active", "running"),
                          show(TRAIN, "inactive", "dead") + show(RAY, "inactive", "dead")])
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 1          # refuse (the default): refused
    assert apt_calls(fake) == [] and reloads(fake) == 0 and not [c for c in fake.calls if c[:2] == ["systemctl", "stop"]]
    fake = FakeBox([running, recorded("debian12_held_no_module")], then=[("stop", recorded("debian12_fresh"))],
                   units=[show(TRAIN, "activating", "auto-restart"), show(RAY, "active", "running"),
                          show(TRAIN, "inactive", "dead") + show(RAY, "inactive", "dead")])
    assert run_main(monkeypatch, tmp_path, dict(plan, busy="stop"), fake, "install") == 0
    calls = fake.calls
    mask = calls.index(["systemctl", "daemon-reload"])
    stop = calls.index(["systemctl", "stop", TRAIN, RAY])
    assert mask < stop < calls.index(["apt-get", "update"])                 # masked first: nothing restarts them
    assert "stopping verl-lab-train.service verl-lab-ray.service (driver_busy = 'stop')" in capsys.readouterr().out
    assert masks(plan) == []


def test_a_gpu_process_right_before_the_install_stops_it_with_hold_and_pin_as_they_were(monkeypatch, tmp_path, plan,
                                                                                         capsys):
    pin = write_old_pin(plan)
    gpu = held_state().replace(st.SECTION + "busy\n", st.SECTION + "busy\n4242 python3\t/user.slice/session-2.scope\n")
    fake = FakeBox(held_state(), simulate=(0, UPDATE), then=[("--simulate", gpu)])     # it opens the GPU then
    assert run_main(monkeypatch, tmp_path, dict(plan, update=True), fake, "install") == 1
    assert not [c for c in fake.calls if c[:3] == ["apt-get", "-y", "install"] or "unhold" in c]
    assert Path(plan["pin"]).read_text() == pin and masks(plan) == []
    err = capsys.readouterr().err
    assert "processes hold /dev/nvidia* (4242 (python3, in session-2.scope)) (right before apt-get install)" in err


# ---------------------------------------------------------------- exactly what the simulation approved


def test_a_list_refresh_after_the_simulation_stops_the_change(monkeypatch, tmp_path, plan, capsys):
    pin = write_old_pin(plan)
    newer = UPDATE.replace(UPDATED, "535.310.02-0+deb12u1")
    for again, said in (((0, newer), "now bring another transaction"),
                        ((100, f"E: Version '{UPDATED}' for 'libcuda1' was not found\n"),
                         f"are gone (E: Version '{UPDATED}' for 'libcuda1' was not found)")):
        fake = FakeBox(held_state(), simulate=[(0, UPDATE), again])
        assert run_main(monkeypatch, tmp_path, dict(plan, update=True), fake, "install") == 1
        sims = [c for c in fake.calls if "--simulate" in c]
        assert len(sims) == 2 and f"libcuda1={UPDATED}" in sims[1]          # the second: the approved versions
        assert not [c for c in fake.calls if c[:3] == ["apt-get", "-y", "install"] or "unhold" in c]
        assert Path(plan["pin"]).read_text() == pin and masks(plan) == []
        err = capsys.readouterr().err
        assert f"the archive changed between apt's simulation and the install (a list refresh, such as apt-daily's): " \
               f"the approved versions {said}; nothing was installed (the hold and the pin are as they were)" in err


def test_a_package_asked_for_that_apt_neither_installs_nor_has_stops_the_change(monkeypatch, tmp_path, plan, capsys):
    fake = FakeBox(recorded("debian12_fresh"), versions={})
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 1
    assert not [c for c in fake.calls if c[:3] == ["apt-get", "-y", "install"]]
    assert "apt's simulation gave no version for linux-headers-6.1.0-26-amd64 and it is not installed" in \
        capsys.readouterr().err


# ---------------------------------------------------------------- after apt: the hold and the pin, always


def half_done(versions: dict, statuses: dict | None = None) -> str:
    """The held box after apt changed it: the packages of ``versions`` at those versions, those of
    ``statuses`` in that dpkg state (``iF``: half-configured), the rest as they were; nothing held
    (the install had released the hold)."""
    statuses = statuses or {}
    rows = []
    for line in held_state().splitlines():
        fields = line.split("\t")
        if len(fields) == 4 and fields[1] == "nvidia-graphics-drivers":
            name = fields[0]
            fields = [name, fields[1], versions.get(name, fields[2]), statuses.get(name, "ii ")]
        rows.append("\t".join(fields))
    return "\n".join(rows) + "\n"


MOVING = ("libcuda1", "nvidia-driver", "nvidia-kernel-dkms")        # what UPDATE installs


def test_a_dpkg_failure_midway_leaves_everything_held_and_pinned_where_apt_was_going(monkeypatch, tmp_path, plan,
                                                                                      capsys):
    """DKMS's postinst failed: nvidia-kernel-dkms half-configured; libcuda1 not unpacked yet."""
    write_old_pin(plan)
    after = half_done({"nvidia-driver": UPDATED, "nvidia-kernel-dkms": UPDATED}, {"nvidia-kernel-dkms": "iF "})
    fake = FakeBox([held_state(), after], simulate=(0, UPDATE), install_rc=100, changed_on_failure=True)
    assert run_main(monkeypatch, tmp_path, dict(plan, update=True), fake, "install") == 1
    hold = [c for c in fake.calls if is_hold(c)][-1]
    now = st.parse_fact_output(after)
    assert set(held_names(hold)) == {p["name"] for p in now["packages"] if p["source"] == "nvidia-graphics-drivers"}
    pin = st.parse_pin(Path(plan["pin"]).read_text())
    # pinned where the install was going (libcuda1 too, not yet unpacked), the packages it did not move where they are
    assert pin["stanzas"][0] == {"packages": list(MOVING), "version": UPDATED}
    assert pin["stanzas"][1]["version"] == "535.261.03-1" and len(pin["stanzas"][1]["packages"]) == 20
    assert masks(plan) == []
    err = capsys.readouterr().err
    assert f"apt stopped part-way: the driver's packages are held, and pinned at the versions the install was taking " \
           f"({UPDATED}: 3 packages; 535.261.03-1: 20 packages)" in err
    assert "dpkg left nvidia-kernel-dkms (iF) not configured" in err and "no nvidia kernel module is loaded" in err
    assert "`dpkg --configure -a`" in err


def test_a_rerun_after_a_stopped_change_names_what_dpkg_left_with_the_rest(monkeypatch, tmp_path, plan):
    stopped = half_done({}, {"nvidia-kernel-dkms": "iHR"})
    assert stopped != recorded("debian12_held_no_module")
    fake = FakeBox([stopped, recorded("debian12_held_no_module")], simulate=(0, SIMULATE))
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 0
    sim = next(c for c in fake.calls if "--simulate" in c)
    assert "nvidia-kernel-dkms" in sim and "nvidia-driver" in sim


def test_a_failure_after_a_finished_apt_leaves_the_install_held_and_pinned(monkeypatch, tmp_path, plan, capsys):
    fake = FakeBox([recorded("debian12_fresh"), recorded("debian12_held_no_module")], initramfs=True,
                   rc={"update-initramfs": 1})
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 1
    assert st.parse_pin(Path(plan["pin"]).read_text())["version"] == "535.261.03-1"
    assert len(held_names([c for c in fake.calls if is_hold(c)][-1])) == 23 and masks(plan) == []
    err = capsys.readouterr().err
    assert "update-initramfs -u failed (exit 1" in err and "the stage does not reboot onto it" in err
    assert "apt finished the install: the driver's packages are held and pinned at 535.261.03-1: 23 packages" in err


def test_apt_mark_hold_failing_falls_back_to_dpkgs_selections(monkeypatch, tmp_path, plan, capsys):
    fake = FakeBox([recorded("debian12_fresh"), recorded("debian12_held_no_module")], rc={"apt-mark hold": 100})
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 0
    assert "nvidia-driver hold\n" in fake.inputs["selections"] and "libcuda1 hold\n" in fake.inputs["selections"]
    assert "apt-mark hold failed (exit 100): holding through `dpkg --set-selections`" in capsys.readouterr().out
    fake = FakeBox([recorded("debian12_fresh"), recorded("debian12_held_no_module")],
                   rc={"apt-mark hold": 100, "dpkg": 2})
    assert run_main(monkeypatch, tmp_path, plan, fake, "install") == 1
    assert "the packages are NOT held: unattended-upgrades may replace them" in capsys.readouterr().err
    # a package installed for two architectures is named with each to dpkg (tests/unit/test_driver_multiarch.py runs
    # it on real dpkg). Mutation: the native one bare: dpkg refuses the ambiguous name
    assert box.hold.selections(["libcuda1", "libcuda1:i386", "nvidia-driver"], "amd64") == \
        "libcuda1:amd64 hold\nlibcuda1:i386 hold\nnvidia-driver hold\n"


def test_fabric_manager_failing_to_enable_leaves_the_install_held_and_pinned(monkeypatch, tmp_path, plan, capsys):
    from tests.unit.test_driver_box_checks import NOBLE_FM, ubuntu_plan, ubuntu_state

    v = "580.196.07-0ubuntu0.24.04.1"
    sim = NOBLE_FM + f"Inst nvidia-fabricmanager-580 ({v} Ubuntu:24.04/noble-updates/multiverse [amd64])\n"
    fake = FakeBox([recorded("debian12_fresh"), ubuntu_state(v)], simulate=(0, sim), rc={"systemctl": 1})
    fake.rc = {}
    real = fake.__call__

    def enable_fails(argv, **kw):
        res = real(argv, **kw)
        if argv[:2] == ["systemctl", "enable"]:
            return subprocess.CompletedProcess(argv, 1, "", "Failed to enable unit: Unit file "
                                               "nvidia-fabricmanager.service does not exist.\n")
        return res

    monkeypatch.setattr(box.subprocess, "run", enable_fails)
    path = tmp_path / "driver-plan.json"
    path.write_text(json.dumps(ubuntu_plan(plan)))
    monkeypatch.setattr(box.inst, "supported_gpus_problems", lambda plan, would, log: [])
    assert box.main(["install", "--plan", str(path), "--here"]) == 1
    pin = st.parse_pin(Path(plan["pin"]).read_text())
    assert pin["version"] == v and "nvidia-fabricmanager-580" in pin["packages"]
    err = capsys.readouterr().err
    assert "`systemctl enable nvidia-fabricmanager.service` exited 1" in err and "apt finished the install" in err


def test_an_interruption_during_apt_puts_the_hold_and_pin_back_and_unmasks(monkeypatch, tmp_path, plan, capsys):
    pin = write_old_pin(plan)
    fake = FakeBox(held_state(), simulate=(0, UPDATE), raises={"-y": Interrupted("the driver job was stopped by SIGTERM")})
    assert run_main(monkeypatch, tmp_path, dict(plan, update=True), fake, "install") == 1
    assert Path(plan["pin"]).read_text() == pin and masks(plan) == []
    assert held_names([c for c in fake.calls if is_hold(c)][-1]) == ["libcuda1", "nvidia-driver", "nvidia-kernel-dkms"]
    err = capsys.readouterr().err
    assert "the driver job was stopped by SIGTERM. apt changed no driver package: the previous hold and pin are back" in err
    status = json.loads(Path(plan["job_status"]).read_text())
    assert status["state"] == "done" and status["rc"] == 1 and "stopped by SIGTERM" in status["message"]
    # what the unit's ExecStopPost puts back were this process killed outright: written before the hold went
    assert status["restore"]["held"] == list(MOVING) and status["restore"]["pin"] == pin
    assert status["restore"]["target"] == {p: UPDATED for p in MOVING}


def test_an_unexpected_error_during_apt_puts_the_hold_and_pin_back_and_the_job_fails(monkeypatch, tmp_path, plan,
                                                                                      capsys):
    """An error that is no Failed (an OSError of the box, a fault of the program) after the hold was released: the
    hold and the pin are put back as for any failure, and the job's outcome is a failure naming it. Before, the
    hold was left released and the status said rc 0: the caller printed success. Mutations: either ``except
    Exception`` removed (nvidia_driver_install._change: nothing held; nvidia_driver.run_here: rc 0)."""
    pin = write_old_pin(plan)
    fake = FakeBox(held_state(), simulate=(0, UPDATE), raises={"-y": OSError(5, "Input/output error")})
    assert run_main(monkeypatch, tmp_path, dict(plan, update=True), fake, "install") == 1
    assert Path(plan["pin"]).read_text() == pin and masks(plan) == []
    assert held_names([c for c in fake.calls if is_hold(c)][-1]) == list(MOVING)
    err = capsys.readouterr().err
    assert "the driver change stopped on an unexpected error (OSError: [Errno 5] Input/output error). apt changed no " \
           "driver package: the previous hold and pin are back" in err
    status = json.loads(Path(plan["job_status"]).read_text())
    assert status["state"] == "done" and status["rc"] == 1 and "unexpected error (OSError" in status["message"]


def test_a_fault_outside_the_change_is_the_jobs_failure_not_its_success(monkeypatch, tmp_path, plan, capsys):
    def broken(plan, log, read, headers_only=False):
        raise TypeError("'CompletedProcess' object is not iterable")

    monkeypatch.setattr(box.inst, "do_install", broken)
    assert run_main(monkeypatch, tmp_path, plan, FakeBox(recorded("debian12_fresh")), "install") == 1
    status = json.loads(Path(plan["job_status"]).read_text())
    assert status["state"] == "done" and status["rc"] == 1, status
    assert status["message"] == ("the driver job stopped on an unexpected error (TypeError: 'CompletedProcess' object "
                                 "is not iterable); its traceback is in `journalctl -u verl-lab-driver-apt.service`")
    assert "Traceback" in capsys.readouterr().err


def test_the_job_turns_sigterm_sighup_and_sigint_into_that_failure(monkeypatch, tmp_path, plan):
    seen = {}

    def record(plan, log, read, headers_only=False):
        seen.update({s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)})
        with pytest.raises(Interrupted, match="stopped by SIGHUP"):
            seen[signal.SIGHUP](signal.SIGHUP, None)

    monkeypatch.setattr(box.inst, "do_install", record)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        assert run_main(monkeypatch, tmp_path, plan, FakeBox(recorded("debian12_fresh")), "install") == 0
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert all(callable(h) and h not in (signal.SIG_DFL, signal.SIG_IGN) for h in seen.values())


# ---------------------------------------------------------------- the job's ExecStopPost


def test_release_after_a_kill_secures_the_hold_and_pin_and_unmasks(monkeypatch, tmp_path, plan, capsys):
    write_old_pin(plan)
    units._write_record([TRAIN, RAY])
    Path(units.MASK_DIR).mkdir()
    for u in (TRAIN, RAY):
        (Path(units.MASK_DIR) / u).symlink_to("/dev/null")
    before = {"pin": Path(plan["pin"]).read_text(), "held": ["libcuda1", "nvidia-driver", "nvidia-kernel-dkms"],
              "versions": hold.present(st.parse_fact_output(held_state()), plan),
              "target": {p: UPDATED for p in ("libcuda1", "nvidia-driver", "nvidia-kernel-dkms")}}
    Path(plan["job_status"]).write_text(json.dumps({"state": "running", "restore": before, "command": "install"}))
    monkeypatch.setenv("SERVICE_RESULT", "signal")
    monkeypatch.setenv("EXIT_CODE", "killed")
    monkeypatch.setenv("EXIT_STATUS", "KILL")
    fake = FakeBox(half_done({"nvidia-driver": UPDATED}, {"nvidia-driver": "iU "}))
    assert run_main(monkeypatch, tmp_path, plan, fake, "release") == 0
    assert masks(plan) == [] and not Path(units.RECORD).exists()
    assert st.parse_pin(Path(plan["pin"]).read_text())["version"] == UPDATED
    status = json.loads(Path(plan["job_status"]).read_text())
    assert status["state"] == "done" and status["rc"] == 1
    assert status["message"].startswith("the driver job ended before it finished (signal (killed KILL)). apt stopped "
                                        "part-way")
    assert "dpkg left nvidia-driver (iU) not configured" in capsys.readouterr().err


def test_release_of_a_job_that_released_nothing_or_finished_only_unmasks(monkeypatch, tmp_path, plan):
    for status, said in (({"state": "starting"}, "it had released no hold and no pin yet: the box is as it was"),
                         ({"state": "done", "rc": 0, "message": ""}, "")):
        units._write_record([TRAIN])
        Path(units.MASK_DIR).mkdir(exist_ok=True)
        (Path(units.MASK_DIR) / TRAIN).symlink_to("/dev/null")
        Path(plan["job_status"]).write_text(json.dumps(status))
        fake = FakeBox(held_state())
        assert run_main(monkeypatch, tmp_path, plan, fake, "release") == 0
        assert masks(plan) == [] and not [c for c in fake.calls if c[0] == "apt-mark"]
        assert json.loads(Path(plan["job_status"]).read_text()).get("message", "").endswith(said)


def test_unmask_removes_only_the_stages_own_masks_and_none_while_a_job_runs(monkeypatch, tmp_path, plan):
    Path(units.MASK_DIR).mkdir()
    (Path(units.MASK_DIR) / TRAIN).symlink_to("/dev/null")
    (Path(units.MASK_DIR) / "someone-elses.service").symlink_to("/dev/null")
    units._write_record([TRAIN])
    assert run_main(monkeypatch, tmp_path, plan, FakeBox(held_state(), job="active"), "unmask") == 0
    assert masks(plan) == ["someone-elses.service", TRAIN]
    assert run_main(monkeypatch, tmp_path, plan, FakeBox(held_state()), "unmask") == 0
    assert masks(plan) == ["someone-elses.service"]


# ---------------------------------------------------------------- the job: apt outside the SSH session


class Systemd:
    """systemd-run and the job unit's state: starting the job runs ``body`` (what the unit would)."""

    def __init__(self, plan, body=None, state="inactive", run_rc=0, run_err=""):
        self.plan, self.body, self.state, self.run_rc, self.run_err = plan, body, state, run_rc, run_err
        self.calls = []

    def __call__(self, argv, capture_output=True, text=True, **kw):
        self.calls.append(list(argv))
        if argv[0] == "systemd-run":
            if self.run_rc == 0 and self.body:
                self.body()
            return subprocess.CompletedProcess(argv, self.run_rc, "", self.run_err)
        if argv[:2] == ["systemctl", "show"]:
            return subprocess.CompletedProcess(argv, 0, self.state + "\n", "")
        raise AssertionError(argv)


def finish(plan, rc=0, lines=("+ apt-get update", "held 23 packages")):
    def body():
        with open(plan["log"], "a") as fh:
            fh.write("".join(f"{line}\n" for line in lines))
        job.write_status(plan, state="done", rc=rc, message="" if rc == 0 else "apt failed")
    return body


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(job, "POLL_S", 0)
    monkeypatch.setattr(job, "NO_RESULT_S", 0)


def run_job(monkeypatch, plan, fake, tmp_path, capsys):
    monkeypatch.setattr(job.subprocess, "run", fake)
    Path(plan["log"]).parent.mkdir(parents=True, exist_ok=True)
    Path(plan["log"]).write_text("an earlier run's line\n")
    path = tmp_path / "driver-plan.json"
    path.write_text(json.dumps(plan))
    return box.main(["install", "--plan", str(path)])


def test_the_install_runs_as_a_transient_unit_and_the_caller_follows_it(monkeypatch, tmp_path, plan, capsys, quick):
    fake = Systemd(plan, finish(plan))
    assert run_job(monkeypatch, plan, fake, tmp_path, capsys) == 0
    run = next(c for c in fake.calls if c[0] == "systemd-run")
    assert run[1:4] == [f"--unit={st.JOB_UNIT}", "--collect", "--quiet"]
    post = next(a for a in run if a.startswith("--property=ExecStopPost="))
    assert post.endswith(f"nvidia_driver.py release --plan {tmp_path}/driver-plan.json")
    assert run[-4:] == ["install", "--here", "--plan", f"{tmp_path}/driver-plan.json"]
    out = capsys.readouterr().out
    assert "+ apt-get update\nheld 23 packages" in out and "an earlier run's line" not in out
    assert json.loads(Path(plan["job_status"]).read_text())["reported"] is True


def test_a_running_job_is_followed_not_started_twice(monkeypatch, tmp_path, plan, capsys, quick):
    job.write_status(plan, command="install", state="running", started="2026-12-05T13:19:44Z", log_offset=0)
    fake = Systemd(plan, state="active")
    fake.body = None
    monkeypatch.setattr(job, "running", lambda: json.loads(Path(plan["job_status"]).read_text())["state"] != "done")
    monkeypatch.setattr(job.time, "sleep", lambda s: finish(plan)())
    assert run_job(monkeypatch, plan, fake, tmp_path, capsys) == 0
    assert not [c for c in fake.calls if c[0] == "systemd-run"]
    out = capsys.readouterr().out
    assert ("a driver install started 2026-12-05T13:19:44Z is still running here (verl-lab-driver-apt.service): "
            "following it") in out and "an earlier run's line" in out          # its whole log, from its start


def test_a_job_another_deploy_started_a_moment_earlier_is_followed(monkeypatch, tmp_path, plan, capsys, quick):
    err = "Failed to start transient service unit: Unit verl-lab-driver-apt.service was already loaded or has a " \
          "fragment file.\n"                 # systemd 252's words (a lab box)
    fake = Systemd(plan, run_rc=1, run_err=err)
    monkeypatch.setattr(job.time, "sleep", lambda s: finish(plan, rc=1)())
    assert run_job(monkeypatch, plan, fake, tmp_path, capsys) == 1


def test_an_outcome_nobody_followed_is_reported_by_the_next_caller(monkeypatch, tmp_path, plan, capsys, quick):
    job.write_status(plan, command="install", state="done", rc=1, started="T0", message="apt failed: E: x",
                     reported=False)
    assert run_job(monkeypatch, plan, Systemd(plan, finish(plan)), tmp_path, capsys) == 0
    assert "the last driver install (started T0) ended while nobody followed it: it failed (exit 1): apt failed: E: x" \
        in capsys.readouterr().out


def test_a_job_that_ends_without_a_result_or_cannot_start_is_said(monkeypatch, tmp_path, plan, capsys, quick):
    assert run_job(monkeypatch, plan, Systemd(plan, body=lambda: None), tmp_path, capsys) == 1
    assert f"the driver job ({st.JOB_UNIT}) ended without writing its result" in capsys.readouterr().err
    fake = Systemd(plan, run_rc=1, run_err="System has not been booted with systemd as init system (PID 1).")
    assert run_job(monkeypatch, plan, fake, tmp_path, capsys) == 1
    assert "it needs a box booted with systemd" in capsys.readouterr().err


# ---------------------------------------------------------------- before the settle step reboots


def test_the_reboot_guard(monkeypatch, tmp_path, plan, capsys):
    assert run_main(monkeypatch, tmp_path, plan, FakeBox(held_state(), job="active"), "reboot-guard") == 1
    assert "a driver job is still running (verl-lab-driver-apt.service): not rebooting under apt" in capsys.readouterr().err
    busy = unit_lines(held_state(), RAY, "active", "running")
    fake = FakeBox(busy)
    assert run_main(monkeypatch, tmp_path, plan, fake, "reboot-guard") == 1
    assert masks(plan) == [] and reloads(fake) == 0
    assert f"{RAY} is active (running): no driver package is changed" in capsys.readouterr().err
    fake = FakeBox(held_state(), initramfs=True, rc={"update-initramfs": 1})
    assert run_main(monkeypatch, tmp_path, plan, fake, "reboot-guard") == 1
    assert masks(plan) == [] and "update-initramfs -u failed" in capsys.readouterr().err
    fake = FakeBox(held_state(), initramfs=True)
    assert run_main(monkeypatch, tmp_path, plan, fake, "reboot-guard") == 0
    assert masks(plan) == sorted([TRAIN, RAY])                               # until the boot
    assert ["update-initramfs", "-u"] in fake.calls


# ---------------------------------------------------------------- the supported-GPU list is never skipped


@pytest.mark.parametrize("change,said", [
    ({"supported_gpus": None}, "the plan names no package whose supported-gpus.json lists the GPUs"),
    ({"supported_gpus": {"package": "nvidia-driver"}, "gpus": []}, "no GPU was read on this box"),
    ({"supported_gpus": {"package": "nvidia-kernel-common-580-server"}},
     "nvidia-kernel-common-580-server, whose supported-gpus.json lists the GPUs, is neither in apt's simulation nor "
     "installed"),
])
def test_the_supported_gpu_check_never_skips_silently(monkeypatch, tmp_path, plan, capsys, change, said):
    fake = FakeBox(recorded("debian12_fresh"))
    assert run_main(monkeypatch, tmp_path, {**plan, **change}, fake, "install", gpu_list=True) == 1
    assert not [c for c in fake.calls if c[:3] == ["apt-get", "-y", "install"]]
    assert said in capsys.readouterr().err


def test_hold_refuses_a_half_done_change(monkeypatch, tmp_path, plan, capsys):
    """Holding the configured packages alone would leave the unconfigured ones out of the pin."""
    fake = FakeBox(half_done({"nvidia-driver": UPDATED}, {"nvidia-driver": "iU "}))
    assert run_main(monkeypatch, tmp_path, plan, fake, "hold") == 1
    assert not [c for c in fake.calls if is_hold(c)] and not Path(plan["pin"]).exists()
    assert "dpkg left nvidia-driver not configured: a driver change stopped part-way" in capsys.readouterr().err


def test_a_second_caller_waits_for_the_first_ones_unit_and_follows_it(monkeypatch, tmp_path, plan, capsys, quick):
    """The check for a running job, the status and systemd-run happen under one lock: a second
    deploy that starts at the same moment cannot write over the first job's status."""
    import fcntl
    import threading

    fake = Systemd(plan, finish(plan))
    Path(plan["log"]).parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(job.subprocess, "run", fake)
    result = {}
    with open(plan["job_status"] + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)                          # the first caller, between its check and its unit
        t = threading.Thread(target=lambda: result.update(rc=job.start(plan, "/p/plan.json", "install", "/p/prog")))
        t.start()
        t.join(0.5)
        assert t.is_alive() and fake.calls == []                  # waiting: no check, no status, no systemd-run
    t.join(10)
    assert result["rc"] == 0 and [c[0] for c in fake.calls].count("systemd-run") == 1


def test_a_cut_package_whose_version_left_the_archive_is_named_with_its_fix(monkeypatch, tmp_path, plan, capsys):
    """Found on the lab's real Debian 12 box: a package left reinst-required (hUR) at a version the archive no
    longer has (a security build superseded) makes apt's simulation fail ("needs to be reinstalled, but I can't
    find an archive for it"); the message blamed a missing kernel headers package. Mutation: ``gone`` always []
    (the headers hint comes back)."""
    pin = write_old_pin(plan)
    state = held_state().replace("nvidia-driver\tnvidia-graphics-drivers\t535.261.03-1\thi ",
                                 "nvidia-driver\tnvidia-graphics-drivers\t535.261.03-1\thUR")
    said = "E: The package nvidia-driver needs to be reinstalled, but I can't find an archive for it.\n"
    assert run_main(monkeypatch, tmp_path, plan, FakeBox(state, simulate=(100, said)), "install") == 1
    assert Path(plan["pin"]).read_text() == pin
    err = capsys.readouterr().err
    assert "dpkg's unpack of nvidia-driver was cut (reinst-required) at a version this box's archive no longer has" \
           in err and "`dpkg --remove --force-remove-reinstreq nvidia-driver`" in err and "running kernel" not in err, err
