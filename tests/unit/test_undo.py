"""What the settings no longer ask for, undone (tasks/undo.py): the pure decisions, on the facts a box answers.
The e2e (tests/e2e/test_converge.py) runs them on real boxes; here each part's rule, and the mutation that
breaks it, on plain values."""

from __future__ import annotations

import pytest

from tasks import undo
from tasks.cluster import HOSTS_MARK, HOSTS_OFF, hosts_file, hosts_restored, write_hosts_command
from tasks.settings import load_settings

ROOT = "/opt/verl-lab"
DIR = {"kind": "dir", "mode": "755", "user": "root", "group": "root"}
FILE = {"kind": "file", "mode": "644", "user": "root", "group": "root", "sha1": "x"}
ALONE = load_settings("box1", {})
UNIT_OFF = {"enabled": False, "active": False, "crash_looping": False}


def cluster_states() -> dict:
    return {undo.RAY_UNIT_PATH: FILE, undo.TRAIN_DROPIN: FILE, f"{ROOT}/train/ray.env": FILE,
            f"{ROOT}/train/cluster-check": FILE, f"{ROOT}/train/cluster-gather": FILE, f"{ROOT}/ray": DIR}


def test_a_box_that_left_its_cluster_gets_every_part_undone_in_order():
    steps = undo.cluster_undo(ALONE, cluster_states(), {**UNIT_OFF, "enabled": True, "active": True}, "")
    names = [s.name for s in steps]
    assert names[0].startswith("Unit verl-lab-ray.service: stopped, disabled and removed (this box is in no Ray "
                               "cluster now")
    assert names[1].startswith(f"Unit verl-lab-train.service: the cluster's drop-in {undo.TRAIN_DROPIN} removed")
    assert names[2].startswith("The cluster's files removed: ray.env, cluster-check, cluster-gather")
    assert names[3].startswith(f"Ray's folder {ROOT}/ray removed")
    ray = " && ".join(steps[0].commands)
    assert "systemctl disable --now verl-lab-ray.service" in ray and "daemon-reload" in ray
    assert "reset-failed verl-lab-ray.service" in ray and "is-active --quiet verl-lab-ray.service" in ray
    assert steps[3].commands == (f"rm -rf {ROOT}/ray",)
    # deploy/train.py asks for the training unit's drop-in alone
    only = undo.cluster_undo(ALONE, cluster_states(), None, "", parts=("dropin",))
    assert [s.part for s in only] == ["dropin"]


def test_a_unit_file_gone_but_the_unit_still_enabled_or_crash_looping_is_undone():
    for state in ({**UNIT_OFF, "enabled": True}, {**UNIT_OFF, "crash_looping": True}):
        assert [s.part for s in undo.cluster_undo(ALONE, {}, state, "")] == ["ray"]
    assert undo.cluster_undo(ALONE, {}, UNIT_OFF, "") == []     # a box that never had one: nothing


def test_hosts_restored_is_hosts_file_undone():
    for original in ("127.0.0.1\tlocalhost\n127.0.1.1\tbox1.lab box1 other\n::1\tlocalhost ip6-localhost\n",
                     "127.0.0.1\tlocalhost\n127.0.1.1\tbox1\n",
                     "127.0.0.1 localhost\n# a comment\n10.0.0.9 box1 # pinned by hand\n"):
        managed, _ = hosts_file({"hostname": "box1", "resolves": ["127.0.1.1"], "hosts": original}, "10.0.0.5")
        assert HOSTS_MARK in managed and managed != original
        assert hosts_restored(managed) == original, managed
        # a second deploy of the cluster rewrote its own line: still restored
        again, _ = hosts_file({"hostname": "box1", "resolves": ["127.0.1.1"], "hosts": managed}, "10.0.0.6")
        assert hosts_restored(again) == original, again
    assert hosts_restored("127.0.0.1 localhost\n") is None
    step = undo.cluster_undo(ALONE, {}, UNIT_OFF, managed)
    assert len(step) == 1 and step[0].name.startswith("/etc/hosts: the cluster's line")
    assert step[0].commands == (write_hosts_command(original),) and HOSTS_OFF not in original


def keys_file(tmp_path):
    path = tmp_path / "k.env"
    path.write_text("WANDB_API_KEY=" + "a" * 40 + "\n")
    path.chmod(0o600)
    return str(path)


def test_the_keys_file_goes_with_the_reason(tmp_path):
    keys = f"{ROOT}/train/tracking-keys.env"
    cases = [({"tracking": {"trackers": ["tensorboard"]}}, False, "no tracker with a server"),
             ({"tracking": {"trackers": ["wandb"], "mode": "offline", "keys_file": keys_file(tmp_path)}}, False,
              "tracking logs offline now"),
             ({"artifact_mode": "direct", "tracking": {"trackers": ["tensorboard"]}}, True, "no tracker with a server")]
    for data, worker, why in cases:
        steps, kept = undo.tracker_undo(load_settings("box1", data), {keys: FILE}, {}, worker)
        said = undo.keys_why(load_settings("box1", data).tracking, worker)
        assert [s.name for s in steps] == [f"Tracker keys {keys} removed ({said})"]
        assert why in steps[0].name and steps[0].commands == (f"rm -f {keys}",) and kept == []
    assert undo.tracker_undo(ALONE, {}, {}, False) == ([], [])


def test_a_worker_loses_its_keys(tmp_path):
    s = load_settings("box1", {"artifact_mode": "direct", "tracking": {"trackers": ["wandb"], "mode": "online",
                                                                      "keys_file": keys_file(tmp_path)}})
    keys = f"{ROOT}/train/tracking-keys.env"
    assert undo.tracker_undo(s, {keys: FILE}, {}, worker=False) == ([], [])       # an online box alone keeps them
    steps, _ = undo.tracker_undo(s, {keys: FILE}, {}, worker=True)
    assert "a Ray cluster's worker gets no key" in steps[0].name


