"""Patch 0013 on two ranks (files/patches/verl-0.5.0/0013-hf-rollout-generates-with-the-adapter-merged.diff), with
verl 0.5.0's own ActorRolloutRefWorker on two gloo ranks (tests/fixtures/lora_two_ranks.py): FSDP1 (the P40's plan,
0011's LoRA wrap: each decoder layer a unit, its lora_A/lora_B units nested) and FSDP2 + CPUOffloadPolicy (the GTX
1080's plan), LoRA rank 4 on every linear layer, the adapter made non-zero, two rollouts, each rank's rows ending
at other steps (rank 0 at the first token, rank 1 at the response length).

The ranks see different MemAvailable (a stand-in /proc/meminfo per rank, read by the patch's ``_host_room``):

* ``roomy``: 64 GiB on rank 0, 1 GiB on rank 1, both enough: both generate merged;
* ``tight``: 64 GiB on rank 0, none on rank 1: rank 1 has no room, so both generate unmerged (the decision is
  taken together, a MIN all-reduce). Made per rank (the all-reduce taken out, by hand: ``if not room:``) rank 0
  merges and stops calling the LoRA units rank 1 still gathers: both ranks hung until killed (120 s) under FSDP1
  and FSDP2, and these tests fail.

What is measured: the actor's log-probs of a fixed batch before any rollout and after each (bit for bit), each
rank's shards after both rollouts (bit for bit), and the CPU allocator's peak growth during one more merge and
restore (torch's profiler with ``profile_memory``). Under FSDP1 that peak is one decoder layer's gathered flat
parameter twice (a gloo all_gather_into_tensor allocates its output's size once more while it runs; NCCL gathers
into the output): 296,960 bytes, where the model is 461,056. Summoning the whole model for the merge (0013's first
version's way, by hand) measured 593,152 and fails the bound. Nothing is gathered when nothing is merged: 4 bytes
(the vote).

The four runs, one process whose ranks are forked (docs/testing.md "Heavy processes"), took 10-20 s on this machine
(2 cores) beside other work (a process per rank: 40 s idle, 111 s beside other work); the two-rank check that used
to live in test_lora_worker.py is the ``roomy`` run's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tasks.verl import source as verl_source
from tests.unit.test_fsdp2_gather import SHRINK, tiny_model
from tests.unit.test_hf_rollout import _tree
from tests.unit.test_lora_worker import GAP, plan_overrides

TWO_RANKS = Path(__file__).resolve().parents[1] / "fixtures" / "lora_two_ranks.py"
GIB_KIB = 1 << 20
MEMINFO = {"roomy": [64 * GIB_KIB, GIB_KIB], "tight": [64 * GIB_KIB, 0]}
LIMIT_S = 240           # a run takes 10-30 s; a rank past this is hung (a collective only one rank joined)


@pytest.fixture(scope="module")
def runs(verl_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-ranks")
    model = tiny_model(tmp / "model")
    tree = _tree(tmp / "tree", verl_source.patch_files())
    specs = {}
    for card in ("fsdp1", "fsdp2"):
        # a mini-batch of 4 prompts: two ranks each take half (the P40's PPO samples one sequence a prompt)
        overrides = [line if not line.startswith("actor_rollout_ref.actor.ppo_mini_batch_size=")
                     else "actor_rollout_ref.actor.ppo_mini_batch_size=4" for line in plan_overrides(card, model)]
        for case, meminfo in MEMINFO.items():
            specs[card, case] = tmp / f"{card}-{case}.json"
            specs[card, case].write_text(json.dumps({"overrides": overrides, "meminfo_kib": meminfo,
                                                     "limit_s": LIMIT_S}))
    # one process for the four runs (torch, transformers, peft and verl imported once), each run's ranks forked
    res = subprocess.run([str(verl_python), str(TWO_RANKS), *map(str, specs.values())], cwd=tree, capture_output=True,
                         text=True, timeout=3 * LIMIT_S * len(specs))
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and len(lines) == len(specs), res.stdout[-3000:] + res.stderr[-3000:]
    return {key: json.loads(line[len("RESULT "):]) for key, line in zip(specs, lines, strict=True)}


def _ranks(runs, card, case) -> dict:
    found = runs[card, case]
    assert found["exit"] == [0, 0], found["logs"]         # "timeout": a hang, both ranks killed
    return {r["rank"]: r for r in found["ranks"]}


@pytest.mark.parametrize("card", ["fsdp1", "fsdp2"])
def test_two_ranks_whose_rollouts_end_apart_stay_in_step(runs, card):
    """Every generated token's forward gathers the nested FSDP units (0011's wrap under FSDP1, the decoder layers
    under FSDP2): transformers' synced_gpus keeps rank 0 running dummy forwards until rank 1 is done, then both
    compute log-probs. Without synced_gpus the ranks hang (seen by hand: ``lora_two_ranks.py SPEC --no-sync`` times
    out). With the adapter made non-zero, 0013 samples the policy the actor scores."""
    by_rank = _ranks(runs, card, "roomy")
    assert by_rank[0]["response_tokens"] == [1] * 8
    assert by_rank[1]["response_tokens"] == [SHRINK["data.max_response_length"]] * 8
    for found in by_rank.values():
        assert found["log_probs_finite"] and found["rollout_gap"] < GAP, found
        assert found["merged_after_rollout"] == 0 and found["shards"] > 0


@pytest.mark.parametrize("card", ["fsdp1", "fsdp2"])
def test_ranks_with_room_both_generate_merged_and_restore_bit_for_bit(runs, card):
    by_rank = _ranks(runs, card, "roomy")
    for found in by_rank.values():
        assert found["adapter_calls_in_rollout"] == 0 and found["adapter_calls_in_rollout_2"] == 0, found
        assert found["said"] == {}, found["said"]
        # the log-probs of a fixed batch after each rollout are the ones before any, bit for bit; so are the shards
        assert found["logprobs_after_rollouts_equal"] == [True, True], found
        assert found["rollout_moved"] == [] and found["rollouts_moved"] == [], found
        # this rank's shards of the adapted units only: half the decoder layers' weights each (FULL_SHARD of 2)
        layers = found["sizes"]["layers"] * found["sizes"]["layer_bytes"]
        assert 0.3 * layers < found["host_copy_bytes"] < 0.55 * layers, (found["host_copy_bytes"], found["sizes"])


@pytest.mark.parametrize("card", ["fsdp1", "fsdp2"])
def test_one_rank_without_room_makes_both_generate_unmerged(runs, card):
    """Rank 1's host has no room: it says so, rank 0 says another rank has none, and both generate through PEFT's
    unmerged layers (2 layers x 7 adapted linears x 6 decoding steps of the adapter's A, on every rank: the
    collectives stay matched, no hang)."""
    by_rank = _ranks(runs, card, "tight")
    steps = SHRINK["data.max_response_length"]
    for found in by_rank.values():
        assert found["adapter_calls_in_rollout"] >= 2 * 7 * steps, found
        assert found["adapter_calls_in_rollout_2"] >= 2 * 7 * steps, found
        assert found["host_copy_bytes"] is None
        assert found["logprobs_after_rollouts_equal"] == [True, True] and found["rollouts_moved"] == []
        assert found["rollout_gap"] < GAP
    assert list(by_rank[1]["said"]) == ["room"], by_rank[1]["said"]
    assert "for the box's 2 rank(s)" in by_rank[1]["said"]["room"] and "0.0 MiB is (MemAvailable)" in \
        by_rank[1]["said"]["room"]
    assert list(by_rank[0]["said"]) == ["others"], by_rank[0]["said"]
    assert "another rank's host has no room" in by_rank[0]["said"]["others"]


@pytest.mark.parametrize("card", ["fsdp1", "fsdp2"])
def test_the_merge_holds_one_layer_at_a_time_and_nothing_without_room(runs, card):
    for found in _ranks(runs, card, "roomy").values():
        sizes, peak = found["sizes"], found["merge_peak_bytes"]
        # one unit's gathered flat parameter, staged twice by gloo's all-gather, and the merge's fp32 delta
        assert 0 < peak <= 2 * sizes["layer_bytes"] + sizes["delta_bytes"], (peak, sizes)
        assert peak < sizes["model_bytes"], (peak, sizes)
        if card == "fsdp2":      # local rows only: no gather but lora_A (rank x in)
            assert peak <= sizes["layer_bytes"], (peak, sizes)
    for found in _ranks(runs, card, "tight").values():
        assert found["merge_peak_bytes"] < 1024, found["merge_peak_bytes"]      # the vote's int32, no gather
