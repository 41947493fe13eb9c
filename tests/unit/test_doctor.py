"""Doctor rules: each one matches a real-shaped excerpt of the message it knows, and lines
that only look alike do not match."""

import json
import re
from pathlib import Path

import pytest

from tasks.doctor import diagnose, load_rules, main
from tasks.settings import DEFAULTS

OOM = """\
(WorkerDict pid=4242) Traceback (most recent call last):
  File "verl/single_controller/ray/base.py", line 663, in func
    return getattr(self.worker_dict[key], name)(*args, **kwargs)
  File "verl/workers/fsdp_workers.py", line 610, in update_actor
    metrics = self.actor.update_policy(data=data)
  File "verl/workers/actor/dp_actor.py", line 410, in update_policy
    loss.backward()
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.16 GiB. GPU 0 has a total capacity of 23.87 GiB of which 403.50 MiB is free. Including non-PyTorch memory, this process has 23.47 GiB memory in use. Of the allocated memory 21.50 GiB is allocated by PyTorch, and 1.47 GiB is reserved by PyTorch but unallocated.
"""

EXCERPTS = {
    "cuda-oom": OOM,
    "no-kernel-image": "RuntimeError: CUDA error: no kernel image is available for execution on the device\n"
                       "CUDA kernel errors might be asynchronously reported at some other API call",
    "bf16-unsupported": "ValueError: Bfloat16 is only supported on GPUs with compute capability of at least 8.0. "
                        "Your Tesla T4 GPU has compute capability 7.5. You can use float16 instead by explicitly "
                        "setting the`dtype` flag in CLI, for example: --dtype=half.",
    "flash-attn-unsupported": "RuntimeError: FlashAttention only supports Ampere GPUs or newer.",
    "triton-old-gpu": "RuntimeError: Found Tesla P40 which is too old to be supported by the triton GPU compiler, "
                      "which is used as the backend. Triton only supports devices of CUDA Capability >= 7.0, "
                      "but your device is of CUDA capability 6.1",
    "triton-shared-memory": "triton.runtime.errors.OutOfResources: out of resource: shared memory, "
                            "Required: 98304, Hardware limit: 65536. Reducing block sizes or `num_stages` may help.",
    "prompt-too-long": "  File \"verl/utils/dataset/rl_dataset.py\", line 307, in __getitem__\n"
                       "RuntimeError: Prompt length 211 is longer than 128.",
    "apex-cuda-mismatch": "RuntimeError: Cuda extensions are being compiled with a version of Cuda that does not "
                          "match the version used to compile Pytorch binaries.  Pytorch binaries were compiled "
                          "with Cuda 11.8.\nIn some cases, a minor-version mismatch will not cause later errors",
    "gcc-too-new": "/usr/local/cuda-11.8/include/crt/host_config.h:132:2: error: #error -- unsupported GNU "
                   "version! gcc versions later than 11 are not supported! The nvcc flag "
                   "'-allow-unsupported-compiler' can be used to override this version check",
    "driver-too-old": "RuntimeError: The NVIDIA driver on your system is too old (found version 11040). Please "
                      "update your GPU driver by downloading and installing a new version",
    "no-driver": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
                 "the latest NVIDIA driver is installed and running.",
    "no-cuda-device": "RuntimeError: No CUDA GPUs are available",
    "hf-html-page": "safetensors_rust.SafetensorError: Error while deserializing header: HeaderTooLarge",
    "checksum-mismatch": "sha256 mismatch for http://mirror/x.tar.xz: expected aaaa, got bbbb; deleted, not installed",
    "vllm-old-gpu": "ValueError: vLLM only supports GPUs with compute capability >= 7.0",
    "plan-gpu-mismatch": "  FAIL  gpu: the plan is for NVIDIA H100 80GB HBM3, nvidia-smi lists Tesla T4; GPU 0 has "
                         "15360 MiB, the plan assumed 81559 MiB (re-run deploy/train.py to plan for this GPU)",
    "gpu-memory-short": "  FAIL  gpu memory: 15360 MiB free on a GPU, the plan's predicted peak is 40210 MiB "
                        "(another process holds GPU memory: nvidia-smi shows which)",
    "stage-not-finished": "  FAIL  env marker: /opt/verl-lab/markers/env.done missing: the Python env stage has "
                          "not finished on this box",
    # the cluster check's lines (tests/e2e/test_cluster.py), a worker unit's ExecStartPre, NCCL/Gloo/Ray's own
    "cluster-node-differs": "  FAIL  cluster: node 127.0.0.3 (wk1-3f2a1b): verl sources 9c1e differs from the head's missing",
    "cluster-not-joined": "verl-lab: no Ray head at 10.0.0.5:6379 after 30 tries",
    "cluster-hostname": "  FAIL  cluster: node 10.0.0.6 (wk1): its hostname resolves to 127.0.1.1, not 10.0.0.6: "
                        "re-run deploy/cluster.py on it",
    "cluster-interface": "RuntimeError: [enforce fail at ../third_party/gloo/gloo/transport/tcp/device.cc:83] "
                         "ifa != nullptr. Unable to find address for: eth1",
    "cluster-collective-timeout": "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
                                  "OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600010 milliseconds before timing out.",
    "ray-version-mismatch": "RuntimeError: Version mismatch: The cluster was started with:",
}

