"""verl 0.5.0's own checks, stated by the project (tasks/verl/rules.py) so they run on the controller,
proven equal to verl's: the same configs go through verl's real code (tests/fixtures/verl_plan_check.py
in verl 0.5.0's source tree with the project's patches, on CPU: RayPPOTrainer.__init__ with its
_validate_config and dataloaders, the FSDP workers' __init__ on forked gloo ranks,
ActorRolloutRefWorker._build_rollout's assert, vLLMRollout.__init__ up to vllm.LLM under a stand-in
vllm package, HFRollout's chunking) and through the rules. verl refuses exactly what the rules refuse,
and the rules' first violation is verl's refusal, word for word (a bare assert: its source line).

Behaviour, on verl's code: which configs verl refuses and why. Not run: vLLM itself (a stand-in
package stops at vllm.LLM), a GPU; the dataloader rule counts GSM8K's rows before verl filters
overlong prompts (a necessary condition only).
"""

from __future__ import annotations

import pytest

from tasks.plan import REPO_ROOT, GpuTarget, load_model_config, make_plan
from tasks.verl import Override
from tasks.verl import rules as verl_rules
from tests.unit.test_plan import workload
from tests.unit.test_verl_compose import base_config, verl_config_dir  # noqa: F401  (fixtures)
from tests.unit.test_verl_validation import run_plan_check, verl_root  # noqa: F401  (the fixture)

PHI3 = load_model_config(REPO_ROOT / "files" / "models" / "phi-3-mini-4k-instruct" / "config.json")
TRAIN_ROWS, VAL_ROWS = 7473, 64
P40, T4 = GpuTarget("Tesla P40", "6.1", 24576), GpuTarget("Tesla T4", "7.5", 15360)
RTX3090 = GpuTarget("NVIDIA GeForce RTX 3090", "8.6", 24576)
FOUR_P40 = GpuTarget("Tesla P40", "6.1", 24576, 4)


def planned(gpu, **work):
    plan = make_plan(gpu, workload(**work))
    return {o.key: o.value for o in plan.overrides}, plan.workload.model_config


def case(label, gpu, changes=None, model_config=None, **work):
    overrides, config = planned(gpu, **work)
    overrides.update(changes or {})
    return {"label": label, "overrides": overrides, "n_gpus": overrides["trainer.n_gpus_per_node"],
            "model_config": model_config or config}


def cases():
    return [
        # plans verl accepts
        case("P40 plan (HF rollout)", P40),
        case("T4 plan (vLLM V0)", T4),
        case("RTX 3090 plan (vLLM V1)", RTX3090),
        case("4 x P40 GRPO", FOUR_P40, algorithm="grpo"),
        case("train_batch_size 3, ppo_mini_batch_size 2 (P40)", P40, train_batch_size=3, ppo_mini_batch_size=2),
        case("train_batch_size 3, ppo_mini_batch_size 2 (T4)", T4, train_batch_size=3, ppo_mini_batch_size=2),
        # one broken rule each
        case("sequences not dividing over 4 GPUs", FOUR_P40, {"data.train_batch_size": 254}),
        case("no rollout log-prob micro-batch", P40,
             {"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": None}),
        case("no reference log-prob micro-batch (GRPO has a reference)", FOUR_P40,
             {"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": None}, algorithm="grpo"),
        case("no critic micro-batch", P40, {"critic.ppo_micro_batch_size_per_gpu": None}),
        case("both actor micro-batch settings", P40, {"actor_rollout_ref.actor.ppo_micro_batch_size": 4}),
        case("mini-batch above the batch", P40, {"data.train_batch_size": 16}),
        case("an unknown loss_agg_mode", P40, {"actor_rollout_ref.actor.loss_agg_mode": "token-sum"}),
        case("critic mini-batch above the batch", P40, {"critic.ppo_mini_batch_size": 512}),
        case("sampled validation at temperature 0", P40, {"actor_rollout_ref.rollout.val_kwargs.do_sample": True,
                                                           "actor_rollout_ref.rollout.temperature": 0}),
        case("a batch larger than GSM8K's train split", P40, {"data.train_batch_size": 8000}),
        case("mini-batch under the GPU count", FOUR_P40, {"actor_rollout_ref.actor.ppo_mini_batch_size": 2}),
        case("actor micro-batch not dividing the mini-batch", P40,
             {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 3}),
        case("critic micro-batch not dividing the mini-batch", P40, {"critic.ppo_micro_batch_size_per_gpu": 3}),
        case("vLLM across more GPUs than there are", T4,
             {"actor_rollout_ref.rollout.tensor_model_parallel_size": 2}),
        case("Phi-3-mini-4k with 6144-token sequences on vLLM", T4,
             {"data.max_prompt_length": 2048, "data.max_response_length": 4096}, model_config=PHI3),
        case("chunked prefill shorter than a sequence", T4,
             {"actor_rollout_ref.rollout.max_num_batched_tokens": 256}),
        case("HF chunks not dividing a step", P40, {"actor_rollout_ref.rollout.micro_batch_size": 3}),
        case("HF chunks not dividing validation", P40, {"data.train_batch_size": 96,
                                                          "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
                                                          "actor_rollout_ref.rollout.micro_batch_size": 20}),
    ]


