"""Everything a user can get wrong is refused before any box changes (issue 26), on lab-in-a-box
hosts: real pyinfra over SSH to real systemd boxes, stand-in nvidia-smi (a T4, a P40, a Tesla K80
on driver 470 and a GTX 1080).

Each bad input is one run of ``deploy/full.py``, as a user would run it; the boxes' state (every
file under /opt, /usr/local, /etc/systemd/system and /var/tmp/verl-lab with its size, mode, owner
and time; users and groups; installed packages; the verl-lab units and the env generation) is the
same after it as before. deploy/full.py's checks (tasks/base.py check_run) report every problem of
every host of the run at once, the inventory's values and what each box told (its GPU, driver, disk,
the plan, verl's own checks), before any host changes: nothing runs on any host. One run with many
bad settings on two hosts lists every problem; one run with a typo, vLLM on a P40, a batch too large
and a K80 lists all of them; --limit reports only its hosts, and one that matches no host stops the run.
Every key of a host's data is read or refused (issue 44): a nested setting's key at the top (by --data, in
group_data), a key nothing reads, a dotted key no setting has are refused naming where each was set; a dotted
key that names a nested setting is applied (the plan placed trains that model). The 3B on a GTX 1080 (CPU
offload) is refused for host RAM with LoRA on a smaller model as the fix. A workload verl 0.5.0 runs
(train_batch_size 3, mini-batch 2) is deployed. ``train_unit_state = "stopped"`` stops a unit that
crash-loops and a re-run changes nothing; status and the doctor then say it failed, not "never ran".

docs/refusals.md's table is made from these runs: ``VERL_LAB_WRITE_DOCS=1`` rewrites it; otherwise
the test checks the doc says what the runs printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.fixtures.standins.hf_endpoint import catalog_overrides, standard_endpoint
from tests.lab import BoxSpec

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "refusals.md"
TABLE_START, TABLE_END = "<!-- table: made by tests/e2e/test_refusals.py -->", "<!-- end of table -->"
UNIT = "verl-lab-train.service"
K80_DRIVER = "470.256.02"          # branch R470: the last a Kepler GPU runs
T4_8GB = {"name": "Tesla T4", "compute_capability": "7.5", "memory_mib": 8192, "count": 1}
T4_4GB = {"name": "Tesla T4", "compute_capability": "7.5", "memory_mib": 4096, "count": 1}
K80 = {"name": "Tesla K80", "compute_capability": "3.7", "memory_mib": 11441, "count": 2}
B200 = {"name": "NVIDIA B200", "compute_capability": "10.0", "memory_mib": 183359, "count": 1}

STATE = ("find /opt /usr/local /etc/systemd/system /var/tmp/verl-lab -xdev -printf '%p|%y|%s|%m|%u|%g|%T@\\n' "
         "2>/dev/null | sort | sha256sum; sha256sum /etc/passwd /etc/group; dpkg-query -W | sha256sum; "
         "systemctl list-unit-files 'verl-lab*' --no-legend; systemctl list-units --all 'verl-lab*' --no-legend; "
         "grep -h generation /opt/verl-lab/markers/env.done 2>/dev/null || echo 'no env generation'")

# (row, what a user set, hosts, per-host data, where it is refused)
CASES = [
    ("a 3B model on an 8 GB GPU (gpu_override)", 'workload = {"model": "Qwen/Qwen2.5-3B-Instruct"}, '
     'gpu_override = 8 GB Tesla T4', ["t4"], {"t4": {"gpu_override": T4_8GB,
                                                  "workload": {"model": "Qwen/Qwen2.5-3B-Instruct"}}}, "inventory"),
    ("the 0.5B model on a 4 GB GPU (gpu_override)", "gpu_override = 4 GB Tesla T4", ["t4"],
     {"t4": {"gpu_override": T4_4GB}}, "inventory"),
    ("a Tesla K80 as gpu_override", "gpu_override = 2 x Tesla K80 (cc 3.7)", ["t4"], {"t4": {"gpu_override": K80}},
     "inventory"),
    ("a Blackwell GPU as gpu_override", "gpu_override = NVIDIA B200 (cc 10.0)", ["t4"],
     {"t4": {"gpu_override": B200}}, "inventory"),
    ("a box with a Tesla K80 (driver 470)", "nothing: the box's nvidia-smi says 2 x Tesla K80, driver 470.256.02",
     ["k80"], {}, "k80"),
    ("a batch larger than GSM8K's train split", 'workload = {"algorithm": "ppo", "train_batch_size": 10000}',
     ["t4"], {"t4": {"workload": {"algorithm": "ppo", "train_batch_size": 10000}}}, "t4"),
    ("sequences longer than Phi-3-mini-4k's context (vLLM on the T4)",
     'workload = {"model": "microsoft/Phi-3-mini-4k-instruct", "max_response_length": 4000}', ["t4"],
     {"t4": {"workload": {"model": "microsoft/Phi-3-mini-4k-instruct", "max_response_length": 4000}}}, "t4"),
    ("a misspelt setting", 'mirror_profle = "cn"', ["t4"], {"t4": {"mirror_profle": "cn"}}, "inventory"),
    ("many bad settings on two hosts in one run",
     't4: mirror_profle = "cn", train_unit_state = "stoped", workload = {"epochs": 0, "max_response_length": "256"}; '
     'p40: hf_token_file = "/nonexistent/token", gpu_override = 2 x Tesla K80', ["t4", "p40"],
     {"t4": {"mirror_profle": "cn", "train_unit_state": "stoped", "workload": {"epochs": 0, "max_response_length": "256"}},
      "p40": {"hf_token_file": "/nonexistent/token", "gpu_override": K80}}, "inventory"),
]
QWEN_1_5B = "Qwen/Qwen2.5-1.5B-Instruct"
# every key of verl-lab's namespace is read or refused (issue 44): (row, what a user set, extra pyinfra arguments,
# group_data/all.py beside the inventory, what the refusal says)
KEY_CASES = [
    ("a nested setting's key at the top (--data)", f"--data model={QWEN_1_5B}", ["--data", f"model={QWEN_1_5B}"],
     None, ["host t4: model: a key of workload, not a setting of its own", "; set by --data. Fix: did you mean "
            f"workload.model? --data workload.model={QWEN_1_5B}, or workload = {{'model': '{QWEN_1_5B}'}}"]),
    ("a nested setting's key at the top (group_data)", f'model = "{QWEN_1_5B}" in group_data/all.py', [],
     f'model = "{QWEN_1_5B}"\n', ["host t4: model: a key of workload", "; set by all's data (group_data/all.py). "
                                  "Fix: did you mean workload.model?"]),
    ("a key no deploy reads", "--data workload_size=big", ["--data", "workload_size=big"], None,
     ["host t4: workload_size: not a verl-lab setting, nor pyinfra's", "name your site's own keys site_*"]),
    ("a dotted key no setting has", f"--data workload.modle={QWEN_1_5B}", ["--data", f"workload.modle={QWEN_1_5B}"],
     None, ["host t4: workload.modle: not a workload key. Fix: did you mean workload.model?"]),
]
# the 3B on an 8 GB GTX 1080 (its own nvidia-smi): the plan is CPU offload; host RAM is this machine's
GTX_3B = ("the 3B on an 8 GB GTX 1080 (host RAM)", 'workload = {"model": "Qwen/Qwen2.5-3B-Instruct"}',
          ["gtx1080"], {"gtx1080": {"workload": {"model": "Qwen/Qwen2.5-3B-Instruct"}}}, "gtx1080")
# rows whose numbers are this machine's (its RAM, its free disk): the doc's table is compared without digits there
MACHINE_ROWS = {GTX_3B[0]}
ROWS: list[dict] = []


@pytest.fixture(scope="module")
def lab(lab_factory):
    """The three boxes, and the lab's HF endpoint stand-in (every catalog model, GSM8K): every deploy here
    points at it (``lab.hf_data``)."""
    lab = lab_factory([BoxSpec("t4", gpu="t4"), BoxSpec("p40", gpu="p40"),
                       BoxSpec("k80", gpu="k80", gpu_count=2, driver=K80_DRIVER), BoxSpec("gtx1080", gpu="gtx1080")])
    endpoint = standard_endpoint().start()
    lab.hf_data = {"mirror_urls": {**lab.mirror_urls, "huggingface": endpoint.url},
                   "catalog_overrides": catalog_overrides(endpoint)}
    yield lab
    endpoint.stop()


def state(lab, names) -> dict:
    return {name: lab.box(name).ssh(STATE).stdout for name in names}


def refusal_lines(output: str) -> list[str]:
    """What verl-lab printed about the refusal: the inventory check's lines, or a box's failure."""
    lines = [line.strip() for line in output.splitlines()]
    found = [line for line in lines if line.startswith("host ")
             or (line.startswith("verl-lab: ") and line.endswith("nothing was changed on any host:"))]
    found += [re.sub(r"^.*?(verl-lab (checks|base): )", r"\1", line) for line in lines
              if re.search(r"verl-lab (checks|base): host ", line)]
    return list(dict.fromkeys(found))


@pytest.mark.parametrize("case", CASES + [GTX_3B], ids=[c[0] for c in CASES + [GTX_3B]])
def test_each_bad_input_stops_before_any_box_changes(lab, case):
    refused(lab, *case)


def refused(lab, row, what, hosts, per_host, where, extra_args=()):
    """One run of deploy/full.py with a bad input: refused in the first report, no box changed."""
    before = state(lab, hosts)
    started = time.monotonic()
    res = lab.deploy("deploy/full.py", hosts=hosts, data=lab.hf_data, per_host=per_host, timeout=600,
                     extra_args=list(extra_args))
    took = time.monotonic() - started
    printed = refusal_lines(res.output)
    assert res.rc != 0 and printed, res.tail()
    assert state(lab, hosts) == before, f"{row}: a box changed\n{res.tail()}"
    # the run's checks (tasks/base.py check_run): the inventory's values and what each box told, one
    # report; nothing ran on any host
    assert printed[0].startswith("verl-lab: ") and "nothing was changed on any host" in printed[0], printed
    assert_each_line_once(res.output, printed)
    assert not res.ran_operations, res.tail()
    ROWS.append({"row": row, "input": what, "where": where, "rc": res.rc, "seconds": round(took, 1),
                 "printed": printed})
    return printed


@pytest.mark.parametrize("case", KEY_CASES, ids=[c[0] for c in KEY_CASES])
def test_every_key_is_read_or_refused(lab, case):
    """A nested setting's key at the top (by --data or in group_data), a key nothing reads, a dotted key no
    setting has: each refused in the first report, naming where it was set and the form that works."""
    row, what, extra_args, group_data, says = case
    folder = lab.dir / "group_data"          # beside the inventory lab.deploy writes: pyinfra reads it from there
    if group_data:
        folder.mkdir(exist_ok=True)
        (folder / "all.py").write_text(group_data)
    try:
        printed = refused(lab, row, what, ["t4"], {}, "inventory", extra_args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = "\n".join(printed)
    assert all(part in text for part in says), text


def test_a_limit_that_matches_no_host_stops_the_run(lab):
    hosts = ["t4", "p40"]
    before = state(lab, hosts)
    started = time.monotonic()
    res = lab.deploy("deploy/full.py", hosts=hosts, data=lab.hf_data, extra_args=["--limit", "nosuch"], timeout=600)
    took = time.monotonic() - started
    said = [line.strip() for line in res.output.splitlines() if line.startswith("verl-lab: --limit")]
    assert res.rc != 0 and not res.ran_operations, res.tail()
    assert len(said) == 1 and said[0].startswith("verl-lab: --limit 'nosuch' matches no host or group of the "
                                                 "inventory; nothing was changed on any host. Hosts: t4, p40;"), said
    assert state(lab, hosts) == before
    ROWS.append({"row": "a --limit that matches no host", "input": "--limit nosuch", "where": "limit", "rc": res.rc,
                 "seconds": round(took, 1), "printed": said})


def test_the_3b_on_the_gtx_1080_names_lora_as_the_fix():
    """The plan is CPU offload at ~1055 s a step; its offloaded states (57.5 GiB) and its export (30.9 GiB) need
    more host RAM than the box has: refused in the first report, LoRA (on the 0.5B: the 3B's LoRA rung does not fit
    8 GiB) as the fix."""
    text = "\n".join(next(r["printed"] for r in ROWS if r["row"] == GTX_3B[0]))
    assert "host gtx1080: run: training's host memory (model states offloaded to the CPU or asleep, " in text, text
    assert "MiB) needs 57.5 GiB, the box has" in text, text
    assert "the export after the run (verl's model merger, then the proof) needs 30.9 GiB" in text, text
    assert "Fix: LoRA on this model does not fit the GPU (short by " in text, text
    assert "a smaller model: workload.model = 'Qwen/Qwen2.5-0.5B-Instruct' (grpo-lora, LoRA rank 32, ~" in text, text


def test_the_messages_name_host_key_value_reason_and_fix():
    by = {r["row"]: r["printed"] for r in ROWS}
    text = {k: "\n".join(v) for k, v in by.items()}
    assert "host t4: workload: 1 x Tesla T4 (compute capability 7.5, 8192 MiB, from gpu_override): " \
           "qwen2.5-3b-gsm8k (GRPO) does not fit" in text["a 3B model on an 8 GB GPU (gpu_override)"]
    assert "Models of the catalog that fit" in text["a 3B model on an 8 GB GPU (gpu_override)"]
    assert "short by" in text["the 0.5B model on a 4 GB GPU (gpu_override)"]
    assert "host t4: gpu_override: 2 x Tesla K80" in text["a Tesla K80 as gpu_override"] and \
           "R470" in text["a Tesla K80 as gpu_override"]
    assert "sm_100" in text["a Blackwell GPU as gpu_override"]
    k80 = text["a box with a Tesla K80 (driver 470)"]
    assert "host k80: GPU (nvidia-smi): 2 x Tesla K80 (compute capability 3.7" in k80 and "R470" in k80
    assert "host k80: driver (nvidia-smi): NVIDIA driver 470.256.02 is too old for CUDA 11.8" in k80
    assert "Train dataloader is empty!" in text["a batch larger than GSM8K's train split"]
    assert "host t4: workload.train_batch_size:" in text["a batch larger than GSM8K's train split"]
    assert "model context length should be greater than total sequence length" in \
           text["sequences longer than Phi-3-mini-4k's context (vLLM on the T4)"]
    assert "did you mean mirror_profile?" in text["a misspelt setting"]
    many = by["many bad settings on two hosts in one run"]
    keys = [line.split(":")[1].strip() for line in many[1:]]
    assert sorted(keys) == sorted(["mirror_profle", "workload.max_response_length", "workload.epochs",
                                   "train_unit_state", "hf_token_file", "gpu_override"]), many
    # p40's bad hf_token_file does not hide its K80 override (the plan does not read the token file)
    assert all(". Fix: " in line for line in many[1:]), many


def assert_each_line_once(output: str, printed: list[str]) -> None:
    """The report once, each of its lines once (refusal_lines drops repeats: count in the raw output),
    and its header's count is the number of problem lines."""
    raw = [line.strip() for line in output.splitlines()]
    assert all(raw.count(line) == 1 for line in printed), [line for line in printed if raw.count(line) != 1]
    count = int(re.match(r"verl-lab: (\d+) problems? on", printed[0]).group(1))
    assert count == len(printed) - 1, printed


