"""A box is what its settings say, both ways (issue 44): a Ray cluster and the tracking hub with an online
tracker's keys set, then removed, leave two lab boxes as they were before (tasks/undo.py), and every command
says what it did or why not.

Two boxes, real pyinfra over SSH, real systemd: ``b1`` (a P40, the inventory's first box: the lab's TensorBoard
hub by default) and ``b2`` (a T4). The env at the env's prefix is a plain venv this module installs with the
real Ray 2.46.0 and TensorBoard 2.20.0 from the cached PyPI wheels (tests/fixtures/standins/env.py's wheelhouse),
as tests/e2e/test_cluster.py and test_tracking.py do, not the env stage (a full env takes too long here): the
units run them as they would in a real env. The boxes' Ray nodes are on 127.0.0.13 (b2) and .14 (b1).

1. deploy/tracking.py on the boxes nobody provisioned: refused in its first pass (the hub has no train user),
   and nothing on either box changed (the listing before and after, tests/lab/listing.py).
2. Before: deploy/train.py, deploy/cluster.py, deploy/tracking.py with no cluster and the default tracking (its
   port moved off 6006: the boxes share this machine's ports): b1 serves the lab's TensorBoard. The listing of
   each box is taken. deploy/export.py with no checkpoint says so; status says how to open the TensorBoard with
   no tunnel (the boxes share this machine's loopback).
3. On: ``cluster = {"name": "lab44", "head": "b2"}``, tracking with b2 the hub and wandb online on b2 (its keys in
   the training unit's and the Ray head's EnvironmentFile): both Ray units run, b2 serves, b1's TensorBoard is
   stopped and removed, said so.
4. b2's tracking offline: its keys file is removed, said so, and neither unit names it.
5. Off (the settings of 2., with /etc/hosts of b1 holding the cluster stage's managed line as a non-loopback node
   address would have made it, written by ``tasks.cluster.hosts_file`` itself): every part undone with its line,
   b1 serves again, and each box's listing equals its listing of 2.; a second round changes nothing.

Not here: deploy/full.py's wiring of the same undo (its stages need the env: tests/unit/test_undo.py checks what
it queues), the driver's hold and pin (tasks/driver/ is being rewritten), a LoRA run's outputs (kept by
decision: tasks/undo.py's docstring).
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.lab import BoxSpec
from tests.lab.box import free_port
from tests.lab.env_venv import install_env
from tests.lab.listing import box_listing, listing_diff

B1, B2 = "b1", "b2"
ADDRESS = {B2: "127.0.0.13", B1: "127.0.0.14"}
ROOT = "/opt/verl-lab"
RAY, TB = "verl-lab-ray.service", "verl-lab-tensorboard.service"
KEYS = f"{ROOT}/train/tracking-keys.env"
DROPIN = "/etc/systemd/system/verl-lab-train.service.d/cluster.conf"
SERVED = f"{ROOT}/tracking-lab"
# the served copy's files are named by the time the controller wrote them (the lab's summary events): its
# contents differ from one hub to the next by design; the folder itself is compared
SKIP = (f"{SERVED}/",)
STATE: dict = {}


@pytest.fixture(scope="module")
def lab(lab_factory, tmp_path_factory):
    lab = lab_factory([BoxSpec(B1, gpu="p40"), BoxSpec(B2, gpu="t4")])
    install_env([lab.box(B1), lab.box(B2)], "ray==2.46.0", "tensorboard==2.20.0")
    keys = tmp_path_factory.mktemp("keys") / "trackers.env"
    keys.write_text("WANDB_API_KEY=" + "0123456789abcdef" * 2 + "01234567\n")
    keys.chmod(0o600)
    STATE.update(port=free_port(), cluster_port=free_port(), keys=str(keys))
    return lab


def off() -> dict:
    """Before and after: no cluster, the default tracking (the inventory's first box, b1, is the hub)."""
    return {"data": {"tracking": {"port": STATE["port"]}}, "per_host": {}}


def on(mode: str = "online") -> dict:
    cluster = {"name": "lab44", "head": B2, "port": STATE["cluster_port"]}
    tracking = {"trackers": ["tensorboard"], "hub": B2, "port": STATE["port"]}
    online = {"trackers": ["tensorboard", "wandb"], "keys_file": STATE["keys"],
              **({"mode": "online", "internet": True} if mode == "online" else {"mode": "offline"})}
    return {"data": {"cluster": cluster},
            "per_host": {B1: {"cluster_address": ADDRESS[B1], "tracking": tracking},
                         B2: {"cluster_address": ADDRESS[B2], "tracking": {**tracking, **online}}}}


def deploy(lab, deploy_file: str, settings: dict, **kw):
    return lab.deploy(deploy_file, data=settings["data"], per_host=settings["per_host"], mode="text",
                      timeout=900, **kw)


def converge(lab, settings: dict, files=("deploy/train.py", "deploy/cluster.py", "deploy/tracking.py")) -> dict:
    runs = {}
    for name in files:
        res = deploy(lab, name, settings)
        assert res.ok, res.tail(80)
        runs[name] = res
    return runs


def listings(lab) -> dict:
    return {name: box_listing(lab.box(name), skip=SKIP) for name in (B1, B2)}


def unit(box, name: str, settle_s: float = 180) -> tuple[str, str]:
    """(is-enabled, is-active) once the unit has left a start or stop in progress (``activating``, ``deactivating``,
    ``reloading``: a unit the deploy just restarted, whose ``ray start`` a loaded machine slows; up to ``settle_s``);
    "" where systemctl prints nothing (no such unit file)."""
    deadline = time.monotonic() + settle_s
    while True:
        got = tuple(box.ssh(f"systemctl {what} {name}", check=False).stdout.strip()
                    for what in ("is-enabled", "is-active"))
        if got[1] not in ("activating", "deactivating", "reloading") or time.monotonic() > deadline:
            return got
        time.sleep(2)


def wait_serving(box, port: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while box.ssh(f"python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/data/logdir', "
                  "timeout=3)\"", check=False).returncode != 0:
        assert time.monotonic() < deadline, box.ssh(f"journalctl -u {TB} -n 30 --no-pager", check=False).stdout
        time.sleep(2)


# ------------------------------------------------------------------ 1. an unprovisioned hub


def test_tracking_on_an_unprovisioned_hub_is_refused_before_any_change(lab):
    before = listings(lab)
    res = deploy(lab, "deploy/tracking.py", off())
    assert res.rc != 0 and not res.ran_operations, res.tail()
    out = res.output
    assert "verl-lab tracking: the hub b1 is not provisioned (no user verl): nothing was changed on any box" in out, \
        res.tail()
    assert "deploy/full.py --limit b1 first" in out
    assert "chown: invalid user" not in out and "Traceback" not in out, res.tail()
    after = listings(lab)
    assert {name: listing_diff(before[name], after[name]) for name in before} == {B1: [], B2: []}


# ------------------------------------------------------------------ 2. before


@pytest.fixture(scope="module")
def before(lab):
    runs = converge(lab, off())
    wait_serving(lab.box(B1), STATE["port"])
    STATE["before"] = listings(lab)
    return runs


def test_before_b1_serves_the_lab_tensorboard_and_no_ray_unit_exists(lab, before):
    assert unit(lab.box(B1), TB) == ("enabled", "active")
    for name in (B1, B2):
        assert not lab.box(name).exists(f"/etc/systemd/system/{RAY}")
    assert not lab.box(B2).exists(f"/etc/systemd/system/{TB}")


def test_export_with_no_checkpoint_says_so_without_v(lab, before):
    res = deploy(lab, "deploy/export.py", off())
    assert res.ok and res.changed == 0, res.tail()
    for name in (B1, B2):
        assert f"verl-lab export: {name}: nothing to export: no checkpoint yet in {ROOT}/train/checkpoints" \
               in res.output, res.tail()


def test_status_says_how_to_open_the_tensorboard_with_no_tunnel_in_the_lab(lab, before):
    res = deploy(lab, "deploy/status.py", off())
    assert res.ok, res.tail()
    port = STATE["port"]
    line = next(ln for ln in res.output.splitlines() if ln.startswith("The lab's TensorBoard"))
    assert line == (f"The lab's TensorBoard on b1: open http://127.0.0.1:{port}/ (no tunnel needed: this machine "
                    "shares b1's loopback, as the lab in a box does)"), line
    assert "ssh -N -L" not in res.output
    # the line it names is printed (no deploy/full.py of these boxes is recorded: each row says why)
    if "`why:`" in res.output:
        assert "    why: " in res.output


def test_summary_lines_of_the_train_deploy(before):
    out = before["deploy/train.py"].output
    for name, gpu in ((B1, "Tesla P40"), (B2, "Tesla T4")):
        assert re.search(rf"^verl-lab: {name} \(1 x {gpu}, from nvidia-smi\): base (proven|changed \d+), train ",
                         out, re.M), out[-3000:]


# ------------------------------------------------------------------ 3. on


@pytest.fixture(scope="module")
def turned_on(lab, before):
    runs = converge(lab, on())
    wait_serving(lab.box(B2), STATE["port"])
    return runs


def test_on_both_ray_units_run_and_b2_serves_with_its_keys(lab, turned_on):
    b1, b2 = lab.box(B1), lab.box(B2)
    assert unit(b1, RAY) == ("enabled", "active") and unit(b2, RAY) == ("enabled", "active")
    assert b1.exists(DROPIN) and b2.exists(DROPIN)
    assert b2.stat(KEYS) == ("400", "verl", "verl") and not b1.exists(KEYS)      # a worker gets no key
    assert f"EnvironmentFile=-{KEYS}" in b2.read_text(f"/etc/systemd/system/{RAY}")
    assert f"EnvironmentFile={KEYS}" in b2.read_text("/etc/systemd/system/verl-lab-train.service")
    assert unit(b2, TB) == ("enabled", "active")
    assert not b1.exists(f"/etc/systemd/system/{TB}") and not b1.exists(SERVED)


def test_on_b1_says_its_tensorboard_was_retired(turned_on):
    out = turned_on["deploy/tracking.py"].output
    assert (f"Unit {TB}: stopped, disabled and removed (this box is not the lab's TensorBoard hub: the lab's "
            "TensorBoard hub is b2 now)") in out, out[-3000:]
    assert f"The lab's TensorBoard folder {SERVED} removed (not the hub: the lab's TensorBoard hub is b2 now;" in out


# ------------------------------------------------------------------ 4. offline


@pytest.fixture(scope="module")
def offline(lab, turned_on):
    return converge(lab, on("offline"), files=("deploy/train.py", "deploy/cluster.py"))


def test_offline_removes_the_keys_and_no_unit_names_them(lab, offline):
    b2 = lab.box(B2)
    assert not b2.exists(KEYS)
    assert KEYS not in b2.read_text(f"/etc/systemd/system/{RAY}")
    assert KEYS not in b2.read_text("/etc/systemd/system/verl-lab-train.service")
    out = offline["deploy/train.py"].output
    assert f"Tracker keys {KEYS} removed (tracking logs offline now" in out, out[-3000:]
    assert unit(b2, RAY) == ("enabled", "active")


# ------------------------------------------------------------------ 5. off


@pytest.fixture(scope="module")
def turned_off(lab, offline):
    from tasks.cluster import hosts_file
    b1 = lab.box(B1)
    lookup = {"hostname": b1.ssh("hostname").stdout.strip(), "hosts": b1.read_text("/etc/hosts"),
              "resolves": b1.ssh("getent ahostsv4 \"$(hostname)\" | awk '{ print $1 }' | uniq").stdout.split()}
    managed, _ = hosts_file(lookup, "10.254.0.14")      # what the cluster stage writes for a non-loopback node
    b1.ssh("cat > /etc/hosts", input=managed)
    STATE["planted_hosts"] = managed
    # b2's train user plants links in Ray's folder (its own) to a root-only file and to /root: root's `rm -rf` of
    # the folder removes the links, never what they point at (docs/architecture.md, "Security", rule c)
    b2 = lab.box(B2)
    b2.ssh("umask 077; echo keep > /root/verl44-target")
    b2.ssh(f"ln -s /root/verl44-target {ROOT}/ray/file-link && ln -s /root {ROOT}/ray/dir-link && "
           f"mkdir -p {ROOT}/ray/tmp/deep && ln -s /root {ROOT}/ray/tmp/deep/up", user="verl")
    runs = converge(lab, off())
    wait_serving(lab.box(B1), STATE["port"])
    assert b2.read_text("/root/verl44-target") == "keep\n" and b2.exists("/root/.ssh/authorized_keys")
    b2.ssh("rm -f /root/verl44-target")
    return runs


def test_off_says_what_it_undid(turned_off):
    train, cluster, tracking = (turned_off[f"deploy/{n}.py"].output for n in ("train", "cluster", "tracking"))
    why = "this box is in no Ray cluster now: no `cluster` setting names it"
    assert f"Unit verl-lab-train.service: the cluster's drop-in {DROPIN} removed ({why})" in train, train[-3000:]
    assert "Tracker folders removed while empty: wandb (tracking.trackers is ['tensorboard'])" in train
    assert f"Unit {RAY}: stopped, disabled and removed ({why})" in cluster, cluster[-3000:]
    assert "The cluster's files removed: ray.env, cluster-check, cluster-gather" in cluster
    assert f"Ray's folder {ROOT}/ray removed" in cluster
    assert "/etc/hosts: the cluster's line ('# verl-lab cluster') removed" in cluster
    assert (f"Unit {TB}: stopped, disabled and removed (this box is not the lab's TensorBoard hub: the lab's "
            "TensorBoard hub is b1 now)") in tracking, tracking[-3000:]
    assert re.search(r"^verl-lab: b2 \(1 x Tesla T4, from nvidia-smi\): base proven, undo changed \d+, train ",
                     train, re.M), train[-3000:]


def test_off_leaves_each_box_as_it_was_before(lab, turned_off):
    after = listings(lab)
    diff = {name: listing_diff(STATE["before"][name], after[name]) for name in (B1, B2)}
    assert diff == {B1: [], B2: []}, json.dumps(diff, indent=1)
    assert "verl-lab cluster" not in lab.box(B1).read_text("/etc/hosts")
    assert unit(lab.box(B1), TB) == ("enabled", "active")
    for name in (B1, B2):
        assert unit(lab.box(name), RAY) == ("", "inactive")
        assert lab.box(name).ssh("pgrep -u verl -f raylet || true").stdout.strip() == ""


def test_off_again_changes_nothing(lab, turned_off):
    for name in ("deploy/train.py", "deploy/cluster.py"):
        res = deploy(lab, name, off())
        assert res.ok and res.changed == 0, f"{name}: {res.tail()}"
        assert "removed" not in " ".join(line for line in res.output.splitlines() if "Starting operation" in line)


# ------------------------------------------------------------------ the words of issue 44's item 5


def test_a_keys_file_set_but_missing_or_readable_by_others_gets_the_true_message(lab, tmp_path):
    loose = tmp_path / "loose.env"
    loose.write_text("WANDB_API_KEY=" + "f" * 40 + "\n")
    loose.chmod(0o644)
    for path, says in ((tmp_path / "nope.env", "does not exist on the controller"),
                       (loose, "can be read by others (mode 644)")):
        settings = {"data": {"tracking": {"port": STATE["port"], "trackers": ["wandb"], "keys_file": str(path)}},
                    "per_host": {}}
        res = deploy(lab, "deploy/train.py", settings)
        assert res.rc != 0 and not res.ran_operations, res.tail()
        assert says in res.output, res.tail()
        assert "no keys_file is set" not in res.output and "has none" not in res.output, res.tail()


def test_status_points_only_at_a_serving_hub(lab, turned_off):
    b1 = lab.box(B1)
    b1.ssh(f"systemctl stop {TB}")
    try:
        res = deploy(lab, "deploy/status.py", off())
    finally:
        b1.ssh(f"systemctl start {TB}")
    assert res.ok, res.tail()
    line = next(ln for ln in res.output.splitlines() if ln.startswith("The lab's TensorBoard"))
    assert line.startswith(f"The lab's TensorBoard: not serving on b1 ({TB} is not running there); ") and \
        "deploy/tracking.py" in line, line
    assert "ssh -N -L" not in res.output and "http://127.0.0.1" not in line


def test_status_words_are_true_of_what_it_printed(lab, turned_off):
    """Its last line refers to the `why:` lines only where it printed one; a refused deploy/full.py's record
    (as tasks/run_summary.py writes it for a box its checks refused) is said of that run, not of the box now:
    deploy/tracking.py has made folders on these boxes since."""
    from tasks.base import refused_hosts
    from tasks.run_summary import record_run
    from tasks.settings import SettingsError
    why = refused_hosts([SettingsError(B2, "workload", "bad", "fix")], [B1, B2], {}, False)[B2]
    record_run(str(lab.controller_cache), B2, ok=False, stage="checks", message=f"verl-lab checks: {why}", line="")
    res = deploy(lab, "deploy/status.py", off())
    assert res.ok, res.tail()
    assert "why: cuda, env, data not installed: the last deploy/full.py (" in res.output, res.tail()
    assert ") was refused by its checks and changed nothing on this box then: its 1 problem (workload)" \
        in res.output, res.tail()
    assert "nothing on this box was changed" not in res.output
    # every stage proven (the markers as the stages write them) and no run: no `why:` line, none referred to
    markers = {name: lab.box(name).ssh(f"ls {ROOT}/markers").stdout.split() for name in (B1, B2)}
    for name in (B1, B2):
        lab.box(name).ssh(f"cd {ROOT}/markers && for s in cuda env data; do [ -e $s.done ] || "
                          "printf 'stage=%s\\n' $s > $s.done; done")
    try:
        res = deploy(lab, "deploy/status.py", off())
    finally:
        for name in (B1, B2):
            lab.box(name).ssh(f"cd {ROOT}/markers && ls | grep -vxF -e {' -e '.join(markers[name])} | xargs -r rm -f")
    assert res.ok, res.tail()
    last = next(ln for ln in res.output.splitlines() if ln.startswith("status: no training run to report"))
    assert "    why: " not in res.output and "`why:`" not in last, res.tail()
    assert last.endswith("the preflight above says what stops a box"), last    # never ran: its verdict printed
