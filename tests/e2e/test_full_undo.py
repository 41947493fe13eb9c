"""deploy/full.py's undo path (issue 44, "Convergence both ways"): what the settings no longer ask for is undone by
deploy/full.py itself, each part with its line, and the box is as it was.

tests/e2e/test_converge.py turns a Ray cluster and the tracking hub on and off through deploy/train.py,
deploy/cluster.py and deploy/tracking.py, and tests/e2e/test_driver.py the driver's hold and pin through
deploy/driver.py, each on real settings. Here the shared fleet's T4 box (tests/e2e/conftest.py ``fleet_lab``,
converged by deploy/full.py, after the modules that read it) goes through deploy/full.py, which calls the same undo
at three points: the driver's part right after the base stage (its facts in the undo stage's bundle), the cluster's
parts before the train stage, the trackers' after it.

1. The listing of the box (tests/lab/listing.py, with the folders the driver stage writes in) before.
2. On, by a real setting: an online tracker with a key (``tracking.trackers`` with wandb, ``keys_file``): deploy/
   full.py writes ``tracking-keys.env`` and names it in the training unit. And, planted as the stages leave them
   (stand-ins: a cluster needs a second box and a Ray head, the driver stage Debian's archive and apt; each is on
   and off for real in the modules above): the cluster stage's drop-in (its own template rendered) and ``ray.env``;
   the driver stage's pin, ``libexec/driver`` with its plan, marker, nouveau blacklist, and its runtime mask of the
   Ray unit with its record.
3. Off: deploy/full.py with the converge's settings: every part undone, each said (the driver's blacklist too: no
   NVIDIA package is installed here), the summary line names the undo stage, and the listing equals 1.
4. A second run changes nothing.
"""

from __future__ import annotations

import json
import re

import pytest

from tasks.cluster import DROPIN_TEMPLATE, TRAIN_DROPIN
from tasks.driver.plan import BLACKLIST, BLACKLIST_FILE, PIN_FILE
from tasks.placed import rendered
from tests.lab.listing import ROOTS, box_listing, listing_diff

BOX = "t4"
ROOT = "/opt/verl-lab"
KEYS = f"{ROOT}/train/tracking-keys.env"
RAY_ENV = f"{ROOT}/train/ray.env"
LIBEXEC = f"{ROOT}/libexec/driver"
MARKER = f"{ROOT}/markers/driver.done"
RAY = "verl-lab-ray.service"
MASK = f"/run/systemd/system.control/{RAY}"
# where these settings' parts live (the lab root's env, models, data and caches are no setting's here: hashing them
# took 9 s a listing), with the folders the driver stage writes in
LISTED = (*(f"{ROOT}/{d}" for d in ("train", "libexec", "markers", "tracking", "ray", "logs")),
          *(r for r in ROOTS if r != "/opt"), "/etc/modprobe.d", "/etc/apt/preferences.d")
PIN = ("# verl-lab driver stage: NVIDIA driver branch 535 (nvidia-graphics-drivers 535.261.03-1),\n"
       "Package: libcuda1 nvidia-driver nvidia-kernel-dkms nvidia-smi\nPin: version 535.261.03-1\nPin-Priority: 1001\n")
STATE: dict = {}


def listing(box) -> dict:
    return box_listing(box, roots=LISTED)


def full(fleet, tracking=None):
    per_host = {BOX: {**fleet.per_host[BOX], **({"tracking": tracking} if tracking else {})}}
    return fleet.deploy(hosts=[BOX], per_host=per_host, mode="text", timeout=900)