EVERY_HOST = {"t4": {"mirror_profle": "cn", "workload": {"train_batch_size": 10000}},
              "p40": {"workload": {"rollout": "vllm", "train_batch_size": 10000}},
              "k80": {}}


def test_one_report_of_every_host_inventory_and_boxes_at_once(lab):
    """An inventory typo (t4), vLLM asked on a P40 and a batch no GPU can take (t4, p40), a K80 on
    driver 470 (k80, known from its nvidia-smi only): every problem of every host in one run, the
    typo hiding nothing, each printed once, and no host changed."""
    hosts = ["t4", "p40", "k80"]
    before = state(lab, hosts)
    res = lab.deploy("deploy/full.py", hosts=hosts, data=lab.hf_data, per_host=EVERY_HOST, timeout=600)
    printed = refusal_lines(res.output)
    assert res.rc != 0 and not res.ran_operations, res.tail()
    assert state(lab, hosts) == before, res.tail()
    assert printed[0].startswith("verl-lab: 6 problems on 3 hosts of 3 in this run"), printed
    keys = [tuple(line.split(": ")[0:2]) for line in printed[1:]]
    assert keys == [("host t4", "mirror_profle"), ("host t4", "workload.train_batch_size"),
                    ("host p40", "workload.rollout"), ("host p40", "workload.train_batch_size"),
                    ("host k80", "driver (nvidia-smi)"), ("host k80", "GPU (nvidia-smi)")], printed
    text = "\n".join(printed)
    assert "did you mean mirror_profile?" in text
    assert "host p40: workload.rollout: 'vllm' (GPU from nvidia-smi)" in text
    assert text.count("Train dataloader is empty!") == 2, text
    assert "host k80: GPU (nvidia-smi): 2 x Tesla K80" in text and "NVIDIA driver 470.256.02 is too old" in text
    assert_each_line_once(res.output, printed)


