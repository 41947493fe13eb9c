"""The NVIDIA driver of a box: installed from the distro's archive, held, loaded, proven.

The driver stage (tasks/driver.py, ``driver = "install"``) ships this file as it is to
``<lab_root>/libexec/driver/nvidia_driver.py`` (with its sibling modules ``nvidia_driver_*.py`` and
``gpu.py`` as ``verl_lab_gpu.py`` beside it) and runs it as root with the box's python3, reading the
stage's ``driver-plan.json`` beside it::

    nvidia_driver.py install --plan P   # starts the install in a transient systemd unit
                                        # (nvidia_driver_job.py) and follows it; a running one is
                                        # followed, not started twice. The steps (--here, inside that
                                        # unit): the training and Ray units idle or stopped, masked;
                                        # apt's --simulate judged; exactly its versions installed;
                                        # hold, pin, initramfs (nvidia_driver_install.py)
    nvidia_driver.py headers --plan P   # the running kernel's headers alone (the driver untouched), the same way
    nvidia_driver.py hold --plan P      # apt-mark hold and the apt preferences pin, for what is
                                        # installed from the branch's source package
    nvidia_driver.py verdict --plan P   # JSON: the installed driver is loaded, loadable now,
                                        # waiting for a reboot, or has no module for this kernel
    nvidia_driver.py load --plan P      # modprobe nvidia (verdict "load" only); Fabric Manager started
    nvidia_driver.py reboot-guard --plan P
                                        # before the settle step reboots: no driver job running, the
                                        # units idle (or stopped) and masked until the boot, the
                                        # initramfs rebuilt; any failure unmasks and says why
    nvidia_driver.py prove --plan P     # /proc/driver/nvidia/version and nvidia-smi say the installed
                                        # version (and cuInit succeeds on an NVSwitch box); prints it
    nvidia_driver.py release --plan P   # the job unit's ExecStopPost: a job that ended before it
                                        # finished (killed) gets its hold and pin put back; the units
                                        # are unmasked in every outcome
    nvidia_driver.py unmask --plan P    # remove the masks the stage left (its record under /run)

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import traceback

try:
    from verl_lab_box import nvidia_driver_hold as hold
    from verl_lab_box import nvidia_driver_install as inst
    from verl_lab_box import nvidia_driver_job as job
    from verl_lab_box import nvidia_driver_state as box_state
    from verl_lab_box import nvidia_driver_units as units
    from verl_lab_box.nvidia_driver_log import Failed, Interrupted, Log
except ImportError:                     # on a box: the modules lie side by side
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import nvidia_driver_hold as hold
    import nvidia_driver_install as inst
    import nvidia_driver_job as job
    import nvidia_driver_state as box_state
    import nvidia_driver_units as units
    from nvidia_driver_log import Failed, Interrupted, Log

PROC_VERSION = box_state.PROC_VERSION
CUDA_ERRORS = {802: "system not ready (CUDA_ERROR_SYSTEM_NOT_READY: on an NVSwitch box, Fabric Manager has not "
                    "set up the fabric)", 100: "no CUDA-capable device", 999: "unknown error"}
COMMANDS = ("install", "headers", "hold", "verdict", "load", "reboot-guard", "prove", "release", "unmask")


# ---------------------------------------------------------------- acting on the box (root)


def read_box(plan: dict) -> dict:
    out = subprocess.run(["sh", "-c", box_state.fact_command(plan["pin"], plan.get("units") or [plan["unit"]])],
                         capture_output=True, text=True)
    return box_state.parse_fact_output(out.stdout)


def run_here(plan: dict, command: str, log: Log) -> int:
    """The job's body (inside its systemd unit): the install or the headers, its outcome written to
    the job's status. SIGTERM, SIGHUP and SIGINT become a failure, so the hold, the pin and the masks
    are put back on the way out (SIGKILL: the unit's ExecStopPost, ``release``)."""
    def interrupted(signum, _frame):
        raise Interrupted(f"the driver job was stopped by {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, interrupted)
    if plan.get("job_status"):
        job.write_status(plan, state="running", pid=os.getpid())
    rc, message = 0, ""
    try:
        inst.do_install(plan, log, lambda: read_box(plan), headers_only=command == "headers")
    except Failed as exc:
        rc, message = 1, str(exc)
        log.say(f"verl-lab driver: {exc}", sys.stderr)
    except Exception as exc:            # never "it succeeded": the outcome says the job failed and where to look
        rc, message = 1, (f"the driver job stopped on an unexpected error ({type(exc).__name__}: {exc}); its traceback "
                          f"is in `journalctl -u {box_state.JOB_UNIT}`")
        log.say(f"verl-lab driver: {message}", sys.stderr)
        traceback.print_exc()
    finally:
        if plan.get("job_status"):
            job.write_status(plan, state="done", rc=rc, message=message)
    return rc


def release(plan: dict, log: Log) -> None:
    """ExecStopPost of the job's unit: however the job ended, the units are unmasked; one that ended
    before writing its outcome (SIGKILL, the OOM killer) gets the hold and the pin put back over what
    apt left, and its outcome written."""
    try:
        status = job.read_status(plan)
        if status.get("state") not in ("done", None):
            what = f"the driver job ended before it finished ({job.exit_words()})"
            if status.get("restore"):
                what += ". " + hold.secure(plan, status["restore"], log, lambda: read_box(plan))
            else:
                what += "; it had released no hold and no pin yet: the box is as it was"
            job.write_status(plan, state="done", rc=1, message=what)
            log.say(f"verl-lab driver: {what}", sys.stderr)
    finally:
        units.unmask(log)


def reboot_guard(plan: dict, log: Log) -> None:
    """Before the settle step reboots the box: no driver job running, the units idle (or stopped, with
    driver_busy = 'stop') and masked (the boot ends the mask), the initramfs rebuilt. A failure
    unmasks and says why: the box is not rebooted."""
    if job.running():
        raise Failed(f"a driver job is still running ({box_state.JOB_UNIT}): not rebooting under apt. Re-run the "
                     "driver stage once it ended (a re-run follows it)")
    try:
        units.take(plan, lambda: read_box(plan), log)
        inst.rebuild_initramfs(log)
    except Failed:
        units.unmask(log)
        raise
    log.say("ok    ready to reboot: the units stay masked until the boot")


def cuda_init() -> int:
    """cuInit(0) through the installed libcuda: 0 when CUDA can use the GPUs."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return -1
    return int(lib.cuInit(0))


def do_prove(plan: dict, log: Log) -> str:
    state = read_box(plan)
    v = box_state.verdict(state, plan["module_package"])
    if v["verdict"] != "loaded":
        raise Failed(f"the driver is not loaded: {v['reason']}")
    installed = v["installed"]
    log.say(f"ok    {PROC_VERSION}: {installed}")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    rows = [line.split(", ") for line in smi.stdout.splitlines() if line.strip()]
    if smi.returncode != 0 or not rows:
        raise Failed(f"nvidia-smi failed (exit {smi.returncode}): {(smi.stdout + smi.stderr).strip()[:300]}")
    other = [r for r in rows if r[-1].strip() != installed]
    if other:
        raise Failed(f"nvidia-smi reports driver {other[0][-1].strip()} for GPU {other[0][0]}, not {installed}")
    log.say(f"ok    nvidia-smi: {len(rows)} GPU(s), driver {installed}")
    if plan.get("fabricmanager"):
        rc = cuda_init()
        if rc != 0:
            raise Failed(f"cuInit failed ({rc}: {CUDA_ERRORS.get(rc, 'see cuda.h')}): nvidia-smi answers, CUDA does not. "
                         f"See `systemctl status {plan['fabricmanager']['service']}` and "
                         "/var/log/fabricmanager.log")
        log.say("ok    cuInit: CUDA initialises the GPUs through the NVSwitch fabric")
    return installed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--plan", required=True, help="driver-plan.json written by the driver stage")
    parser.add_argument("--here", action="store_true", help="install/headers: run the steps in this process (what "
                                                           "the job's systemd unit runs)")
    args = parser.parse_args(argv)
    with open(args.plan, encoding="utf-8") as fh:
        plan = json.load(fh)
    if args.command in ("install", "headers") and not args.here:
        try:
            return job.start(plan, os.path.abspath(args.plan), args.command, os.path.abspath(__file__))
        except Failed as exc:
            print(f"verl-lab driver: {exc}", file=sys.stderr, flush=True)
            return 1
    # prove prints only the version on stdout (the marker reads it): its report goes to stderr
    log = Log(plan.get("log") if args.command != "verdict" else None,
              sys.stderr if args.command == "prove" else None)
    try:
        if args.command in ("install", "headers"):
            return run_here(plan, args.command, log)
        if args.command == "hold":
            hold.do_hold(plan, log, lambda: read_box(plan))
        elif args.command == "verdict":
            print(json.dumps(box_state.verdict(read_box(plan), plan["module_package"])))
        elif args.command == "load":
            log.run(["modprobe", "nvidia"])
            log.run(["modprobe", "nvidia-uvm"], check=False)
            if plan.get("fabricmanager"):
                log.run(["systemctl", "start", plan["fabricmanager"]["service"]])
        elif args.command == "reboot-guard":
            reboot_guard(plan, log)
        elif args.command == "release":
            release(plan, log)
        elif args.command == "unmask":            # a leftover of a change that ended badly; a running job keeps its own
            if job.running():
                log.say(f"a driver job runs ({box_state.JOB_UNIT}): its masks stay until it ends")
            else:
                units.unmask(log)
        else:
            print(do_prove(plan, log))
    except Failed as exc:
        log.say(f"verl-lab driver: {exc}", sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
