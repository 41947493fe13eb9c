"""The burn-in's reward: a verl 0.5.0 reward manager that scores each response by the share of its tokens that
belong to one class of the vocabulary (docs/burnin.md, "The task").

Placed by the burn-in stage (tasks/burnin/stage.py) as ``<train_dir>/burnin-probe/verl_lab_burnin_reward.py``
beside the burn-in's ``sitecustomize.py`` (verl_lab_box/burnin_probe.py), which registers ``BurninReward`` under
``MANAGER`` in verl's reward-manager registry when verl imports it (verl's own extension point:
``verl.workers.reward_manager.register``); the burn-in selects it with ``reward_model.reward_manager=MANAGER``
and passes ``+reward_model.reward_kwargs.*`` (verl hands them to the manager's constructor).

The class is a property of the model's own input embedding as the model folder holds it: token ``v`` is in the
class when coordinate ``coordinate`` of its embedding row is above that coordinate's median over the vocabulary
(so about half the vocabulary). Why that class: a model raises the class's share by moving its final hidden state
along one axis of the hidden space, which every linear layer can do (LoRA's adapters included, with the embedding
frozen); a class drawn at random from the vocabulary has no such direction in a model with random weights, and
its share then rises only token by token (docs/burnin.md, "The task").

What a sequence is judged by is its **share** of class tokens, in [0, 1]. What verl is handed (placed on the last
response token, as verl's own managers place theirs) is that share standardised, the class count's z-score under a
fair coin: ``(hits - n/2) / (sqrt(n)/2)`` over its ``n`` valid tokens, i.e. ``2 sqrt(n) (share - 1/2)``. GRPO's
group-normalised advantage is the same either way; PPO's is ``reward - value`` whitened, and a critic with a random
value head predicts values that scatter by about 0.5 from token to token, while the share of 256 tokens scatters
by 0.03 from sequence to sequence: with the share as the reward the advantage would be nearly all the critic's
noise. The z-score scatters by about 1 (docs/burnin.md, "The task").

Each call appends one JSON line to ``records/reward-<pid>.jsonl``: the batch's mean share, the number of
sequences, the mean z-score, and the mean share of each prompt's group (verl's ``uid``), from which the burn-in's
test of "rises" takes its standard error (verl_lab_box/burnin_judge.py judges the shares, not verl's
``critic/score/mean``, which is the z-score). Standard library at import; torch and safetensors inside.
"""

from __future__ import annotations

import json
import os
import time

MANAGER = "verl_lab_burnin"           # the name the burn-in's sitecustomize registers it under
EMBEDDING_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight")


def embedding_column(model_path: str, coordinate: int):
    """One coordinate of every row of the model folder's input embedding (a float32 torch tensor, one value per
    token id), read from its safetensors files (a sharded folder: the shard its index names)."""
    from safetensors import safe_open

    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh).get("weight_map", {})
        files = [weight_map[k] for k in EMBEDDING_KEYS if k in weight_map][:1]
    else:
        files = sorted(n for n in os.listdir(model_path) if n.endswith(".safetensors"))
    for name in files:
        with safe_open(os.path.join(model_path, name), framework="pt") as fh:
            for key in EMBEDDING_KEYS:
                if key in fh.keys():
                    return fh.get_slice(key)[:, coordinate].float().flatten()
    raise ValueError(f"no input embedding ({' or '.join(EMBEDDING_KEYS)}) in the safetensors files of {model_path}")


def token_class(column):
    """The class: ids whose value is above the median of ``column`` (a bool tensor of the vocabulary's size)."""
    return column > column.median()


def shares(responses, response_mask, in_class):
    """Per sequence, the share of its valid response tokens that are in the class (ids beyond the table are
    not); a sequence without a valid token scores 0."""
    ids = responses.clamp(0, in_class.numel() - 1)
    hit = in_class.to(responses.device)[ids] & (responses < in_class.numel()) & response_mask
    count = response_mask.sum(-1)
    return hit.sum(-1).float() / count.clamp(min=1).float(), count


def standardised(share, count):
    """The class count's z-score under a fair coin, ``2 sqrt(n) (share - 1/2)`` (0 for a sequence without a valid
    token): what verl is handed as the sequence's score."""
    return 2.0 * count.float().sqrt() * (share - 0.5)


def group_means(values, uids) -> list[float]:
    """The mean score of each prompt's group of samples (verl's ``uid``), in first-seen order."""
    groups: dict = {}
    for v, u in zip(values, uids):
        groups.setdefault(u, []).append(float(v))
    return [sum(g) / len(g) for g in groups.values()]


class BurninReward:
    """verl's reward-manager interface (``__init__(tokenizer, num_examine, compute_score, reward_fn_key, **kwargs)``,
    ``__call__(data, return_dict)``): a sequence is judged by the share of its response tokens in the class, and
    verl is handed that share standardised (``standardised``)."""

    def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source", model_path=None,
                 records=None, coordinate=0, **_unused):
        if not model_path:
            raise ValueError("the burn-in reward needs +reward_model.reward_kwargs.model_path (the model folder)")
        self.tokenizer, self.num_examine = tokenizer, num_examine
        self.in_class = token_class(embedding_column(str(model_path), int(coordinate)))
        self.records, self.coordinate = records, int(coordinate)
        self.calls = 0

    def __call__(self, data, return_dict=False):
        import torch

        if "rm_scores" in data.batch.keys():            # a reward model's scores, as verl's managers honour them
            return {"reward_tensor": data.batch["rm_scores"]} if return_dict else data.batch["rm_scores"]
        responses = data.batch["responses"]
        width = data.batch["prompts"].shape[-1]
        mask = data.batch["attention_mask"][:, width:].bool()
        share, count = shares(responses, mask, self.in_class)
        z = standardised(share, count)
        reward = torch.zeros_like(responses, dtype=torch.float32)
        last = (count - 1).clamp(min=0)
        reward[torch.arange(len(responses)), last] = z.to(reward.dtype)
        self.calls += 1
        uids = list(data.non_tensor_batch.get("uid", range(len(responses))))
        self._record({"event": "reward", "call": self.calls, "sequences": len(responses),
                      "mean": float(share.mean()), "z_mean": float(z.mean()), "tokens": int(count.sum()),
                      "group_means": group_means(share.tolist(), uids)})
        if return_dict:
            return {"reward_tensor": reward, "reward_extra_info": {"burnin_share": share.tolist()}}
        return reward

    def _record(self, line: dict) -> None:
        if not self.records:
            return
        os.makedirs(self.records, exist_ok=True)
        with open(os.path.join(self.records, f"reward-{os.getpid()}.jsonl"), "a") as fh:
            fh.write(json.dumps({"t": round(time.time(), 3), **line}) + "\n")