@pytest.fixture(scope="module")
def turned_off(fleet_lab, tmp_path_factory):
    box = fleet_lab.box(BOX)
    box.ssh("mkdir -p /etc/modprobe.d")          # as kmod ships it on every Debian box (the lab's rootfs has no kmod)
    STATE["before"] = listing(box)
    keys = tmp_path_factory.mktemp("keys") / "trackers.env"
    keys.write_text("WANDB_API_KEY=" + "0123456789abcdef" * 2 + "01234567\n")
    keys.chmod(0o600)
    on = full(fleet_lab, {"trackers": ["tensorboard", "wandb"], "keys_file": str(keys), "mode": "online",
                          "internet": True})
    assert on.ok, on.tail(60)
    STATE["on"] = (box.stat(KEYS), box.read_text("/etc/systemd/system/verl-lab-train.service"))
    box.write_text(TRAIN_DROPIN, rendered(DROPIN_TEMPLATE, host=BOX, cluster="lab44", head_address="10.254.0.13",
                                          unit_name=RAY, env_file=RAY_ENV, ray_dir=f"{ROOT}/ray"))
    box.write_text(RAY_ENV, "RAY_ADDRESS=10.254.0.13:6379\n", mode="640")
    box.write_text(PIN_FILE, PIN)
    box.write_text(BLACKLIST_FILE, BLACKLIST)
    box.ssh(f"mkdir -p -m 700 {LIBEXEC} && echo '{{}}' > {LIBEXEC}/driver-plan.json && "
            f"printf 'stage=driver\\nbranch=535\\n' > {MARKER}")
    box.ssh(f"mkdir -p /run/systemd/system.control && ln -sfn /dev/null {MASK} && echo {RAY} > "
            "/run/verl-lab-driver-masked && systemctl daemon-reload")
    STATE["masked"] = box.ssh(f"systemctl is-enabled {RAY}", check=False).stdout.strip()
    return full(fleet_lab)


def test_on_the_keys_are_written_and_named_by_the_unit(turned_off):
    (mode, user, group), unit = STATE["on"]
    assert (mode, user, group) == ("400", "verl", "verl")
    assert f"EnvironmentFile={KEYS}" in unit
    assert STATE["masked"] == "masked-runtime"


def test_off_full_py_says_what_it_undid(turned_off):
    out = turned_off.output
    assert turned_off.ok, turned_off.tail(60)
    why = "this box is in no Ray cluster now: no `cluster` setting names it"
    for line in (f"Unit verl-lab-train.service: the cluster's drop-in {TRAIN_DROPIN} removed ({why})",
                 f"The cluster's files removed: ray.env ({why})",
                 f"Tracker keys {KEYS} removed (",
                 "Tracker folders removed while empty: wandb",
                 f"NVIDIA driver: unmask {RAY} (masked by a driver change that did not end, and none runs;",
                 f"NVIDIA driver: hold and pin released (driver = 'check': the driver stage no longer manages the "
                 f"driver): {PIN_FILE} removed, {LIBEXEC} removed, {MARKER} removed",
                 f"NVIDIA driver: {BLACKLIST_FILE} removed (driver = 'check': the driver stage no longer manages the "
                 "driver, and no NVIDIA driver package is installed"):
        assert line in out, f"{line!r} not printed:\n{turned_off.tail(80)}"
    # the undo stage's 7, right after the base stage (the driver's part comes first); the env's build script and the
    # training files follow the trackers back (their own stages' words)
    assert re.search(rf"^verl-lab: {BOX} \(1 x Tesla T4, from nvidia-smi\): base proven, undo changed 7, cuda proven, ",
                     out, re.M), turned_off.tail(20)


def test_off_leaves_the_box_as_it_was(fleet_lab, turned_off):
    box = fleet_lab.box(BOX)
    diff = listing_diff(STATE["before"], listing(box))
    assert diff == [], json.dumps(diff, indent=1)
    assert box.ssh(f"systemctl is-enabled {RAY}", check=False).stdout.strip() != "masked-runtime"
    assert not box.exists("/run/verl-lab-driver-masked")


def test_off_again_changes_nothing(fleet_lab, turned_off):
    again = full(fleet_lab)
    assert again.ok and again.changed_by_host.get(BOX, 0) == 0, again.tail(40)
    assert "undo" not in next(ln for ln in again.output.splitlines() if ln.startswith(f"verl-lab: {BOX} "))