def test_limit_reports_only_the_hosts_it_names(lab):
    hosts = ["t4", "p40", "k80"]
    before = state(lab, hosts)
    res = lab.deploy("deploy/full.py", hosts=hosts, data=lab.hf_data, per_host=EVERY_HOST,
                     extra_args=["--limit", "p40"], timeout=600)
    printed = refusal_lines(res.output)
    assert res.rc != 0 and not res.ran_operations, res.tail()
    assert printed[0].startswith("verl-lab: 2 problems on 1 host of 1 in this run"), printed
    assert {line.split(": ")[0] for line in printed[1:]} == {"host p40"}, printed
    assert state(lab, hosts) == before


def test_a_model_or_revision_the_endpoint_lacks_is_refused_before_any_change(lab):
    """The endpoint serves the 0.5B model only: the 1.5B is refused in the run's checks, from the
    controller in relay mode (t4: the Hub API's file list, with the token) and from the box in direct
    mode (p40: the box's own request), and so is a pinned revision the endpoint does not have; before
    any change (no CUDA, no env built first)."""
    hosts = ["t4", "p40"]
    before = state(lab, hosts)
    small = standard_endpoint(models=()).start()       # the 0.5B model and GSM8K only
    hf_data = {"mirror_urls": {**lab.mirror_urls, "huggingface": small.url}, "catalog_overrides": catalog_overrides(small)}
    wrong_rev = {**hf_data["catalog_overrides"]["qwen_model"], "revision": "0" * 40}
    try:
        _endpoint_refusals(lab, hosts, before, hf_data, wrong_rev)
    finally:
        small.stop()