CASES = cases()
BROKEN_FROM = 6            # the cases before it are plans verl accepts


@pytest.fixture(scope="module")
def verl_says(verl_python, verl_root, tmp_path_factory):  # noqa: F811
    items = [{"label": c["label"], "n_gpus": c["n_gpus"], "train_rows": TRAIN_ROWS, "val_rows": VAL_ROWS,
              "model_config": c["model_config"],
              "overrides": [Override(k, v, "").text() for k, v in c["overrides"].items()]} for c in CASES]
    return run_plan_check(verl_python, verl_root, items, tmp_path_factory.mktemp("rules"))


@pytest.mark.parametrize("c", CASES, ids=[c["label"] for c in CASES])
def test_the_rules_refuse_what_verl_refuses_in_verls_words(verl_says, c):
    verl = verl_says[c["label"]]
    ours = verl_rules.violations(c["overrides"], c["model_config"], TRAIN_ROWS, VAL_ROWS)
    first = verl.get("first_error")
    broken = CASES.index(c) >= BROKEN_FROM
    assert (first is not None) is broken, verl           # the judge is shown to refuse, and to accept
    if first is None:
        assert ours == [], ours
        if c["overrides"]["actor_rollout_ref.rollout.name"] == "vllm":
            assert verl["workers"]["rollout"] == {"reached": "vllm.LLM"}, verl   # vLLM's checks ran and passed
        return
    assert ours, f"verl refused, the rules did not: {first}"
    expected = first["message"] or first["line"]
    assert ours[0].message == expected, (ours[0], first)
    assert first["where"].startswith(ours[0].where.split(" ")[0]), (ours[0].where, first["where"])


def test_train_3_mini_2_is_what_verl_runs():
    """The workload {train_batch_size: 3, ppo_mini_batch_size: 2}: verl's checks pass (above, on verl's
    code); what it does with it, its real update on CPU: tests/unit/test_verl_uneven_mini_batch.py."""
    overrides, config = planned(P40, train_batch_size=3, ppo_mini_batch_size=2)
    assert verl_rules.violations(overrides, config, TRAIN_ROWS, VAL_ROWS) == []
    assert (overrides["data.train_batch_size"], overrides["actor_rollout_ref.actor.ppo_mini_batch_size"]) == (3, 2)


def test_verl_defaults_are_verls(base_config):
    """Every default the rules assume is verl 0.5.0's composed config's (resolved)."""
    from omegaconf import OmegaConf

    resolved = OmegaConf.create(OmegaConf.to_container(base_config, resolve=True))
    for key in verl_rules.VERL_DEFAULTS:
        got = OmegaConf.select(resolved, key, default="<missing>")
        if key in ("data.gen_batch_size", "actor_rollout_ref.rollout.micro_batch_size"):
            assert got == "<missing>", key          # read with .get(key, default) in verl
            continue
        want = verl_rules.Config({})(key)
        assert got == want, f"{key}: verl {got!r}, the rules {want!r}"


def test_every_rule_is_exercised():
    """Each rule refuses at least one config here (a rule that can never fire is no check)."""
    fired = {v.rule for c in CASES for v in verl_rules.violations(c["overrides"], c["model_config"], TRAIN_ROWS,
                                                                   VAL_ROWS)}
    assert fired == {r.id for r in verl_rules.RULES}, {r.id for r in verl_rules.RULES} - fired


@pytest.mark.parametrize("work,key,words,fix", [
    ({"train_batch_size": 10000, "algorithm": "ppo"}, "workload.train_batch_size",
     '(verl/trainer/ppo/ray_trainer.py _create_dataloader): "Train dataloader is empty!"',
     "at most the train split's 7473 prompts"),
    ({"model": "microsoft/Phi-3-mini-4k-instruct", "max_prompt_length": 256, "max_response_length": 4000},
     "workload.max_response_length", 'vLLMRollout.__init__): "model context length should be greater than total '
     'sequence length"', "max_position_embeddings of its config.json"),
])
def test_every_plan_is_refused_where_verl_would_refuse_it(work, key, words, fix):
    """make_plan asks the rules of every plan it makes: the validation before any host changes, the
    training stage and python -m tasks.plan refuse what verl would, in verl's words."""
    from tasks.plan import PlanError
    from tasks.settings import load_settings
    from tasks.validation import training_plan

    with pytest.raises(PlanError) as err:
        training_plan(load_settings("b", {"workload": work}), T4)
    assert err.value.key == key and words in err.value.reason and fix in err.value.fix, err.value
    assert err.value.reason.startswith("verl 0.5.0 would refuse this run (")
