"""What a box's burn-in runs, and what it is measured against (pure): ``burnin-plan.json`` beside plan.json.

The burn-in is the box's own plan (rung, precision, micro-batches, offloads, rollout engine, LoRA, the cluster: every
override of plan.json) with these changes, each with its reason in the file (docs/burnin.md says why each holds):

* its own folder (``trainer.default_local_dir``), no tracker (``trainer.logger=['console']``), no validation, one save
  kept: the real run's checkpoints and tracker runs are never touched;
* two verl runs: steps 1..``first_steps`` ending in a save, then a run that resumes it (``trainer.resume_mode=auto``)
  and trains to ``total_steps``, saving again (the export is made from that save);
* the reward: the burn-in's reward manager (verl_lab_box/burnin_reward.py: the share of response tokens whose input
  embedding's coordinate ``REWARD_COORDINATE`` is above its median, handed to verl as its z-score so that a random
  critic's values do not drown it), which a model with random weights climbs too;
* its own learning rate (``burnin_lr``), larger than the run's: the run's (verl's 1e-6 for full fine-tuning) moves
  the policy too little in four steps for any test to see;
* optionally fewer prompts a step (``BurninSpec.prompts``; the micro-batches and the HF chunk stay the plan's, so
  each phase runs at its planned shapes as long as a step holds a whole chunk).

The measures: the plan's memory per phase (plan.json's breakdown) and the card's memory; the speed model's seconds
(tasks/speed.py, H200 seconds) of a burn-in step and of the configured run's step, whose ratio turns the measured
seconds into the configured run's ETA; ``expected_step_s``, what earlier burn-ins of this card measured (the
controller's history, tasks/burnin/hearing.py), against which "too slow" is judged.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

from tasks.plan import TrainingPlan

BURNIN_PLAN = "burnin-plan.json"       # beside plan.json (root's), read by the launcher's burn-in
RECORD = "burnin.json"                 # in the burn-in's folder (the train user's), written by it
BURNIN_UNIT = "verl-lab-burnin.service"
MANAGER = "verl_lab_burnin"            # verl_lab_box/burnin_reward.py MANAGER
REWARD_COORDINATE = 0
# The burn-in's learning rate (docs/burnin.md "The learning rate"): Adam moves each weight by about the rate a step
# whatever its gradient's size, and the reward rises as the last hidden state moves along one axis, a sum over the
# hidden width of such moves: the rate that moves it as far in a few steps is inversely proportional to the width
# (``BURNIN_LR_WIDTH / hidden_size``: 3e-4 for the 0.5B's 896). verl's 1e-6 (the run's, full fine-tuning) moves the
# policy 300 times less far. LoRA trains the adapters alone, which start at zero: ten times a full fine-tune's, as
# the LoRA rungs' own rate is ten times verl's (tasks/plan/lora.py, "LoRA Without Regret").
BURNIN_LR_WIDTH = {"full": 0.2688, "lora": 2.688}
# The test of "rises" (verl_lab_box/burnin_judge.py reward_test): the last ``last`` steps' mean score minus the
# first step's, at least ``z`` standard errors (one-sided normal tail 3.2e-5 at 4) and at least ``floor``.
RISES = {"z": 4.0, "floor": 0.01, "last": 2}


@dataclass(frozen=True)
class BurninSpec:
    first_steps: int = 2             # the first verl run's steps; it ends in a save
    total_steps: int = 5             # the resumed run trains on to this step, and saves
    prompts: int | None = None       # prompts a step (None: the plan's data.train_batch_size)

    def __post_init__(self):
        if not 1 <= self.first_steps < self.total_steps:
            raise ValueError(f"a burn-in needs 1 <= first_steps < total_steps, not {self.first_steps}, "
                             f"{self.total_steps}")
        if self.total_steps < self.first_steps + RISES["last"] - 1 or self.total_steps < RISES["last"] + 1:
            raise ValueError(f"the test of rises compares step 1 with the last {RISES['last']} steps: total_steps "
                             f"{self.total_steps} is too few")


def burnin_paths(train_dir: str) -> dict[str, str]:
    """The burn-in's places on a box: its folder (the train user's), the probe's folder (root's, on the runs'
    PYTHONPATH), its plan beside plan.json, its record in its folder."""
    return {"folder": f"{train_dir}/burnin", "probe": f"{train_dir}/burnin-probe",
            "plan": f"{train_dir}/{BURNIN_PLAN}", "record": f"{train_dir}/burnin/{RECORD}"}


def burnin_lr(plan: TrainingPlan) -> float:
    """The burn-in's learning rate for the plan's model (``BURNIN_LR_WIDTH`` over its hidden width), 3 digits."""
    kind = "lora" if plan.workload.lora else "full"
    width = int((plan.workload.model_config or {}).get("hidden_size") or 896)
    return float(f"{BURNIN_LR_WIDTH[kind] / width:.3g}")


def _value(plan: TrainingPlan, key: str):
    return next((o.value for o in plan.overrides if o.key.lstrip("+") == key), None)


def _batch(plan: TrainingPlan, spec: BurninSpec) -> tuple[int, int]:
    """The burn-in's prompts a step and mini-batch (the plan's, or ``spec.prompts`` with the plan's mini-batches
    per step kept where they divide it)."""
    w = plan.workload
    if spec.prompts is None or spec.prompts == w.train_batch_size:
        return w.train_batch_size, w.ppo_mini_batch_size
    minis = max(1, w.train_batch_size // w.ppo_mini_batch_size)
    while minis > 1 and spec.prompts % minis:
        minis -= 1
    return spec.prompts, spec.prompts // minis


def overrides(plan: TrainingPlan, train_dir: str, host: str, spec: BurninSpec) -> list[dict]:
    """The overrides every burn-in run adds to the plan's (a key the plan sets is replaced), each with its reason."""
    paths = burnin_paths(train_dir)
    kind = "lora" if plan.workload.lora else "full"
    prompts, mini = _batch(plan, spec)
    out = [
        ("trainer.default_local_dir", f"{paths['folder']}/checkpoints",
         "the burn-in's own folder: the run's checkpoints are never touched"),
        ("trainer.logger", "['console']", "no tracker: the run's tracker runs are never touched (the probe keeps "
                                          "the metrics)"),
        ("trainer.project_name", "verl-lab-burnin", "not the run's project"),
        ("trainer.experiment_name", f"burnin-{host}", "not the run's experiment"),
        ("trainer.test_freq", "-1", "no validation: GSM8K's score is not the burn-in's"),
        ("trainer.val_before_train", "False", "no validation"),
        ("trainer.max_actor_ckpt_to_keep", "1", "one save on the disk at a time"),
        ("trainer.max_critic_ckpt_to_keep", "1", "one save on the disk at a time"),
        ("reward_model.reward_manager", MANAGER, "the burn-in's reward: the share of one class of tokens, which any "
                                                 "model climbs (verl_lab_box/burnin_reward.py)"),
        ("+reward_model.reward_kwargs.model_path", _value(plan, "actor_rollout_ref.model.path"),
         "the class is read from this model's input embedding"),
        ("+reward_model.reward_kwargs.records", f"{paths['folder']}/records", "each step's scores per prompt"),
        ("+reward_model.reward_kwargs.coordinate", str(REWARD_COORDINATE), "the embedding coordinate of the class"),
        ("actor_rollout_ref.actor.optim.lr", str(burnin_lr(plan)),
         f"the burn-in's learning rate for {'LoRA adapters' if kind == 'lora' else 'full fine-tuning'} "
         f"(the run's: {_value(plan, 'actor_rollout_ref.actor.optim.lr') or '1e-06, verl default'}): four steps "
         "must move the reward"),
    ]
    if prompts != plan.workload.train_batch_size:
        out += [("data.train_batch_size", str(prompts), f"the burn-in's prompts a step (the run's: "
                                                        f"{plan.workload.train_batch_size}); micro-batches as planned"),
                ("actor_rollout_ref.actor.ppo_mini_batch_size", str(mini), "as many updates a step as the run makes")]
        if plan.workload.uses_critic:
            out.append(("critic.ppo_mini_batch_size", str(mini), "as the actor's"))
    return [{"override": f"{k}={v}", "why": why} for k, v, why in out]


