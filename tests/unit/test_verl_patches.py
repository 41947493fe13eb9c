"""The version-pinned verl 0.5.0 patches: they apply to the PyPI sources, and each changes what
it claims to, shown on CPU against the pristine 0.5.0 tree.

The behaviour probes (tests/fixtures/verl_probes.py) run in a cached venv holding the CPU torch
from /opt/wheels and verl's pinned dependencies (tests/fixtures/standins/env.py: first run
about 2 minutes to build it, later runs reuse it). Patch application needs only git.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tasks.verl import source as verl_source
from tests.fixtures.standins import env as standin

PROBES = Path(__file__).resolve().parents[1] / "fixtures" / "verl_probes.py"


def _git_tree(tmp: Path) -> Path:
    root = standin.verl_tree(tmp)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def _apply_all(root: Path) -> None:
    for patch in verl_source.patch_files():
        subprocess.run(["git", "apply", "--reverse", "--check", str(patch)], cwd=root,
                       capture_output=True)
        subprocess.run(["git", "apply", "--check", str(patch)], cwd=root, check=True)
        subprocess.run(["git", "apply", str(patch)], cwd=root, check=True)


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    pristine = _git_tree(tmp_path_factory.mktemp("pristine"))
    patched = _git_tree(tmp_path_factory.mktemp("patched"))
    _apply_all(patched)
    return {"pristine": pristine, "patched": patched}


def test_patch_set_is_pinned_to_0_5_0():
    names = [p.name for p in verl_source.patch_files()]
    assert names == [
        "0001-autocast-dtype-follows-param-dtype.diff",
        "0002-critic-attn-implementation-from-config.diff",
        "0003-guard-flash-attn-import.diff",
        "0004-hf-rollout-positions-and-sampling.diff",
        "0005-hf-rollout-one-sequence-per-repeated-prompt.diff",
        "0006-checkpoint-retention-across-restarts-and-nodes.diff",
        "0007-fsdp2-gather-once-per-pass.diff",
        "0008-fsdp2-update-gather-and-reduce-once-per-mini-batch.diff",
        "0009-fused-adamw-from-config.diff",
        "0010-taskrunner-on-the-driver-node.diff",
        "0011-lora-keeps-its-fsdp1-wrap-policy-with-the-hf-rollout.diff",
        "0012-hf-rollout-generates-with-a-peft-model.diff",
        "0013-hf-rollout-generates-with-the-adapter-merged.diff",
    ]
    assert all(p.parent.name == "verl-0.5.0" for p in verl_source.patch_files())


def test_patches_apply_cleanly_and_each_one_is_detected_as_applied(tmp_path):
    root = _git_tree(tmp_path)
    for patch in verl_source.patch_files():
        subprocess.run(["git", "apply", "--check", str(patch)], cwd=root, check=True)
    _apply_all(root)
    for patch in verl_source.patch_files():
        # applied: the reverse applies (that is the idempotence check the stage makes) ...
        subprocess.run(["git", "apply", "--reverse", "--check", str(patch)], cwd=root, check=True)
        # ... and the forward no longer does
        again = subprocess.run(["git", "apply", "--check", str(patch)], cwd=root, capture_output=True)
        assert again.returncode != 0
    assert "autocast_dtype_of" in (root / "verl/workers/actor/dp_actor.py").read_text()


def test_patches_refuse_other_verl_sources(tmp_path):
    root = _git_tree(tmp_path)
    actor = root / "verl/workers/actor/dp_actor.py"
    actor.write_text(actor.read_text().replace("dtype=torch.bfloat16", "dtype=torch.float16"))
    first = verl_source.patch_files()[0]
    res = subprocess.run(["git", "apply", "--check", str(first)], cwd=root, capture_output=True, text=True)
    assert res.returncode != 0 and "dp_actor.py" in res.stderr


@pytest.fixture(scope="module")
def python(served):
    """The probes run as children of an interpreter with verl's stack imported (tests/fixtures/zygote.py)."""
    return served.python()


PROBE_SET = {
    "pristine": [
        ["actor_autocast", "fp32"], ["critic_autocast", "fp32"], ["hf_rollout_autocast", "float32"],
        ["critic_config_attn", "sdpa"], ["valuehead_attn", "sdpa"], ["valuehead_attn", "default"],
        ["flash_attn_guard"],
    ],
    "patched": [
        *[[f"{role}_autocast", d] for role in ("actor", "critic") for d in ("fp32", "fp16", "unset")],
        *[["hf_rollout_autocast", d] for d in ("float32", "float16", "unset")],
        ["critic_config_attn", "sdpa"], ["critic_config_attn", "unset"],
        ["valuehead_attn", "sdpa"], ["valuehead_attn", "default"],
        ["flash_attn_guard"], ["remove_padding_without_flash_attn"], ["package_imports"],
    ],
}


@pytest.fixture(scope="module")
def results(python, trees):
    """Every probe's answer per tree: two processes in all (see verl_probes.run_batch)."""
    found = {}
    for tree, probes in PROBE_SET.items():
        res = subprocess.run([str(python), str(PROBES), "--batch", json.dumps(probes)], cwd=trees[tree],
                             capture_output=True, text=True, timeout=600)
        answers = {}
        for line in res.stdout.splitlines():
            if line.startswith("PROBE "):
                item = json.loads(line[len("PROBE "):])
                answers[tuple(json.loads(item["probe"]))] = item
        found[tree] = (answers, res.stdout[-3000:] + res.stderr[-3000:])
    return found