def test_tracker_folders_go_while_empty_and_a_runs_files_are_kept():
    root = f"{ROOT}/tracking"
    s = load_settings("box1", {"tracking": {"trackers": ["tensorboard"]}})
    entries = {root: ["tensorboard", "wandb"], f"{root}/tensorboard": ["run1"], f"{root}/wandb": []}
    steps, kept = undo.tracker_undo(s, {}, entries, False)
    assert [s_.name for s_ in steps] == ["Tracker folders removed while empty: wandb (tracking.trackers is "
                                         "['tensorboard'])"]
    assert steps[0].commands == (f"rmdir --ignore-fail-on-non-empty {root}/wandb",) and kept == []
    # no tracker at all: the wanted ones' folders too, and their parent once nothing is left in it
    none = load_settings("box1", {"tracking": {"trackers": []}})
    entries = {root: ["tensorboard", "wandb"], f"{root}/tensorboard": [], f"{root}/wandb": []}
    steps, kept = undo.tracker_undo(none, {}, entries, False)
    assert steps[0].commands[-1] == f"rmdir --ignore-fail-on-non-empty {root}" and kept == []
    # a folder that holds a run's event files is the user's: kept, and said (mutation: `if names:` dropped)
    entries = {root: ["tensorboard", "wandb"], f"{root}/tensorboard": ["box1-qwen-ppo"], f"{root}/wandb": []}
    steps, kept = undo.tracker_undo(none, {}, entries, False)
    assert [c for s_ in steps for c in s_.commands] == [f"rmdir --ignore-fail-on-non-empty {root}/wandb"]
    assert kept == [f"kept {root}/tensorboard: tracking.trackers no longer names tensorboard, and the folder holds "
                    "a run's files (1 entries: box1-qwen-ppo); remove it by hand when they are no longer needed"]


def test_the_hub_and_the_copy_go_where_the_settings_no_longer_ask_for_them():
    hosts = ["box1", "box2"]
    assert undo.hub_role(load_settings("box1", {}), hosts)[:2] == (True, True)
    is_hub, copied, why = undo.hub_role(load_settings("box1", {"tracking": {"hub": "box2"}}), hosts)
    assert (is_hub, copied, why) == (False, True, "the lab's TensorBoard hub is box2 now")
    is_hub, copied, why = undo.hub_role(load_settings("box1", {"tracking": {"trackers": []}}), hosts)
    assert (is_hub, copied) == (False, False) and why == "tracking.trackers has no 'tensorboard'"
    states = {undo.HUB_UNIT_PATH: FILE, f"{ROOT}/tracking-lab": DIR, f"{ROOT}/libexec/tracking": DIR,
              f"{ROOT}/cache/tracking": DIR}
    steps = undo.hub_undo(ALONE, states, {**UNIT_OFF, "active": True}, why)
    assert steps[0].name == ("Unit verl-lab-tensorboard.service: stopped, disabled and removed (this box is not the "
                             "lab's TensorBoard hub: tracking.trackers has no 'tensorboard')")
    assert steps[1].commands == (f"rm -rf {ROOT}/tracking-lab",) and "controller cache" in steps[1].name
    copy = undo.copy_undo(ALONE, states, {f"{ROOT}/libexec": ["tracking"]})
    assert copy[0].commands == (f"rm -rf {ROOT}/libexec/tracking {ROOT}/cache/tracking",
                                f"rmdir --ignore-fail-on-non-empty {ROOT}/libexec")
    # another stage's programs beside it: libexec stays
    copy = undo.copy_undo(ALONE, states, {f"{ROOT}/libexec": ["data", "tracking"]})
    assert copy[0].commands == (f"rm -rf {ROOT}/libexec/tracking {ROOT}/cache/tracking",)
    assert undo.hub_undo(ALONE, {}, UNIT_OFF, why) == [] and undo.copy_undo(ALONE, {}, {}) == []


@pytest.mark.parametrize("in_cluster, parts, want", [
    (False, ("dropin", "ray"), ["ray", "dropin", "ray", "ray"]),
    (True, ("dropin", "ray"), []),                     # a member keeps its cluster's parts
    (False, ("trackers", "hub", "copy"), ["trackers", "hub", "hub"]),   # tensorboard is copied: the copy stays
])
def test_planned_undo_asks_one_bundle_and_keeps_to_its_parts(monkeypatch, in_cluster, parts, want):
    """What deploy/full.py queues before its train stage (the cluster's parts) and after it (the trackers'),
    from the one fact bundle a host asks (mutation: a part outside ``parts`` undone)."""
    s = load_settings("box2", {"tracking": {"trackers": ["tensorboard"]}})
    states = {**cluster_states(), f"{ROOT}/train/tracking-keys.env": FILE, undo.HUB_UNIT_PATH: FILE,
              f"{ROOT}/tracking-lab": DIR, f"{ROOT}/libexec/tracking": DIR}
    entries = {f"{ROOT}/tracking": ["tensorboard"], f"{ROOT}/tracking/tensorboard": []}
    found = (states, {**UNIT_OFF, "active": True}, {**UNIT_OFF, "active": True}, entries, {"hosts": ""})
    monkeypatch.setattr(undo, "_found", lambda settings: found)
    steps, kept = undo.planned_undo(s, parts, in_cluster, False, ["box1", "box2"])
    assert [st.part for st in steps] == want
    if "hub" in parts:        # box1 is the hub (the inventory's first box): box2's goes
        assert [st.name.split(" (")[0] for st in steps if st.part == "hub"][0].startswith("Unit verl-lab-tensorboard")