# Lines that share words with a rule but are not that failure.
NOT_MATCHES = {
    "cuda-oom": "INFO: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid out of memory fragmentation",
    "no-kernel-image": "building kernel image for sm_61",
    "prompt-too-long": "Filtering prompts longer than 128 tokens: 100%|##########| 7473/7473",
    "hf-html-page": "# <!DOCTYPE html> is what a captcha page starts with",
    "flash-attn-unsupported": "attn_implementation=sdpa (flash_attention_2 needs Ampere)",
    "driver-too-old": "driver 535.104.05 is new enough for CUDA 11.8",
    "gpu-memory-short": "  ok    gpu memory: 23000 MiB free >= predicted peak 19018 MiB",
    "plan-gpu-mismatch": "  ok    gpu: 1 x Tesla T4, 15360 MiB, driver 535.104.05",
    "stage-not-finished": "  ok    env marker: /opt/verl-lab/markers/env.done",
    "cluster-node-differs": "  ok    cluster: verl-lab cluster check passed: 3 nodes x 1 GPU(s), the same env\n"
                            "  FAIL  cluster: node 10.0.0.6 (wk1): its hostname resolves to 127.0.1.1, not 10.0.0.6",
    "cluster-not-joined": "  ok    cluster: verl-lab cluster check passed: 3 nodes x 1 GPU(s)",
}


# More excerpts, one file per rule: tests/fixtures/doctor/<rule id>.log (the message exactly as the
# library prints it) and, where a look-alike line exists, <rule id>.not.log (must not match).
EXCERPT_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"
for _f in sorted(EXCERPT_DIR.glob("*.log")):
    _id, _, _kind = _f.name.removesuffix(".log").partition(".")
    _target = NOT_MATCHES if _kind == "not" else EXCERPTS
    assert _id not in _target, f"{_f}: rule {_id} has an excerpt in this module already"
    _target[_id] = _f.read_text()


def test_every_rule_has_an_excerpt():
    assert {r.id for r in load_rules()} == set(EXCERPTS)


def test_rule_files_load_in_order_and_ids_are_unique(tmp_path):
    from tasks.doctor import rule_files

    rule = '[[rule]]\nid = "{}"\nmatch = ["x"]\ncause = "c"\nfix = "f"\n'
    for name, rule_id in (("rules.toml", "a"), ("b.toml", "b"), ("a.toml", "a2")):
        (tmp_path / name).write_text(rule.format(rule_id))
    assert [p.name for p in rule_files(tmp_path)] == ["rules.toml", "a.toml", "b.toml"]
    assert [r.id for r in load_rules(folder=tmp_path)] == ["a", "a2", "b"]
    (tmp_path / "b.toml").write_text(rule.format("a"))
    with pytest.raises(ValueError, match="used twice"):
        load_rules(folder=tmp_path)