def _endpoint_refusals(lab, hosts, before, hf_data, wrong_rev):
    res = lab.deploy("deploy/full.py", hosts=hosts, data=hf_data, per_host={
        "t4": {"workload": {"model": "Qwen/Qwen2.5-1.5B-Instruct"}},
        "p40": {"artifact_mode": "direct", "workload": {"model": "Qwen/Qwen2.5-1.5B-Instruct"}}}, timeout=600)
    printed = refusal_lines(res.output)
    assert res.rc != 0 and not res.ran_operations, res.tail()
    assert state(lab, hosts) == before
    text = "\n".join(printed)
    assert re.search(r"host t4: model \(qwen_1_5b_model, relay\): model repo 'Qwen/Qwen2.5-1.5B-Instruct' at "
                     r"revision 989aa79\w+ from HF endpoint http://127.0.0.1:\d+: the endpoint has no such repo", text), text
    assert re.search(r"host p40: model \(qwen_1_5b_model, direct\): .*the HF endpoint http://127.0.0.1:\d+ has no "
                     r"such repo \(HTTP 404, RepoNotFound\)", text), text
    res = lab.deploy("deploy/full.py", hosts=hosts, per_host={"t4": {}, "p40": {"artifact_mode": "direct"}},
                     data={**hf_data, "catalog_overrides": {**hf_data["catalog_overrides"], "qwen_model": wrong_rev}},
                     timeout=600)
    text = "\n".join(refusal_lines(res.output))
    assert res.rc != 0 and not res.ran_operations, res.tail()
    assert "host t4: model (qwen_model, relay):" in text and "the endpoint has no such revision" in text, text
    assert "host p40: model (qwen_model, direct):" in text and "has no such revision" in text, text
    assert state(lab, hosts) == before


