"""The driver stage's reboot step (tasks/driver/settle.py) on lab-in-a-box Debian 12 hosts of its own:
real systemd and SSH, a box rebooted from inside (the lab starting it again as
systemd-nspawn@.service would), the stage waiting for the new boot, one box at a time, and the real
reboot guard of the box program (verl_lab_box/nvidia_driver.py reboot-guard): a training unit
restarting after a crash (`activating (auto-restart)`), a running Ray unit, or a failed
update-initramfs keep the box up. A container never holds a kernel module, so the verdict that calls
for the reboot comes from a stand-in program (the settle deploy: tests/fixtures/driver/settle_deploy.py),
which hands every other command to the real box program placed beside it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fixtures.standins import driver as standin
from tests.lab import BoxSpec

KERNEL = os.uname().release
PIN = "/etc/apt/preferences.d/verl-lab-nvidia-driver"
TRAIN, RAY = standin.TRAIN, standin.RAY

SETTLE = "tests/fixtures/driver/settle_deploy.py"
TEST_DIR = "/opt/verl-lab-test"
STANDIN_VERDICT = f"""#!/usr/bin/python3
# STAND-IN for nvidia_driver.py verdict (tests/e2e/test_driver.py): what a box with the new driver
# installed under an old loaded module answers; a container never holds a kernel module. Every
# other command is the real box program's (placed beside it), the reboot guard among them.
import json, os, sys
if sys.argv[1] != "verdict":
    os.execv(sys.executable, [sys.executable, "{TEST_DIR}/nvidia_driver.py", *sys.argv[1:]])
print(json.dumps({{"verdict": "reboot", "installed": "535.261.03",
                  "reason": "the running kernel still has the nvidia module 535.104.05 loaded: a reboot loads 535.261.03"}}))
"""
# what the reboot guard reads of the driver plan (tasks/driver/plan.py box_plan)
GUARD_PLAN = {"units": [TRAIN, RAY], "busy": "refuse", "pin": PIN, "log": "/opt/verl-lab/logs/driver.log",
              "job_status": f"{TEST_DIR}/driver-job.json", "unit": TRAIN}


@pytest.fixture(scope="module")
def rebooting(lab_factory):
    from tasks.driver.stage import BOX_MODULES
    lab = lab_factory([BoxSpec("rb1", gpu="p40"), BoxSpec("rb2", gpu="t4")])
    repo = Path(__file__).resolve().parents[2] / "verl_lab_box"
    for box in lab.boxes.values():
        box.write_text(f"{TEST_DIR}/verdict.py", STANDIN_VERDICT, mode="755")
        for name in ("nvidia_driver.py", *BOX_MODULES):
            box.write_text(f"{TEST_DIR}/{name}", (repo / name).read_text())
        box.write_text(f"{TEST_DIR}/verl_lab_gpu.py", (repo / "gpu.py").read_text())
        box.write_text(f"{TEST_DIR}/driver-plan.json", json.dumps(GUARD_PLAN))
    return lab


def booted_at(box) -> int:
    """When the box's PID 1 (its systemd) started: a new value after every boot."""
    return int(box.ssh("stat -c %Y /proc/1").stdout)


def test_reboot_needs_driver_reboot(rebooting):
    before = {name: booted_at(b) for name, b in rebooting.boxes.items()}
    res = rebooting.deploy(SETTLE, data={"driver": "install"})
    assert sorted(res.failed_hosts) == ["rb1", "rb2"]
    assert "rb1: reboot needed: the driver 535.261.03 is installed and held, but the running kernel still has the " \
           "nvidia module 535.104.05 loaded" in res.output and "set driver_reboot = True" in res.output
    assert {name: booted_at(b) for name, b in rebooting.boxes.items()} == before


def test_a_box_whose_training_or_ray_unit_is_busy_is_not_rebooted(rebooting):
    """Before: `systemctl is-active` of the training unit alone; one restarting after a crash, or the
    Ray unit, let the reboot go."""
    restarting, ray = rebooting.box("rb1"), rebooting.box("rb2")
    standin.start_unit(restarting, "auto-restart")
    standin.start_unit(ray, "ray")
    before = {b.name: booted_at(b) for b in (restarting, ray)}
    try:
        res = rebooting.deploy(SETTLE, data={"driver": "install", "driver_reboot": True})
        states = {restarting.name: standin.unit_state(restarting, TRAIN), ray.name: standin.unit_state(ray, RAY)}
    finally:
        standin.remove_units(restarting)
        standin.remove_units(ray)
    assert sorted(res.failed_hosts) == ["rb1", "rb2"], res
    assert (f"rb1: reboot needed for the driver 535.261.03, but not rebooting: {TRAIN} is activating (auto-restart): "
            "no driver package is changed under a running job") in res.output, res.tail(40)
    assert f"rb2: reboot needed for the driver 535.261.03, but not rebooting: {RAY} is active (running)" in res.output
    assert {b.name: booted_at(b) for b in (restarting, ray)} == before
    assert states["rb1"]["SubState"] == "auto-restart" and states["rb2"]["SubState"] == "running"
    assert all(s["UnitFileState"] != "masked-runtime" for s in states.values())


def test_an_update_initramfs_failure_stops_the_reboot(rebooting):
    box = rebooting.box("rb1")
    standin.failing_update_initramfs(box)
    before = booted_at(box)
    try:
        res = rebooting.deploy(SETTLE, hosts=["rb1"], data={"driver": "install", "driver_reboot": True})
    finally:
        standin.remove_standins(box)
    assert res.failed_hosts == ["rb1"]
    assert ("rb1: reboot needed for the driver 535.261.03, but not rebooting: update-initramfs -u failed (exit 1: "
            f"update-initramfs: failed for /boot/initrd.img-{KERNEL} with 1.)") in res.output, res.tail(40)
    assert booted_at(box) == before and standin.unmasked(box)


def test_boxes_reboot_one_at_a_time(rebooting):
    before = {name: booted_at(b) for name, b in rebooting.boxes.items()}
    res = rebooting.deploy(SETTLE, data={"driver": "install", "driver_reboot": True})
    res.assert_ok()
    after = {name: booted_at(b) for name, b in rebooting.boxes.items()}
    assert all(after[n] > before[n] for n in after)
    # each reboot waits at least 5 s before the box is polled: run side by side, both boxes would
    # have booted within the same second or two
    assert abs(after["rb1"] - after["rb2"]) >= 5, after
    assert all(b.reboots >= 1 for b in rebooting.boxes.values())
    assert all(standin.unmasked(b) for b in rebooting.boxes.values())                # the boot ended the masks