@pytest.mark.parametrize("rule_id", sorted(EXCERPTS))
def test_rule_matches_its_excerpt(rule_id):
    diag = diagnose("box", {"journal": EXCERPTS[rule_id]})
    assert rule_id in [f.rule for f in diag.findings]
    assert diag.failed


@pytest.mark.parametrize("rule_id", sorted(NOT_MATCHES))
def test_lookalike_lines_do_not_match(rule_id):
    diag = diagnose("box", {"journal": NOT_MATCHES[rule_id]})
    assert rule_id not in [f.rule for f in diag.findings]


def test_oom_names_phase_component_and_next_plan_step():
    plan = {"predicted_peak_mib": 20000, "breakdown": {"actor_states": 7600, "actor_activations": 3100},
            "offload": {"ref_param_offload": True}}
    (finding,) = diagnose("p40", {"journal": OOM}, plan).findings
    d = finding.details
    assert d["phase"] == "actor"
    assert d["tried_to_allocate_mib"] == pytest.approx(1187.8, abs=0.1)
    assert d["gpu_free_mib"] == pytest.approx(403.5)
    assert d["component_estimates_mib"] == {"actor_states": 7600, "actor_activations": 3100}
    assert d["exceeded_estimate_by_mib"] == pytest.approx(23.47 * 1024 + 1187.84 - 20000, abs=1)
    assert d["plan_would_change"] == "actor_optimizer_offload"


def test_oom_without_plan_says_so():
    (finding,) = diagnose("p40", {"journal": OOM}).findings
    assert "no plan.json" in finding.details["advice"]


def test_unknown_failure_shows_last_relevant_lines():
    text = "starting\nTraceback (most recent call last):\n  File x\nZeroDivisionError: division by zero\n"
    diag = diagnose("box", {"journal": text})
    assert diag.failed and not diag.findings
    assert any("ZeroDivisionError" in line for line in diag.unknown_tail)


def test_clean_log_is_not_a_failure():
    diag = diagnose("box", {"journal": "step:1 - actor/pg_loss:0.1\nstep:2 - actor/pg_loss:0.09\n"})
    assert not diag.failed and not diag.findings and not diag.unknown_tail