def runs(spec: BurninSpec) -> list[dict]:
    """The two verl runs: each saves at its last step alone (verl saves at the last step and every save_freq)."""
    return [{"name": "first", "first_step": 1, "last_step": spec.first_steps,
             "overrides": [f"trainer.total_training_steps={spec.first_steps}", "trainer.resume_mode=disable",
                           f"trainer.save_freq={spec.first_steps}"]},
            {"name": "resumed", "first_step": spec.first_steps + 1, "last_step": spec.total_steps,
             "overrides": [f"trainer.total_training_steps={spec.total_steps}", "trainer.resume_mode=auto",
                           f"trainer.save_freq={spec.total_steps}"]}]


def speed_model(plan: TrainingPlan, spec: BurninSpec) -> dict:
    """The speed model's seconds per phase of a burn-in step and of the configured run's (tasks/speed.py)."""
    from tasks.plan.lora import gpu_seconds
    from tasks.plan.memory_fit import offload_seconds

    w = plan.workload
    prompts, mini = _batch(plan, spec)
    seconds = offload_seconds if w.actor_offload_policy else gpu_seconds
    mine = replace(w, train_batch_size=prompts, ppo_mini_batch_size=mini)
    return {"burnin": seconds(plan.gpu, mine, plan.precision, plan.memory),
            "configured": seconds(plan.gpu, w, plan.precision, plan.memory),
            "rollout_counted": plan.precision.rollout == "hf",
            "note": "H200 seconds (tasks/speed.py): their ratio to the measured turns the configured run's into its ETA"}