@pytest.fixture
def probe(results):
    def answer(tree, name, *args):
        answers, log = results[tree]
        item = answers.get((name, *args))
        assert item is not None and "result" in item, f"probe {name}{args} on {tree}: {item}\n{log}"
        return item["result"]
    return answer


def test_patched_package_imports(probe):
    """verl.workers.fsdp_workers of the patched tree imports (in the probes' batch: one process per tree)."""
    assert probe("patched", "package_imports") == {"version": "0.5.0",
                                                   "fsdp_workers": "verl/workers/fsdp_workers.py"}


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_autocast_follows_param_dtype(probe, role):
    # fp32 config: pristine 0.5.0 still autocasts to bf16; patched runs without autocast (fp32)
    assert probe("pristine", f"{role}_autocast", "fp32") == {"enabled": True, "dtype": "bfloat16"}
    assert probe("patched", f"{role}_autocast", "fp32")["enabled"] is False
    # fp16 config follows too; unset keeps upstream's bf16
    assert probe("patched", f"{role}_autocast", "fp16") == {"enabled": True, "dtype": "float16"}
    assert probe("patched", f"{role}_autocast", "unset") == {"enabled": True, "dtype": "bfloat16"}


def test_hf_rollout_autocast_follows_rollout_dtype(probe):
    assert probe("pristine", "hf_rollout_autocast", "float32") == {"enabled": True, "dtype": "bfloat16"}
    assert probe("patched", "hf_rollout_autocast", "float32")["enabled"] is False
    assert probe("patched", "hf_rollout_autocast", "float16") == {"enabled": True, "dtype": "float16"}
    assert probe("patched", "hf_rollout_autocast", "unset") == {"enabled": True, "dtype": "bfloat16"}


def test_critic_attention_from_override_config(probe):
    assert probe("pristine", "critic_config_attn", "sdpa") == {"attn_implementation": "flash_attention_2"}
    assert probe("patched", "critic_config_attn", "sdpa") == {"attn_implementation": "sdpa"}
    assert probe("patched", "critic_config_attn", "unset") == {"attn_implementation": "flash_attention_2"}


def test_valuehead_loader_takes_attention(probe):
    pristine = probe("pristine", "valuehead_attn", "sdpa")
    assert pristine["loaded"] is False and "TypeError" in pristine["error"]
    assert probe("pristine", "valuehead_attn", "default")["loaded"] is False  # FA2, no flash_attn
    assert probe("patched", "valuehead_attn", "sdpa") == {"loaded": True, "attn": "sdpa"}
    assert probe("patched", "valuehead_attn", "default")["loaded"] is False  # default unchanged


def test_flash_attn_import_guarded(probe):
    pristine = probe("pristine", "flash_attn_guard")
    assert all(v.startswith("ImportError") for v in pristine.values()), pristine
    patched = probe("patched", "flash_attn_guard")
    assert set(patched.values()) == {"imported"}, patched
    loud = probe("patched", "remove_padding_without_flash_attn")
    assert loud["raised"] and "use_remove_padding" in loud["raised"]


# ---------------------------------------------------------------- 0006: checkpoint retention

CHECKPOINT_PROBE = Path(__file__).resolve().parents[1] / "fixtures" / "verl_checkpoint_probe.py"


@pytest.fixture(scope="module")
def retention(verl_python, trees):
    """verl's FSDPCheckpointManager on CPU, two ranks as two boxes with their own disks (a mount
    namespace each: root only), max_ckpt_to_keep=2: saves 1-3, then a new manager (a restarted
    process) saves 4. Per tree, per box: the steps whose actor save remains after each save."""
    if os.geteuid() != 0:
        pytest.skip("the two boxes' disks are mount namespaces: root only")
    # fresh, not served (tests/fixtures/zygote.py): two of its served runs under load lost one rank's PROBE line
    # (a KeyError in the test below; not diagnosed), none of its fresh runs did
    runs = {tree: subprocess.Popen([str(verl_python), str(CHECKPOINT_PROBE), "retention"], cwd=trees[tree], text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for tree in ("pristine", "patched")}
    found = {}
    for tree, run in runs.items():
        stdout, stderr = run.communicate(timeout=900)
        items = [json.loads(line[len("PROBE "):]) for line in stdout.splitlines() if line.startswith("PROBE ")]
        assert run.returncode == 0 and items and not any("error" in i for i in items), stdout[-2000:] + stderr[-3000:]
        found[tree] = {(i["rank"], i["after"]): i for i in items}
    return found


def test_pristine_verl_keeps_saves_from_before_a_restart_and_on_other_boxes(retention):
    box0, box1 = (lambda after: retention["pristine"][(0, after)]["steps"]), \
        (lambda after: retention["pristine"][(1, after)]["steps"])
    assert box0(3) == [2, 3]          # rank 0 removes on its own disk ...
    assert box1(3) == [1, 2, 3]       # ... never on the other box's
    assert box0(4) == [2, 3, 4]       # a restarted manager forgets the saves before it
    assert box1(4) == [1, 2, 3, 4]


def test_patched_verl_keeps_max_ckpt_to_keep_on_every_box_across_a_restart(retention):
    for rank in (0, 1):
        steps = [retention["patched"][(rank, after)]["steps"] for after in (1, 2, 3, 4)]
        assert steps == [[1], [1, 2], [2, 3], [3, 4]], (rank, steps)
        assert retention["patched"][(rank, 4)]["files"] == [
            f"global_step_{s}/actor/{kind}_world_size_2_rank_{rank}.pt" for s in (3, 4)
            for kind in ("extra_state", "model", "optim")]