def test_cli_json(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(EXCERPTS["triton-old-gpu"])
    assert main(["--json", "--host", "p40", str(log)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["host"] == "p40" and out["findings"][0]["rule"] == "triton-old-gpu"


# What a rule's advice names as something to set: `key = value` or `key=value` (not a dotted
# Hydra key), "set key", a backticked snake_case name; and each " / " item of its `setting`
# field that is a bare name (``mirror_urls.huggingface`` names mirror_urls).
ASSIGNED = re.compile(r"(?<![\w./-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\s*=(?!=)")
SET = re.compile(r"\bset ([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b")
BACKTICKED = re.compile(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`")
BARE_NAME = re.compile(r"([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?:\.[a-z0-9_]+)?")
SNAKE = re.compile(r"(?<![\w./-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w/])")


def settings_named(rule):
    named = set(ASSIGNED.findall(rule.fix)) | set(SET.findall(rule.fix)) | set(BACKTICKED.findall(rule.fix))
    for item in filter(None, (i.strip() for i in rule.setting.split(" / "))):
        if m := BARE_NAME.fullmatch(item):
            named.add(m.group(1))
        elif not item.startswith("plan "):   # a plan choice, or words: no setting-like name in them
            named |= set(SNAKE.findall(item))
    return named


@pytest.mark.parametrize("rule", load_rules(), ids=lambda r: r.id)
def test_rules_tell_users_to_set_only_real_settings(rule):
    unknown = sorted(settings_named(rule) - set(DEFAULTS))
    assert not unknown, f"rule {rule.id} names {unknown}, not keys of tasks/settings/load.py DEFAULTS"


def test_setting_names_are_found_in_advice():
    from tasks.doctor import Rule
    rule = Rule("r", (), (), "cause", "set train_steps, or mirror_profile = 'cn', or `hf_token_file`; "
                "not data.max_prompt_length=256", "env_backend / mirror_urls.pypi / plan offload level / deploy/full.py / the box's GPU")
    assert settings_named(rule) == {"train_steps", "mirror_profile", "hf_token_file", "env_backend", "mirror_urls"}


def test_never_ran_reads_the_preflight_with_the_rules():
    from tasks.doctor import never_ran

    check = ("verl-lab preflight on box: 1 x Tesla T4 planned\n"
             "  FAIL  env python: /opt/verl-lab/envs/verl/bin/python does not exist: the Python env stage has not "
             "run on this box\nverl-lab preflight FAILED on box: 1 of 10 checks failed (env python)\n")
    diag, words = never_ran("box", check)
    assert [f.rule for f in diag.findings] == ["stage-not-finished"]
    assert words.startswith("the unit never ran; the launcher's preflight says:\n  [stage-not-finished]")
    assert "never ran (train_unit_state is installed or enabled" in never_ran("box", "")[1]
    lead = "never ran (installed, never started)"          # deploy/doctor.py's own words
    assert never_ran("box", check, lead=lead)[1].startswith(lead + "; the launcher's preflight says:\n")
    assert never_ran("box", "", lead=lead)[1].startswith(lead + " (train_unit_state is installed")


# a worker's Ray unit waiting for a head that is gone (journalctl -u verl-lab-ray.service -o cat)
RAY_JOURNAL = """\
Started verl-lab-ray.service - verl-lab Ray worker of cluster lab1 (10.0.0.6).
verl-lab: no Ray head at 10.0.0.1:6379 yet (try 1 of 30)
verl-lab: no Ray head at 10.0.0.1:6379 yet (try 5 of 30)
verl-lab: no Ray head at 10.0.0.1:6379 after 30 tries
verl-lab-ray.service: Control process exited, code=exited, status=1/FAILURE
verl-lab-ray.service: Failed with result 'exit-code'.
"""


def test_a_workers_ray_journal_is_diagnosed_naming_the_ray_unit():
    from tasks.cluster import RAY_UNIT
    from tasks.doctor import render

    diag = diagnose("wk1", {"verl-lab-train.service": "\n", RAY_UNIT: RAY_JOURNAL})
    assert diag.failed and [f.rule for f in diag.findings] == ["cluster-not-joined"]
    (finding,) = diag.findings
    assert finding.source == RAY_UNIT and finding.evidence[-1] == "verl-lab: no Ray head at 10.0.0.1:6379 after 30 tries"
    assert f"seen ({RAY_UNIT}): verl-lab: no Ray head at 10.0.0.1:6379 after 30 tries" in render(diag)
    assert "journalctl -u verl-lab-ray.service" in finding.fix


def test_the_ray_unit_journal_from_the_box_logs_fact():
    """What deploy/doctor.py passes on: BoxLogs' recorded answers on a worker of the lab's cluster,
    joined (Ray's own warnings are no failure), then with its head gone."""
    from tests.unit.test_facts_table import FIXTURES

    def logs(case):
        return json.loads((FIXTURES / "logs.BoxLogs" / f"{case}.json").read_text())["fact"]

    joined = diagnose("wk1", logs("ray_worker_joined"))
    assert not joined.failed and joined.findings == []
    lost = diagnose("wk1", logs("ray_worker_without_head"))
    assert lost.failed and [(f.rule, f.source) for f in lost.findings] == [("cluster-not-joined", "verl-lab-ray.service")]


def test_oom_advice_on_the_cpu_offload_rung_names_no_fsdp1_offload():
    """On grpo-cpu-offload the FSDP1 offload ladder does not apply (the policy keeps the actor and
    the ref on the CPU) and a GRPO plan has no critic to offload."""
    from tasks.doctor import analyse_oom

    lines = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB.",
             "  File \"dp_actor.py\", line 1, in update_actor"]
    offload_rung = {"rung": "grpo-cpu-offload", "predicted_peak_mib": 6502, "offload": {"ref_param_offload": True},
                    "workload": {"algorithm": "grpo", "actor_offload_policy": True}}
    out = analyse_oom(lines, offload_rung)
    assert out["phase"] == "actor" and "plan_would_change" not in out
    assert "CPU-offload rung (grpo-cpu-offload" in out["advice"] and "workload.model" in out["advice"]
    grpo = {"rung": "grpo", "offload": {"ref_param_offload": True, "actor_optimizer_offload": True},
            "workload": {"algorithm": "grpo", "actor_offload_policy": False}}
    assert analyse_oom(lines, grpo)["plan_would_change"] == "actor_param_offload"     # no critic step on GRPO
    ppo = {"offload": {"ref_param_offload": True, "actor_optimizer_offload": True}}
    assert analyse_oom(lines, ppo)["plan_would_change"] == "critic_optimizer_offload"


# ------------------------------------------------------------------ the headline and the CLI's inputs

REAL_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "verl_logs" / "p40-plan-h200.log"


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "tasks.doctor", *map(str, args)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("make,words", [
    (lambda d: d / "missing.log", "cannot read log {p}: No such file or directory"),
    (lambda d: d, "log {p} is a directory, not a file"),
    (lambda d: (d / "empty.log").write_text("") and d / "empty.log" or d / "empty.log", "no log ({p} empty)"),
    (lambda d: (d / "junk.log").write_bytes(bytes(range(256)) * 4) and d / "junk.log" or d / "junk.log",
     "no training run in the log: no verl step, preflight or failure line in it"),
])
def test_cli_inputs_it_cannot_judge_exit_2_without_a_traceback(tmp_path, make, words):
    path = make(tmp_path)
    res = _cli(path)
    assert res.returncode == 2, res
    assert words.format(p=path) in res.stderr and "Traceback" not in res.stderr + res.stdout
    assert "no failure found" not in res.stdout


@pytest.mark.parametrize("plan,words", [
    ("{not json", "is not JSON (Expecting property name enclosed in double quotes, line 1)"),
    ("[1, 2]", "is JSON but not a plan"),
    ("{}", "is a JSON object but not a plan.json: it has no rung, gpu, predicted_peak_mib"),
    (None, "cannot read --plan"),
])
def test_cli_plan_that_is_not_a_plan_json(tmp_path, plan, words):
    path = tmp_path / "plan.json"
    if plan is not None:
        path.write_text(plan)
    res = _cli("--plan", path, REAL_RUN)
    assert res.returncode == 2 and words in res.stderr and "Traceback" not in res.stderr, res


def test_cli_headlines_tell_a_run_that_ended_well_from_the_rest(tmp_path):
    ended = _cli(REAL_RUN)          # a real verl 0.5.0 run to its last step (GPU call 1)
    assert ended.returncode == 0 and ended.stdout.startswith("== local: no failure found"), ended
    cut = tmp_path / "cut.log"
    text = REAL_RUN.read_text()
    cut.write_text(text[:text.index("step:3 - ")])
    res = _cli(cut)
    assert res.returncode == 0 and res.stdout.startswith("== local: no failure so far: the run has not ended"), res
    failed = tmp_path / "failed.log"
    failed.write_text(text[:text.index("step:3 - ")] + "torch.OutOfMemoryError: CUDA out of memory. Tried to "
                      "allocate 1.50 GiB.\n")
    res = _cli(failed)
    assert res.returncode == 1 and res.stdout.startswith("== local: failed"), res


@pytest.mark.parametrize("unit,preflight,expect", [
    ("never-ran", "  FAIL  env python: missing\nverl-lab preflight FAILED on box", "never ran: preflight fails"),
    ("never-ran", "verl-lab preflight passed on box", "never ran: preflight passes"),
    ("never-ran", "", "never ran"),
    ("failed", "", "failed"), ("crash-looping", "", "failed"), ("running", "", "running"),
    ("finished", "", "no failure found"), ("stopped", "", "stopped before its end, no failure in its log"),
    ("not-installed", "", "no training unit"),
])
def test_the_headline_of_a_box(unit, preflight, expect):
    from tasks.doctor import render, verdict

    diag = diagnose("box", {"journal": ""})
    diag.verdict = verdict(diag, unit, preflight)
    assert diag.verdict == expect and render(diag).startswith(f"== box: {expect}")


def test_a_finished_or_stopped_unit_with_a_failure_in_its_journal_is_failed():
    from tasks.doctor import verdict

    diag = diagnose("box", {"journal": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB."})
    assert verdict(diag, "finished") == verdict(diag, "stopped") == "failed"


def test_never_ran_headline_is_not_no_failure_found():
    """deploy/doctor.py's never-ran box: the stage logs are clean, the preflight fails: the headline says so."""
    from tasks.doctor import never_ran

    check = "  FAIL  data marker: /opt/verl-lab/markers/data.done missing\nverl-lab preflight FAILED on box\n"
    preflight, _ = never_ran("box", check)
    assert preflight.verdict == "never ran: preflight fails"


def test_docs_refusals_doctor_table_is_what_the_cli_printed(tmp_path):
    """docs/refusals.md's table of the doctor's inputs: made by running each (VERL_LAB_WRITE_DOCS=1 rewrites it)."""
    import os
    import re

    text = REAL_RUN.read_text()
    files = {"run.log (missing)": None, "a directory": tmp_path, "empty.log": "", "junk.log": bytes(range(256)) * 4,
             "cut.log": text[:text.index("step:3 - ")],
             "oom.log": text[:text.index("step:3 - ")] + "torch.OutOfMemoryError: CUDA out of memory. Tried to "
                                                         "allocate 1.50 GiB.\n"}
    paths = {}
    for name, content in files.items():
        path = tmp_path / name.split(" ")[0]
        if isinstance(content, str):
            path.write_text(content)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        paths[name] = path if content is not None or name != "run.log (missing)" else tmp_path / "run.log"
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "empty.json").write_text("{}")
    runs = [("a missing file", [paths["run.log (missing)"]]), ("a directory", [tmp_path]),
            ("an empty file", [paths["empty.log"]]), ("a file of random bytes", [paths["junk.log"]]),
            ("`--plan` that is not JSON", ["--plan", tmp_path / "bad.json", REAL_RUN]),
            ("`--plan` that is a JSON list", ["--plan", tmp_path / "list.json", REAL_RUN]),
            ("`--plan` that is `{}`", ["--plan", tmp_path / "empty.json", REAL_RUN]),
            ("a run cut before its end", [paths["cut.log"]]), ("a run that ran out of memory", [paths["oom.log"]]),
            ("a real run to its last step (GPU call 1's log)", [REAL_RUN])]
    rows = ["| input | exit | headline (stdout) | stderr |", "|---|---|---|---|"]
    for label, args in runs:
        res = _cli(*args)
        assert "Traceback" not in res.stdout + res.stderr, res
        head = res.stdout.splitlines()[0] if res.stdout else ""
        err = res.stderr.strip().replace(str(tmp_path) + "/", "").replace(str(tmp_path), "DIR")
        err = err.replace(str(REAL_RUN.parent) + "/", "")
        rows.append(f"| {label} | {res.returncode} | {('`' + head + '`') if head else '-'} | "
                    f"{('`' + err + '`') if err else '-'} |")
    table = "\n".join(rows)
    doc = Path(__file__).resolve().parents[2] / "docs" / "refusals.md"
    start, end = "<!-- doctor table: made by tests/unit/test_doctor.py -->", "<!-- end of doctor table -->"
    body = doc.read_text()
    head, rest = body.split(start, 1)
    written, tail = rest.split(end, 1)
    if os.environ.get("VERL_LAB_WRITE_DOCS"):
        doc.write_text(f"{head}{start}\n{table}\n{end}{tail}")
        return
    assert written.strip() == table, "docs/refusals.md's doctor table differs: VERL_LAB_WRITE_DOCS=1 rewrites it"
    assert re.search(r"\| a real run to its last step .* \| 0 \| `== local: no failure found`", table)