def burnin_plan(plan: TrainingPlan, train_dir: str, host: str, spec: BurninSpec = BurninSpec(),
                expected_step_s: float | None = None) -> dict:
    """``burnin-plan.json``: what verl_lab_box/burnin.py runs and judges on this box."""
    paths = burnin_paths(train_dir)
    d = plan.to_dict()
    breakdown = d["breakdown"]
    prompts, _ = _batch(plan, spec)
    kind = "lora" if plan.workload.lora else "full"
    return {
        "format": 1, "folder": paths["folder"], "probe": paths["probe"], "train_unit": "verl-lab-train.service",
        "steps": spec.total_steps, "saved_step": spec.first_steps, "prompts": prompts, "runs": runs(spec),
        "critic": plan.workload.uses_critic,
        "overrides": [o["override"] for o in overrides(plan, train_dir, host, spec)],
        "override_reasons": overrides(plan, train_dir, host, spec),
        "lr": {"burnin": burnin_lr(plan), "kind": kind,
               "run": float(_value(plan, "actor_rollout_ref.actor.optim.lr") or 1e-6)},
        "reward": {"manager": MANAGER, "coordinate": REWARD_COORDINATE},
        "rises": dict(RISES),
        "predicted": {"phases_mib": {k: v for k, v in breakdown.items() if k.startswith("phase_")},
                      "peak_mib": d["predicted_peak_mib"], "budget_mib": d["budget_mib"],
                      "cap_mib": plan.gpu.memory_mib, "context_mib": breakdown.get("cuda_context")},
        "speed_model": speed_model(plan, spec),
        "expected_step_s": expected_step_s,
        "plan_summary": {"rung": plan.rung, "train_dtype": d["train_dtype"], "rollout": d["rollout"],
                         "lora": d["lora"], "gpu": d["gpu"], "micro_batches": d["micro_batches"],
                         "offload": d["offload"], "predicted_peak_mib": d["predicted_peak_mib"],
                         "budget_mib": d["budget_mib"],
                         "breakdown": {k: v for k, v in breakdown.items() if k.endswith("_states")},
                         "overrides_sha256": hashlib.sha256(json.dumps(d["overrides"]).encode()).hexdigest()},
    }
