"""The driver stage's execute-time step: load the installed NVIDIA module, or reboot the box for it
(only with ``driver_reboot``, one box at a time through pyinfra's ``_serial``, and only after the box
program's ``reboot-guard`` passed: no driver job running, the training and Ray units idle (any state
but inactive or failed is busy) or stopped under ``driver_busy = 'stop'``, masked until the boot, the
initramfs rebuilt), or stop with the reason."""

from __future__ import annotations

import json
import shlex

from pyinfra import logger
from pyinfra.api import FunctionCommand, StringCommand, operation

REBOOT_WAIT_S = 900


def _say(target, message: str) -> None:
    target.log_styled(message, fg="red", log_func=logger.error)


def _run(target, command: str):
    """(ok, output) of a shell command on ``target`` (the stage connects as root)."""
    return target.run_shell_command(StringCommand(command))


def _settle(state, host, python: str, program: str, plan_path: str, reboot: bool, wait_s: int):
    """At execute time: load the installed module, or reboot the box for it (when allowed), or stop."""
    q = shlex.quote
    cmd = f"{q(python)} {q(program)} verdict --plan {q(plan_path)}"
    ok, out = _run(host, cmd)
    try:
        v = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        _say(host, f"verl-lab driver: {host.name}: `{cmd}` gave no verdict: {out.output[-400:]}")
        return False
    if v["verdict"] == "loaded":
        return True
    if v["verdict"] == "load":
        ok, out = _run(host, f"{q(python)} {q(program)} load --plan {q(plan_path)}")
        if not ok:
            _say(host, f"verl-lab driver: {host.name}: modprobe nvidia failed: {out.output[-600:]}")
        return ok
    if v["verdict"] != "reboot":
        _say(host, f"verl-lab driver: {host.name}: the driver {v['installed']} is installed and held, but {v['reason']}")
        return False
    if not reboot:
        _say(host, f"verl-lab driver: {host.name}: reboot needed: the driver {v['installed']} is installed and held, but "
             f"{v['reason']}. Reboot the box and re-run, or set driver_reboot = True to let the stage reboot it "
             "(one box at a time, never while training runs)")
        return False
    ok, out = _run(host, f"{q(python)} {q(program)} reboot-guard --plan {q(plan_path)}")
    if not ok:
        said = [line for line in out.output.splitlines() if line.startswith("verl-lab driver: ")]
        _say(host, f"verl-lab driver: {host.name}: reboot needed for the driver {v['installed']}, but not rebooting: "
             + (said[-1][len("verl-lab driver: "):] if said else out.output[-600:]))
        return False
    if not reboot_and_wait(host, wait_s):
        if not host.connected:
            host.connect(show_errors=False)
        if host.connected:               # a box that did not reboot: its units are not left masked
            _run(host, f"{q(python)} {q(program)} unmask --plan {q(plan_path)}")
        return False
    return True


REBOOT_TOKEN = "/run/verl-lab-driver-reboot"   # /run is emptied by every boot


def reboot_and_wait(host, wait_s: int) -> bool:
    """Reboot the box and wait until it answers again with a new boot (the token under /run gone) and
    systemd has finished starting."""
    import time

    ok, _ = _run(host, f"touch {REBOOT_TOKEN} && ( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")
    if not ok:
        _say(host, f"verl-lab driver: {host.name}: could not start the reboot")
        return False
    logger.info(f"[{host.name}] verl-lab driver: rebooting to load the installed driver")
    time.sleep(5)
    host.disconnect()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        host.connect(show_errors=False)
        if host.connected:
            ok, _ = _run(host, f"test ! -e {REBOOT_TOKEN} && "
                                           "timeout 120 systemctl is-system-running --wait >/dev/null; "
                                           f"test ! -e {REBOOT_TOKEN}")
            if ok:
                return True
            host.disconnect()
        time.sleep(3)
    _say(host, f"verl-lab driver: {host.name}: the box did not come back within {wait_s} s of its reboot")
    return False


@operation(is_idempotent=False)
def settle_driver(python: str, program: str, plan_path: str, reboot: bool, wait_s: int = REBOOT_WAIT_S):
    """Load the installed NVIDIA module: modprobe where nothing holds the GPU; a reboot where another
    module or nouveau does (only with ``reboot``, only once the box program's ``reboot-guard`` passed;
    run with ``_serial=True`` so boxes reboot one at a time); else fail the host with the reason.

    .. code:: python

        settle_driver(name="Load the driver", python="/usr/bin/python3", program=".../nvidia_driver.py",
                      plan_path=".../driver-plan.json", reboot=False, _serial=True)
    """
    yield FunctionCommand(_settle, (python, program, plan_path, reboot, wait_s), {})
