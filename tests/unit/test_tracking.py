"""The ``tracking`` setting (tasks/tracking/setting.py) and what the training stage makes of it
(tasks/tracking/train.py, tasks/train.py): verl 0.5.0's ``trainer.logger``, the trackers' folders under
lab_root, their environment in train.env, an online run's keys in a file of their own. Pure: plain values
and the rendered templates."""

from __future__ import annotations

import re

import pytest

from tasks import train
from tasks.settings import SettingsError, load_settings
from tasks.tracking import KEYS_FILE, VERL_BACKENDS, box_gets_keys, check_tracking, keys_for_box, read_keys
from tests.unit import test_train_launcher as launcher_test

KEY = "0123456789abcdef0123456789abcdef01234567"     # a made-up wandb key (40 hex)


def keys_file(tmp_path, text=f"WANDB_API_KEY={KEY}\nSWANLAB_API_KEY=sw-{KEY[:20]}\n", mode=0o600):
    path = tmp_path / "trackers.env"
    path.write_text(text)
    path.chmod(mode)
    return path


def problems(data, host="box1"):
    with pytest.raises(SettingsError) as err:
        load_settings(host, data)
    return err.value.problems


def test_default_is_console_and_tensorboard_under_lab_root():
    s = launcher_test.settings_for(lab_root="/srv/lab")
    layout = launcher_test.layout_for(s)
    ov = {o.key: o.value for o in layout.plan.overrides}
    assert ov["trainer.logger"] == ["console", "tensorboard"]
    assert ov["trainer.project_name"] == "verl-lab"
    assert ov["trainer.experiment_name"] == "box1-qwen2.5-0.5b-gsm8k-ppo"     # the box, the model, the algorithm
    assert "trainer.logger=['console','tensorboard']" in layout.plan.override_lines
    env = train.rendered(train.ENV_TEMPLATE, **layout.values())
    assert "TENSORBOARD_DIR=/srv/lab/tracking/tensorboard/box1-qwen2.5-0.5b-gsm8k-ppo\n" in env
    assert "WANDB" not in env and "tracking-keys" not in train.rendered(train.UNIT_TEMPLATE, **layout.values())
    # the unit may write there (ProtectSystem=strict), and the stage makes the folders: each tracker's the train
    # user's, in a parent of root's, so that root's mkdir/chmod/chown of them follow no name the train user can swap
    assert "/srv/lab/tracking" in layout.values()["read_write_paths"]
    wanted = {w.path: w for w in train.training_wanted(layout)}
    parent, tensorboard = wanted["/srv/lab/tracking"], wanted["/srv/lab/tracking/tensorboard"]
    assert parent.is_dir and (parent.user, parent.group, parent.mode) == ("root", "verl", "750")
    assert tensorboard.is_dir and (tensorboard.user, tensorboard.mode) == ("verl", "750")


def test_a_grpo_rung_names_its_run_so():
    s = launcher_test.settings_for(workload={"algorithm": "grpo"}, tracking={"run_name": "try3", "project": "p1"})
    ov = {o.key: o.value for o in launcher_test.layout_for(s).plan.overrides}
    assert ov["trainer.experiment_name"] == "try3-grpo" and ov["trainer.project_name"] == "p1"


def test_only_console_when_asked_for_no_tracker():
    s = launcher_test.settings_for(tracking={"trackers": []})
    layout = launcher_test.layout_for(s)
    assert {o.key: o.value for o in layout.plan.overrides}["trainer.logger"] == ["console"]
    assert not any("/tracking" in p for p in train.training_paths(s))
    assert "TENSORBOARD_DIR" not in train.rendered(train.ENV_TEMPLATE, **layout.values())