def test_a_dotted_key_sets_the_nested_setting(lab):
    """--data workload.model=... is the workload's model: the plan placed trains it, and bin/lab plans says so."""
    res = lab.deploy("deploy/train.py", hosts=["t4"], extra_args=["--data", f"workload.model={QWEN_1_5B}"],
                     timeout=600)
    res.assert_ok()
    plan = json.loads(lab.box("t4").read_text("/opt/verl-lab/train/plan.json"))
    assert f"actor_rollout_ref.model.path=/opt/verl-lab/models/{QWEN_1_5B.replace('/', '--')}" in plan["overrides"]
    words = bin_lab().plan_summary("t4", plan).splitlines()[1]
    assert words == f"  model {QWEN_1_5B}, rung {plan['rung']}, " + (
        f"LoRA (rank {plan['lora']['rank']}, alpha {plan['lora']['alpha']}, all-linear)" if plan["lora"]
        else "full fine-tuning"), words
    ROWS.append({"row": "a dotted key (--data)", "input": f"--data workload.model={QWEN_1_5B}", "where": "accepted",
                 "rc": res.rc, "seconds": None,
                 "printed": [f"applied: the plan placed trains {QWEN_1_5B} ({plan['rung']}); bin/lab plans:{words}"]})


def bin_lab():
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("bin_lab", str(REPO / "bin" / "lab"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("bin_lab", loader))
    loader.exec_module(module)
    return module


def test_a_workload_verl_runs_is_deployed(lab):
    """train_batch_size 3, mini-batch 2: verl 0.5.0 accepts it (tests/unit/test_verl_rules.py) and its
    updates run it (tests/unit/test_verl_uneven_mini_batch.py): planned and placed as asked."""
    res = lab.deploy("deploy/train.py", hosts=["t4"],
                     per_host={"t4": {"workload": {"train_batch_size": 3, "ppo_mini_batch_size": 2}}}, timeout=600)
    res.assert_ok()
    plan = json.loads(lab.box("t4").read_text("/opt/verl-lab/train/plan.json"))
    assert (plan["workload"]["train_batch_size"], plan["workload"]["ppo_mini_batch_size"]) == (3, 2)
    ROWS.append({"row": "train_batch_size 3, ppo_mini_batch_size 2", "input": 'workload = {"train_batch_size": 3, '
                 '"ppo_mini_batch_size": 2}', "where": "accepted", "rc": res.rc, "seconds": None,
                 "printed": ["accepted and deployed: verl 0.5.0's checks pass and its updates run a step of 3 as "
                             "mini-batches of 2 and 1 (tests/unit/test_verl_uneven_mini_batch.py)"]})


def unit(lab, name="t4") -> dict:
    out = lab.box(name).ssh(f"systemctl show -p ActiveState -p SubState -p NRestarts -p UnitFileState {UNIT}").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_stopped_stops_a_crash_looping_unit_and_status_and_doctor_say_it_failed(lab, tmp_path):
    started = lab.deploy("deploy/train.py", hosts=["t4"], per_host={"t4": {"train_unit_state": "started"}},
                         timeout=900)
    # the box has no env and no data: the launcher's preflight stops the run, the stage fails that box
    assert started.failed_hosts == ["t4"], started.tail()
    for _ in range(60):
        if unit(lab)["ActiveState"] in ("activating", "failed") and unit(lab)["SubState"] in ("auto-restart", "failed"):
            break
        time.sleep(1)
    res = lab.deploy("deploy/train.py", hosts=["t4"], per_host={"t4": {"train_unit_state": "stopped"}}, timeout=900)
    res.assert_ok()
    assert any("stopped (train_unit_state=stopped" in name for _, name in res.changed_ops), res.changed_ops
    now = unit(lab)
    assert now["ActiveState"] in ("inactive", "failed") and now["UnitFileState"] == "disabled", now
    time.sleep(35)           # RestartSec=30: a unit still in its restart loop would have started again
    later = unit(lab)
    assert later["ActiveState"] == now["ActiveState"] and later["NRestarts"] == now["NRestarts"], (now, later)
    lab.deploy("deploy/train.py", hosts=["t4"], per_host={"t4": {"train_unit_state": "stopped"}},
               timeout=900).assert_idempotent()
    # the unit ran and failed: systemd has unloaded it (not enabled, inactive); the journal has not forgotten
    path = tmp_path / "status.json"
    status = lab.deploy("deploy/status.py", hosts=["t4"], data={"status_json": str(path)}, mode="text")
    row = json.loads(path.read_text())["hosts"][0]
    assert row["unit"] == "failed" and "its last run this boot" in row["unit_detail"], (row, status.tail())
    doctor = lab.deploy("deploy/doctor.py", hosts=["t4"], mode="text")
    assert "== t4: failed" in doctor.output and "never ran" not in doctor.output, doctor.tail()
    assert "[stage-not-finished]" in doctor.output, doctor.tail()


def render_table(rows: list[dict]) -> str:
    out = ["| bad input | what the user set | refused where | exit | s | what verl-lab printed |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        where = {"inventory": "the run's checks: the inventory's values", "accepted": "accepted",
                 "limit": "pyinfra's inventory, before any connection"}.get(
            r["where"], f"the run's checks: what {r['where']}'s box told")
        printed = "<br>".join(line.replace("|", "\\|") for line in r["printed"])
        took = r["seconds"] if r["seconds"] is not None else "-"
        out.append(f"| {r['row']} | `{r['input']}` | {where} | {r['rc']} | {took} | {printed} |")
    return "\n".join(out)


def test_docs_table_is_what_the_runs_printed():
    assert len(ROWS) == len(CASES) + 1 + len(KEY_CASES) + 3, "run the whole module: the table is made from every case"
    text = DOC.read_text()
    head, rest = text.split(TABLE_START, 1)
    written, tail = rest.split(TABLE_END, 1)
    if os.environ.get("VERL_LAB_WRITE_DOCS"):
        DOC.write_text(f"{head}{TABLE_START}\n{render_table(ROWS)}\n{TABLE_END}{tail}")
        return
    # the seconds (the fifth column) change from run to run; everything else must be what these runs printed, but
    # for the numbers in the rows that print this machine's RAM and disk (each number one N: 68.3 GiB free on one
    # day, 75.3 and so 4.2 to free on another)
    def drop_seconds(table: str) -> list[str]:
        rows = ["|".join(cell for i, cell in enumerate(line.split("|")) if i != 5) for line in table.strip().splitlines()]
        return [re.sub(r"\d+", "N", r) if any(f"| {m} |" in r for m in MACHINE_ROWS) else r for r in rows]
    assert drop_seconds(written) == drop_seconds(render_table(ROWS)), \
        "docs/refusals.md differs from the runs: VERL_LAB_WRITE_DOCS=1 rewrites it"
