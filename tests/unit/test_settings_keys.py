"""Every key of a host's data is read or refused (tasks/settings/keys.py): a top-level key that names a nested
setting gets its dotted name, a dotted key sets the nested value, a key nothing reads is refused unless it is
pyinfra's, another deploy's or the site's own (site_*); --limit/--exclude patterns that match nothing stop the run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tasks.settings import DEPLOY_KEYS, SITE_PREFIX, SettingsError, load_settings

REPO = Path(__file__).resolve().parents[2]
QWEN_1_5B = "Qwen/Qwen2.5-1.5B-Instruct"


def problems(data: dict) -> dict[str, str]:
    with pytest.raises(SettingsError) as err:
        load_settings("b", data)
    return {p.key: str(p) for p in err.value.problems}


@pytest.mark.parametrize("key, meant", [
    ("model", "workload.model"), ("rollout", "workload.rollout"), ("finetune", "workload.finetune"),
    ("epochs", "workload.epochs"), ("lora_rank", "workload.lora_rank"), ("keep", "checkpoints.keep"),
    ("hub", "tracking.hub"), ("trackers", "tracking.trackers"), ("head", "cluster.head"),
    ("memory_mib", "gpu_override.memory_mib"), ("modell", "workload.model"),
])
def test_a_top_level_key_of_a_nested_setting_gets_its_dotted_name(key, meant):
    found = problems({key: "x"})
    assert list(found) == [key], found
    assert f"did you mean {meant}" in found[key], found
    assert f"--data {meant}=x" in found[key], found


def test_a_key_two_settings_have_names_both():
    text = problems({"port": 6380})["port"]
    assert "did you mean cluster.port or tracking.port?" in text, text
    text = problems({"modle": "x"})["modle"]
    assert "did you mean tracking.mode or workload.model?" in text, text


def test_a_dotted_key_sets_the_nested_value():
    s = load_settings("b", {"workload.model": QWEN_1_5B, "workload.epochs": 2, "checkpoints.keep": 2,
                            "tracking.project": "exp1"})
    assert s.workload["model"] == QWEN_1_5B and s.model_artifact == "qwen_1_5b_model" and s.workload["epochs"] == 2
    assert s.checkpoints == {"keep": 2, "every": 10} and s.tracking.project == "exp1"


def test_a_dotted_key_wins_over_the_mapping_wherever_each_is_set():
    s = load_settings("b", {"workload": {"model": "Qwen/Qwen2.5-3B-Instruct", "epochs": 3}, "workload.model": QWEN_1_5B})
    assert s.workload["model"] == QWEN_1_5B and s.workload["epochs"] == 3


def test_a_dotted_key_goes_deeper():
    s = load_settings("b", {"catalog_overrides.qwen_model.revision": "a" * 40})
    assert s.catalog.artifact("qwen_model").revision == "a" * 40


@pytest.mark.parametrize("data, key, says", [
    ({"workload.modle": QWEN_1_5B}, "workload.modle", "did you mean workload.model?"),
    ({"workloads.model": QWEN_1_5B}, "workloads.model", "did you mean workload.model?"),
    ({"lab_root.x": 1}, "lab_root.x", "'lab_root' is not a nested setting"),
    ({"workload": "big", "workload.model": QWEN_1_5B}, "workload.model", "workload is 'big', not a mapping"),
    ({"workload.": 1}, "workload.", "a dotted key with an empty part"),
])
def test_a_dotted_key_no_setting_has_is_refused(data, key, says):
    found = problems(data)
    assert key in found and says in found[key], found


def test_a_key_nothing_reads_is_refused_with_the_site_prefix_as_the_way_out():
    text = problems({"workload_size": "big"})["workload_size"]
    assert text.startswith("host b: workload_size: not a verl-lab setting, nor pyinfra's"), text
    assert f"name your site's own keys {SITE_PREFIX}*" in text, text
    assert load_settings("b", {f"{SITE_PREFIX}workload_size": "big", f"{SITE_PREFIX}rack.row": 3}).host == "b"


def test_every_key_a_deploy_reads_is_known():
    """A deploy file's own host data (``host.data.get("...")``) passes the check: DEPLOY_KEYS lists each."""
    read = {m for path in (REPO / "deploy").glob("*.py")
            for m in re.findall(r"host\.data\.get\(\s*[\"'](\w+)[\"']", path.read_text())}
    assert read and read == set(DEPLOY_KEYS), read ^ set(DEPLOY_KEYS)


def test_a_host_with_a_key_nothing_reads_is_still_planned():
    """The refused key is left out and the rest checked in the same run (one report of every problem)."""
    from tasks.hostdata import checked_settings
    settings, found = checked_settings("b", {"workload_size": "big", "model": QWEN_1_5B, "workload.epochs": 2,
                                             "train_steps": 5})
    assert settings is not None and settings.train_steps == 5 and settings.workload["epochs"] == 2
    assert settings.workload["model"] is None            # the top-level `model` is refused, not applied
    assert sorted(p.key for p in found) == ["model", "workload_size"]


def test_the_refusal_says_where_the_key_was_set():
    from pyinfra.api import Inventory

    from tasks.hostdata import with_origin

    inv = Inventory(([("t4", {"workload_size": "big"}), "p40"], {"modle": "x"}), gpus=(["p40"], {"rollout": "hf"}),
                    override_data={"model": QWEN_1_5B})
    t4, p40 = inv.get_host("t4"), inv.get_host("p40")
    t4_found = {p.key: p.problem for p in with_origin(_errors(t4), inv, t4)}
    assert t4_found["model"].endswith("; set by --data"), t4_found
    assert t4_found["workload_size"].endswith("; set by the host's own data in the inventory"), t4_found
    assert t4_found["modle"].endswith("; set by all's data (group_data/all.py)"), t4_found
    p40_found = {p.key: p.problem for p in with_origin(_errors(p40), inv, p40)}
    assert p40_found["rollout"].endswith("; set by group gpus's data (group_data/gpus.py or the inventory)"), p40_found


def _errors(host) -> list[SettingsError]:
    with pytest.raises(SettingsError) as err:
        load_settings(host.name, host.data.dict())
    return err.value.problems


@pytest.mark.parametrize("limit, exclude, says", [
    (("nosuch",), (), "--limit 'nosuch' matches no host or group"),
    (("p40", "t5"), (), "--limit 't5' matches no host or group of the inventory; nothing was changed on any host. "
                        "Did you mean 't4'?"),
    ((), ("p4O",), "--exclude 'p4O' matches no host or group"),
    (("p*",), (), None), (("gpus",), (), None), ((), ("t4",), None),
])
def test_a_limit_that_matches_no_host_stops_the_run(limit, exclude, says):
    from pyinfra.api import Inventory

    from tasks.hostdata import unmatched_limits

    inv = Inventory((["t4", "p40"], {}), gpus=(["p40"], {}))
    got = unmatched_limits(inv, limit, exclude, None)
    assert (got is None) if says is None else (says in got), got


def test_a_run_left_with_no_host_stops():
    from pyinfra.api import Inventory

    from tasks.hostdata import unmatched_limits

    inv = Inventory((["t4"], {}))
    assert "leave no host in this run" in unmatched_limits(inv, (), ("t4",), [])