def test_unknown_and_unsupported_trackers_are_refused_with_the_fix():
    found = problems({"tracking": {"trackers": ["tensorbord", "clearml"], "mdoe": "x"}})
    text = "\n".join(map(str, found))
    assert "host box1: tracking.trackers: 'tensorbord' is not a tracker verl 0.5.0 knows" in text
    assert "'clearml' is one of verl 0.5.0's backends that verl-lab does not set up" in text
    assert "tracking.mdoe: is not a tracking key" in text
    assert len(found) == 3
    assert set(VERL_BACKENDS) == {"wandb", "mlflow", "swanlab", "vemlp_wandb", "tensorboard", "console", "clearml"}


def test_missing_or_readable_keys_file_is_refused(tmp_path):
    found = problems({"tracking": {"trackers": ["wandb"], "keys_file": str(tmp_path / "nope")}})
    assert "tracking.keys_file: file" in str(found[0]) and "does not exist on the controller" in str(found[0])
    loose = keys_file(tmp_path, mode=0o644)
    found = problems({"tracking": {"trackers": ["wandb"], "keys_file": str(loose)}})
    assert "can be read by others (mode 644)" in str(found[0]) and f"chmod 600 {loose}" in str(found[0])
    # the message names the file, never what is in it
    assert all(KEY not in str(p) for p in found)
    # and only the true one: a file set but missing is not "no keys_file is set", one others can read is not
    # one that "has none" (it was not read) (issue 44; mutation: the per-tracker check without `not unread`)
    for path in (tmp_path / "nope", loose):
        found = problems({"tracking": {"trackers": ["wandb"], "keys_file": str(path)}})
        assert len(found) == 1 and "no keys_file is set" not in str(found[0]) and "has none" not in str(found[0]), found


def test_wandb_without_a_key_is_refused_even_offline(tmp_path):
    found = problems({"tracking": {"trackers": ["wandb"]}})
    assert "wandb needs WANDB_API_KEY for the controller's sync, and no keys_file is set" in str(found[0])
    other = keys_file(tmp_path, text="SWANLAB_API_KEY=abc\n")
    found = problems({"tracking": {"trackers": ["wandb"], "keys_file": str(other)}})
    assert "has none" in str(found[0])


def test_an_unknown_key_name_is_refused(tmp_path):
    path = keys_file(tmp_path, text="WANDB_API_KEY=abc\nWANDB_APIKEY=abc\n")
    found = problems({"tracking": {"trackers": ["wandb"], "keys_file": str(path)}})
    assert "'WANDB_APIKEY' is not a key any tracker reads" in str(found[0])


def test_online_tracker_on_a_relay_box_is_refused(tmp_path):
    path = keys_file(tmp_path)
    found = problems({"artifact_mode": "relay", "tracking": {"trackers": ["wandb"], "keys_file": str(path),
                                                              "mode": "online"}})
    assert len(found) == 1
    assert ("tracking.mode: 'online' for wandb, but this box has no internet (artifact_mode = 'relay')"
            in str(found[0]))
    # ... unless the settings say the box reaches the server
    s = load_settings("box1", {"tracking": {"trackers": ["wandb"], "keys_file": str(path), "mode": "online",
                                            "internet": True}})
    assert s.tracking.online


def test_auto_mode_is_offline_on_relay_and_online_on_direct(tmp_path):
    path = str(keys_file(tmp_path))
    relay = load_settings("b", {"tracking": {"trackers": ["wandb", "swanlab"], "keys_file": path}}).tracking
    direct = load_settings("b", {"artifact_mode": "direct",
                                 "tracking": {"trackers": ["wandb", "swanlab"], "keys_file": path}}).tracking
    assert not relay.online and relay.offline == ("wandb", "swanlab") and direct.online
    env = relay.environment("/opt/verl-lab", "r1")
    assert env["WANDB_MODE"] == "offline" and env["SWANLAB_MODE"] == "offline"
    assert env["WANDB_DIR"] == "/opt/verl-lab/tracking/wandb" and env["SWANLAB_LOG_DIR"] == "/opt/verl-lab/tracking/swanlog"
    assert direct.environment("/opt/verl-lab", "r1")["WANDB_MODE"] == "online"
    assert direct.environment("/opt/verl-lab", "r1")["SWANLAB_MODE"] == "cloud"     # swanlab 0.6.8's word
    # an offline box gets no key at all: the controller keeps them for the sync
    assert not box_gets_keys(relay) and box_gets_keys(direct)
    assert keys_for_box(relay) == {} and keys_for_box(direct) == {"WANDB_API_KEY": KEY,
                                                                   "SWANLAB_API_KEY": f"sw-{KEY[:20]}"}


