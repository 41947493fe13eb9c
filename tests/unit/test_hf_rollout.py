"""verl 0.5.0's HFRollout, run on CPU with transformers 4.54.1, against a correct forward pass:
patch 0004 (files/patches/verl-0.5.0/) is what makes it generate from the right positions and
sample with exactly the configured temperature/top-k/top-p.

tests/fixtures/hf_rollout_probe.py runs verl's own HFRollout from a source tree made from the
sdist, once with the patches before 0004 applied and once with the whole set, in the cached venv
of tests/fixtures/standins/env.py; every check below must fail on the first and pass on the
second.

With ``rollout.n > 1`` (the plan's GRPO rungs) verl 0.5.0's trainer repeats every prompt n times
before the rollout and HFRollout then asked generate() for n sequences of each: n x n, which the
trainer's union refuses. tests/fixtures/hf_rollout_n_probe.py runs the trainer's steps around the
rollout with n=4 on the tree before patch 0005 and with it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tasks.verl import source as verl_source
from tests.fixtures.standins import env as standin

PROBE = Path(__file__).resolve().parents[1] / "fixtures" / "hf_rollout_probe.py"
PATCH = "0004-hf-rollout-positions-and-sampling.diff"


def _tree(tmp: Path, patches: list[Path]) -> Path:
    root = standin.verl_tree(tmp)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    for patch in patches:
        subprocess.run(["git", "apply", str(patch)], cwd=root, check=True)
    return root


@pytest.fixture(scope="module")
def python(served):
    """The probes run as children of an interpreter with verl's stack imported (tests/fixtures/zygote.py)."""
    return served.python()


@pytest.fixture(scope="module")
def results(python, tmp_path_factory):
    """The probe's answer on the tree before 0004 ("before") and with every patch ("patched")."""
    patches = verl_source.patch_files()
    assert PATCH in [p.name for p in patches]
    found = {}
    for tree, chosen in (("before", [p for p in patches if p.name < PATCH]), ("patched", patches)):
        root = _tree(tmp_path_factory.mktemp(tree), chosen)
        res = subprocess.run([str(python), str(PROBE)], cwd=root, capture_output=True, text=True, timeout=600)
        lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
        assert res.returncode == 0 and lines, f"{tree}: {res.stdout[-3000:]}{res.stderr[-3000:]}"
        found[tree] = json.loads(lines[-1][len("RESULT "):])
        print(tree, json.dumps(found[tree], indent=1))
    return found


def test_the_probe_sees_what_a_box_sees(results):
    for result in results.values():
        assert result["transformers"] == "4.54.1"
        # the merge of model defaults applies: the model's generation_config.json says >= 4.50
        assert result["generation_config_version"] == "4.54.1"
        assert result["generate_has_use_model_defaults"] is True


def test_greedy_tokens_are_the_argmax_of_a_correct_forward(results):
    before, patched = results["before"]["greedy"], results["patched"]["greedy"]
    assert before["mismatches"] > 0, before
    assert patched["checked"] >= 40 and patched["mismatches"] == 0, patched


@pytest.mark.parametrize("config", ["defaults", "tuned"])
def test_sampling_uses_exactly_the_configured_values(results, config):
    before, patched = results["before"]["sampling"][config], results["patched"]["sampling"][config]
    assert before["max_prob_gap"] > 1e-2, before
    assert patched["checked"] >= 40 and patched["picked_as_returned"], patched
    assert patched["max_prob_gap"] < 1e-5, patched


def test_rollout_log_probs_are_the_actors(results):
    before, patched = results["before"]["sampling"]["defaults"], results["patched"]["sampling"]["defaults"]
    assert before["max_logprob_gap"] > 0.1, before
    assert patched["max_logprob_gap"] < 1e-4, patched


def test_use_model_defaults_only_where_generate_takes_it(results):
    before, patched = results["before"]["generate_kwargs"], results["patched"]["generate_kwargs"]
    assert before["old"]["position_ids"] == "Tensor" and before["new"]["use_model_defaults"] == "not passed"
    assert patched["old"] == {"position_ids": None}  # older transformers: not passed at all
    assert patched["new"] == {"position_ids": None, "use_model_defaults": False}


# ---- rollout.n > 1 (GRPO): patch 0005 -------------------------------------------------------

N_PROBE = Path(__file__).resolve().parents[1] / "fixtures" / "hf_rollout_n_probe.py"
PATCH_N = "0005-hf-rollout-one-sequence-per-repeated-prompt.diff"


@pytest.fixture(scope="module")
def n_results(python, tmp_path_factory):
    """The n=4 probe (the trainer's repeat, HFRollout, the trainer's union) on the tree before 0005
    and with every patch."""
    patches = verl_source.patch_files()
    assert PATCH_N in [p.name for p in patches]
    found = {}
    for tree, chosen in (("before", [p for p in patches if p.name < PATCH_N]), ("patched", patches)):
        root = _tree(tmp_path_factory.mktemp(f"n-{tree}"), chosen)
        res = subprocess.run([str(python), str(N_PROBE)], cwd=root, capture_output=True, text=True, timeout=600)
        lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
        assert res.returncode == 0 and lines, f"{tree}: {res.stdout[-3000:]}{res.stderr[-3000:]}"
        found[tree] = json.loads(lines[-1][len("RESULT "):])
    return found


def test_hf_rollout_with_n_4_made_n_squared_sequences_before_0005(n_results):
    before = n_results["before"]
    assert (before["prompts"], before["repeated"], before["generated"]) == (4, 16, 64)
    assert "identical batch size" in before["union"]        # the trainer's union fails: GRPO could not run


def test_hf_rollout_with_n_4_makes_one_sequence_per_repeated_prompt(n_results):
    patched = n_results["patched"]
    assert patched["generated"] == patched["repeated"] == 16 and patched["union"] == "ok"
    assert patched["prompt_rows_match"] and patched["positions_continue"]
    assert patched["distinct_samples_per_prompt"] == [4, 4, 4, 4]    # n independent samples per prompt
