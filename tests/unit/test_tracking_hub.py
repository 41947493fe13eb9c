"""The lab's TensorBoard (tasks/tracking/hub.py, tasks/tracking/events.py) and the offline trackers' sync
(tasks/tracking/sync.py): pure parts on plain values, and the event files read back by TensorBoard's own
loader (the copy's program: tests/unit/test_tracking_copy.py; TensorBoard's loaders:
tests/unit/test_tracking_tensorboard.py). ``test_verl_tracking_event_files_*`` makes event files with verl 0.5.0's own Tracking class on CPU
(the test env's Python: torch CPU, tensorboard as pinned for the boxes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.settings import load_settings
from tasks.tracking import MEASURED_TAG, PREDICTED_TAG, SCORE_TAG, TEXT_TAG, check_tracking, crc32c, hub
from tasks.tracking.sync import sync_env
from tests.fixtures.tracking import VERL_TAGS, recorded_run, steps_of, verl_event_files

SUMMARY = {"gsm8k": {"base": 0.312, "trained": 0.451, "step": 20, "final": True}, "predicted_peak_mib": 19382,
           "peak_mib": 18389, "step": 20}


def accumulator(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


def test_crc32c_is_the_castagnoli_polynomial():
    # RFC 3720's check value for CRC-32C of "123456789"
    assert crc32c(b"123456789") == 0xE3069283


def test_summary_event_file_is_read_by_tensorboard(tmp_path):
    path = hub.write_summary(tmp_path, "box1", SUMMARY, now=1_700_000_000)
    assert path.parent == tmp_path / "box1" / "verl-lab" and "tfevents" in path.name
    acc = accumulator(path.parent)
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars(SCORE_TAG)] == [(0, 0.312), (20, 0.451)]
    assert [e.value for e in acc.Scalars(PREDICTED_TAG)] == [19382] and acc.Scalars(MEASURED_TAG)[0].step == 20
    text = acc.Tensors(TEXT_TAG)[0].tensor_proto.string_val[0].decode()
    assert "0.312 (base model) -> 0.451" in text and "19382 MiB predicted" in text


def test_summary_is_rewritten_only_when_it_changes(tmp_path):
    first = hub.write_summary(tmp_path, "box1", SUMMARY, now=1)
    assert hub.write_summary(tmp_path, "box1", SUMMARY, now=2) == first       # same: kept
    later = {**SUMMARY, "gsm8k": {**SUMMARY["gsm8k"], "trained": 0.5, "step": 40}}
    second = hub.write_summary(tmp_path, "box1", later, now=3)
    assert second != first and not first.exists() and list(second.parent.iterdir()) == [second]
    assert hub.write_summary(tmp_path, "box2", {"gsm8k": {}, "predicted_peak_mib": None}) is None


def test_tunnel_command_and_status_line():
    assert hub.tunnel_command("box1", {"ssh_hostname": "10.0.0.5", "ssh_user": "ops", "ssh_port": 2222,
                                       "ssh_key": "/k/id"}, 6006, "127.0.0.1") == \
        "ssh -N -L 6006:127.0.0.1:6006 -p 2222 -i /k/id ops@10.0.0.5"
    assert hub.tunnel_command("gpu7", {}, 6100, "0.0.0.0") == "ssh -N -L 6100:127.0.0.1:6100 gpu7"

    class Host:
        def __init__(self, name, data):
            self.name, self.data = name, data

    class Inventory(list):
        def get_host(self, name):
            return next(h for h in self if h.name == name)

    inv = Inventory([Host("box1", {"ssh_hostname": "127.0.0.1", "ssh_port": 2201}), Host("box2", {})])
    words = hub.hub_words(load_settings("box2", {}), inv, serving=True)
    assert words == ("The lab's TensorBoard on box1 (filled by deploy/tracking.py): "
                     "ssh -N -L 6006:127.0.0.1:6006 -p 2201 127.0.0.1  then open http://localhost:6006/")
    # the tunnel only to a serving hub: none to one whose unit is not running, and none where it is not needed
    idle = hub.hub_words(load_settings("box2", {}), inv, serving=False)
    assert idle.startswith("The lab's TensorBoard: not serving on box1 (verl-lab-tensorboard.service is not running "
                           "there); ") and "deploy/tracking.py" in idle and "ssh" not in idle
    here = hub.hub_words(load_settings("box2", {}), inv, serving=True, here=True)
    assert here == ("The lab's TensorBoard on box1: open http://127.0.0.1:6006/ (no tunnel needed: this machine "
                    "shares box1's loopback, as the lab in a box does)")
    unasked = hub.hub_words(load_settings("box2", {}), inv)
    assert "if it serves: box1 was not asked in this run" in unasked and "ssh -N -L" in unasked
    assert hub.shares_loopback({"ssh_hostname": "127.0.0.1"}) and hub.shares_loopback({"ssh_hostname": "localhost"})
    assert not hub.shares_loopback({"ssh_hostname": "10.0.0.5"}) and not hub.shares_loopback({})
    assert "box2" in hub.hub_words(load_settings("box1", {"tracking": {"hub": "box2"}}), inv)
    assert "not a box of this inventory" in hub.hub_words(load_settings("b", {"tracking": {"hub": "gone"}}), inv)
    assert "off" in hub.hub_words(load_settings("b", {"tracking": {"trackers": []}}), inv)


def test_unit_serves_the_lab_folder_on_localhost_as_the_train_user():
    s = load_settings("box1", {"lab_root": "/srv/lab", "env_prefix": "/srv/lab/envs/verl"})
    unit = hub.rendered(hub.UNIT_TEMPLATE, **hub.hub_values(s))
    assert ("ExecStart=/srv/lab/envs/verl/bin/python -m tensorboard.main --logdir /srv/lab/tracking-lab "
            "--host 127.0.0.1 --port 6006 --load_fast=auto --reload_interval 30\n") in unit
    assert "\nUser=verl\n" in unit and "ProtectSystem=strict" in unit
    wide = load_settings("box1", {"tracking": {"bind": "0.0.0.0", "port": 7007}})
    assert "--host 0.0.0.0 --port 7007" in hub.rendered(hub.UNIT_TEMPLATE, **hub.hub_values(wide))


def test_sync_environment_carries_the_key():
    tracking = check_tracking({"trackers": [], "wandb_base_url": "http://127.0.0.1:8080"}, "relay")
    env = sync_env(tracking, "wandb", {"WANDB_API_KEY": "k" * 40, "SWANLAB_API_KEY": "s"},
                   base={"PATH": "/bin", "WANDB_MODE": "offline"})
    # offline mode dropped, the other tracker's key not given, the settings' server named
    assert env == {"PATH": "/bin", "WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": "http://127.0.0.1:8080"}


def test_served_folder_has_no_parent_the_train_user_writes():
    s = load_settings("box1", {"lab_root": "/srv/lab"})
    served = hub.served_dir(s)
    # the train user's folders: the training unit's ReadWritePaths and the trackers' folders under them
    theirs = [f"{s.lab_root}/tracking", *s.tracking.folders(s.lab_root).values(), s.train_dir + "/work"]
    assert all(not (served + "/").startswith(t + "/") for t in theirs), served
    assert served.rsplit("/", 1)[0] == s.lab_root            # the base stage's root-owned lab_root
    (folder,) = [w for w in hub.hub_wanted(s) if w.is_dir]
    assert (folder.path, folder.user, folder.group, folder.mode) == (served, "root", "verl", "750")


def test_verl_tracking_event_files_hold_verls_metric_names(verl_python, patched_verl_root, tmp_path):
    folder = verl_event_files(verl_python, patched_verl_root, tmp_path / "tensorboard" / "box1-run")
    files = list(folder.glob("events.out.tfevents.*"))
    assert files, "verl's Tracking wrote no event file under TENSORBOARD_DIR"
    acc = accumulator(folder)
    steps = steps_of()
    for tag in VERL_TAGS:
        assert [e.step for e in acc.Scalars(tag)] == [s["step"] for s in steps], tag
    assert acc.Scalars("critic/score/mean")[-1].value == pytest.approx(steps[-1]["metrics"]["critic/score/mean"])


@pytest.mark.skipif(recorded_run() is None, reason="no GPU run's event files committed yet (tests/fixtures/tracking/gpu-run)")
def test_recorded_gpu_run_holds_verls_metric_names():
    acc = accumulator(recorded_run())
    for tag in VERL_TAGS:
        assert acc.Scalars(tag), tag
    steps = [e.step for e in acc.Scalars("critic/score/mean")]
    assert steps == sorted(steps) and steps[0] >= 1