def test_mlflow_online_needs_its_server_and_offline_uses_a_file_store():
    found = problems({"artifact_mode": "direct", "tracking": {"trackers": ["mlflow"]}})
    assert "tracking.mlflow_uri: an online MLflow run needs its server" in str(found[0])
    t = check_tracking({"trackers": ["mlflow"]}, "relay")
    assert t.environment("/opt/verl-lab", "r")["MLFLOW_TRACKING_URI"] == "file:///opt/verl-lab/tracking/mlruns"


def test_online_keys_go_to_a_file_of_their_own_never_train_env_or_plan(tmp_path):
    path = keys_file(tmp_path)
    s = launcher_test.settings_for(artifact_mode="direct", tracking={"trackers": ["tensorboard", "wandb"],
                                                                     "keys_file": str(path)})
    layout = launcher_test.layout_for(s)
    layout = train.TrainingLayout(settings=s, plan=layout.plan, plan_source=layout.plan_source,
                                  tracker_keys=keys_for_box(s.tracking))
    wanted = {w.path: w for w in train.training_wanted(layout)}
    keys = wanted[f"{s.train_dir}/{KEYS_FILE}"]
    assert (keys.mode, keys.user, keys.group) == ("400", "verl", "verl")
    assert keys.content.decode() == f"WANDB_API_KEY={KEY}\n"      # the swanlab key: swanlab is not asked for
    assert keys.secret                    # placed by secret_file: pyinfra --diff prints none of it
    unit = train.rendered(train.UNIT_TEMPLATE, **layout.values())
    assert re.search(rf"^EnvironmentFile={re.escape(s.train_dir)}/{KEYS_FILE}$", unit, re.M)
    for name, w in wanted.items():
        if name != keys.path and w.content is not None:
            assert KEY.encode() not in w.content, name         # train.env, plan.json, the unit, the launcher
    assert KEY not in layout.plan_json() and KEY not in " ".join(layout.plan.override_lines)
    assert KEY not in str(layout.values()) and KEY not in layout.digest()
    # a changed key changes what the stage proves (the unit restarts with it)
    other = train.TrainingLayout(settings=s, plan=layout.plan, plan_source=layout.plan_source,
                                 tracker_keys={"WANDB_API_KEY": KEY[::-1]})
    assert other.digest() != layout.digest()
    assert train.training_paths(s) == [w.path for w in train.training_wanted(layout)]


def test_keys_file_format(tmp_path):
    path = keys_file(tmp_path, text="# wandb\nexport WANDB_API_KEY='abc'\n\nMLFLOW_TRACKING_TOKEN=t\n")
    assert read_keys(path) == {"WANDB_API_KEY": "abc", "MLFLOW_TRACKING_TOKEN": "t"}
    bad = keys_file(tmp_path, text=f"{KEY}\n")
    found = problems({"tracking": {"trackers": ["wandb"], "keys_file": str(bad)}})
    assert "line 1 is not NAME=value" in str(found[0]) and KEY not in str(found[0])


def test_hub_port_and_bind_are_checked():
    found = problems({"tracking": {"port": 80, "hub": 3}})
    text = "\n".join(map(str, found))
    assert "tracking.port: 80 is not a port in 1024-65535" in text and "tracking.hub: 3 is not a host name" in text
