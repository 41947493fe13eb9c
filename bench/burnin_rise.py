"""Study: does the burn-in's reward rise on the 0.5B's shape? (plain torch, CPU; not verl)

A Qwen2 with Qwen2.5-0.5B's config (vocab 151936, hidden 896, tied embeddings) cut to --layers layers, random
weights as bench/gpu/make_model.py makes them (seeded, initialised in bf16), trained by a PPO step as verl 0.5.0
computes it: rollouts sampled at temperature 1, old log-probs, GRPO's group-normalised advantages or GAE (gamma 1,
lambda 1) with a critic (its value head, verl's clipped value loss, lr 1e-5), the clipped policy loss with dual clip
(token-mean), mini-batches with micro-batch accumulation, grad-norm clip 1.0, AdamW (0.9, 0.999, wd 0.01).

The prompts are random ids with a head (``--head``, 30) and tail (``--tail``, 5) every prompt shares, as a chat
template's system turn and assistant opening are shared by every GSM8K prompt. ``--score`` is what the advantage is
computed from: the share's z-score (what the burn-in hands verl, verl_lab_box/burnin_reward.py) or the share.

Per step it prints the sampled share (the burn-in's score), its standard error (over the prompts' group means), the
policy's class probability at the step's sampled contexts (``expected``, averaged over the response positions), its
paired change after the step's updates over the same contexts (``moved``: no sampling noise), verl's ppo_kl and
pg_clipfrac, the entropy; at the end the burn-in's comparison (step 1 against the mean of the last two steps).
docs/burnin.md ("On the 0.5B's shape") has the runs and what they show.

    P=$(.venv/bin/python -c 'from tests.fixtures.standins import env; print(env.test_env())')
    OMP_NUM_THREADS=1 $P bench/burnin_rise.py --layers 2 --algo grpo --prompts 16 --n 4 --response 32 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "files" / "models" / "qwen2.5-0.5b-instruct" / "config.json"


def config(layers: int, hidden: int | None = None, vocab: int | None = None, **extra) -> dict:
    """Qwen2.5-0.5B's config cut to ``layers`` (another width or vocabulary only for side studies)."""
    cfg = json.loads(CONFIG.read_text())
    cfg.update(num_hidden_layers=layers, **extra)
    cfg.update({k: v for k, v in (("hidden_size", hidden), ("vocab_size", vocab)) if v})
    return cfg


def initialised(model_class, cfg: dict, seed: int):
    """``model_class`` with random weights initialised in bf16 (as bench/gpu/make_model.py makes the GPU's), in fp32."""
    from transformers import Qwen2Config

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = model_class(Qwen2Config.from_dict(cfg))
    finally:
        torch.set_default_dtype(default)
    return model.float()


def make_model(layers: int, seed: int, hidden: int | None = None, vocab: int | None = None):
    from transformers import Qwen2ForCausalLM

    return initialised(Qwen2ForCausalLM, config(layers, hidden, vocab), seed)


def make_critic(layers: int, seed: int, hidden: int | None = None, vocab: int | None = None):
    """verl's critic: the model with a one-output token-classification head (its value head), its own weights."""
    from transformers import Qwen2ForTokenClassification

    return initialised(Qwen2ForTokenClassification, config(layers, hidden, vocab, num_labels=1), seed + 1000)


def class_of(model, coordinate: int = 0):
    """The burn-in's class (verl_lab_box/burnin_reward.py): ids whose input-embedding coordinate is above its median."""
    col = model.get_input_embeddings().weight.detach().float()[:, coordinate]
    return col > col.median()


@torch.no_grad()
def rollout(model, prompts, length: int, in_class, temperature: float = 1.0):
    """Sample ``length`` tokens a prompt; returns the responses, their log-probs, the class mass at each position,
    the entropy at each position."""
    from transformers import DynamicCache

    b, p = prompts.shape
    cache = DynamicCache()
    out = model(input_ids=prompts, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tokens, logps, mass, ent = [], [], [], []
    cls = in_class.float()
    for t in range(length):
        logits = out.logits[:, -1].float() / temperature
        lp = torch.log_softmax(logits, -1)
        prob = lp.exp()
        tok = torch.multinomial(prob, 1).squeeze(-1)
        tokens.append(tok)
        logps.append(lp.gather(-1, tok[:, None]).squeeze(-1))
        mass.append(prob @ cls)
        ent.append(-(prob * lp).sum(-1))
        if t + 1 < length:
            out = model(input_ids=tok[:, None], past_key_values=cache, use_cache=True,
                        position_ids=torch.full((b, 1), p + t, dtype=torch.long))
    return (torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(mass, 1), torch.stack(ent, 1))


def response_logprobs(model, seq, prompt_len: int, length: int):
    hidden = model.model(input_ids=seq).last_hidden_state[:, prompt_len - 1: prompt_len - 1 + length]
    logits = model.lm_head(hidden).float()
    lp = torch.log_softmax(logits, -1)
    return lp.gather(-1, seq[:, prompt_len:prompt_len + length, None]).squeeze(-1)


@torch.no_grad()
def class_mass(model, seq, prompt_len: int, length: int, in_class, chunk: int = 16):
    """The policy's probability of the class at each response position of ``seq`` (its contexts fixed), averaged."""
    cls, total = in_class.float(), 0.0
    for part in seq.split(chunk):
        hidden = model.model(input_ids=part).last_hidden_state[:, prompt_len - 1: prompt_len - 1 + length]
        total += float((torch.softmax(model.lm_head(hidden).float(), -1) @ cls).sum())
    return total / (seq.shape[0] * length)


def grpo_advantages(scores, n: int, eps: float = 1e-6):
    g = scores.view(-1, n)
    mean, std = g.mean(-1, keepdim=True), g.std(-1, keepdim=True)
    return ((g - mean) / (std + eps)).view(-1)


def whiten(x):
    mean, var = x.mean(), x.var()
    return (x - mean) * torch.rsqrt(var + 1e-8)


def policy_loss(logp, old, adv, clip=0.2, dual=3.0):
    ratio = torch.exp(logp - old)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - clip, 1 + clip)
    clipped = torch.maximum(l1, l2)
    l3 = torch.minimum(-adv * dual, clipped)
    loss = torch.where(adv < 0, l3, clipped)
    kl = (old - logp).mean()
    clipfrac = (l2 > l1).float().mean()
    return loss.mean(), kl.detach(), clipfrac.detach()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--head", type=int, default=30, help="prompt ids shared by every prompt at its start (a chat "
                    "template's system turn)")
    ap.add_argument("--tail", type=int, default=5, help="... and at its end (the assistant's opening)")
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--minis", type=int, default=4, help="updates a step")
    ap.add_argument("--micro", type=int, default=4, help="sequences a micro-batch")
    ap.add_argument("--algo", choices=["grpo", "ppo"], default="grpo")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--critic-lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-seed", type=int, default=1)
    ap.add_argument("--score", choices=["z", "share"], default="z", help="what verl is handed: the share's z-score "
                    "(the product's) or the share")
    ap.add_argument("--sign", type=float, default=1.0, help="-1: the advantage's sign flipped")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    model = make_model(a.layers, a.seed, a.hidden, a.vocab)
    in_class = class_of(model)
    vocab = model.config.vocab_size
    if a.lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(a.seed + 7)
        model = get_peft_model(model, LoraConfig(r=a.lora, lora_alpha=a.lora, target_modules="all-linear",
                                                 bias="none"))
        base = model.get_base_model()
    else:
        base = model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), weight_decay=0.01)
    critic = copt = None
    if a.algo == "ppo":
        critic = make_critic(a.layers, a.seed, a.hidden, a.vocab)
        copt = torch.optim.AdamW(critic.parameters(), lr=a.critic_lr, betas=(0.9, 0.999), weight_decay=0.01)

    gen = torch.Generator().manual_seed(a.data_seed)
    # GSM8K's prompts in the chat template: a fixed head and tail around each question (random ids here)
    head = torch.randint(3, vocab, (1, a.head), generator=gen)
    tail = torch.randint(3, vocab, (1, a.tail), generator=gen)
    rows = []
    n = a.n if a.algo == "grpo" else 1
    batch = a.prompts * n
    print(json.dumps(vars(a)), flush=True)
    for step in range(1, a.steps + 1):
        t0 = time.time()
        question = torch.randint(3, vocab, (a.prompts, a.prompt_len - a.head - a.tail), generator=gen)
        prompts = torch.cat([head.expand(a.prompts, -1), question, tail.expand(a.prompts, -1)], 1)
        prompts = prompts.repeat_interleave(n, 0)
        torch.manual_seed(1000 * a.seed + step)
        base.eval()
        resp, old, mass, ent = rollout(model, prompts, a.response, in_class)
        t_roll = time.time() - t0
        hit = in_class[resp].float()
        scores = hit.mean(-1)
        groups = scores.view(a.prompts, n).mean(-1)
        se = float(groups.std() / math.sqrt(a.prompts))
        seq = torch.cat([prompts, resp], 1)
        given = 2 * math.sqrt(a.response) * (scores - 0.5) if a.score == "z" else scores
        if a.algo == "grpo":
            adv = grpo_advantages(given, n)[:, None].expand(-1, a.response).contiguous()
        else:
            with torch.no_grad():
                values = critic(input_ids=seq).logits[:, a.prompt_len - 1: a.prompt_len - 1 + a.response, 0].float()
            adv = whiten(given[:, None] - values)
            returns = given[:, None].expand(-1, a.response)
        adv = adv * a.sign
        if critic is not None:      # verl updates the critic before the actor
            critic.train()
            for mb in torch.arange(batch).split(batch // a.minis):
                copt.zero_grad()
                for mi in mb.split(a.micro):
                    v = critic(input_ids=seq[mi]).logits[:, a.prompt_len - 1: a.prompt_len - 1 + a.response, 0]
                    vc = values[mi] + (v - values[mi]).clamp(-0.5, 0.5)
                    vf = 0.5 * torch.maximum((v - returns[mi]) ** 2, (vc - returns[mi]) ** 2).mean()
                    (vf * len(mi) / len(mb)).backward()
                torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
                copt.step()
        base.train()
        kls, clips, norms = [], [], []
        for mb in torch.arange(batch).split(batch // a.minis):
            opt.zero_grad()
            for mi in mb.split(a.micro):
                logp = response_logprobs(base, seq[mi], a.prompt_len, a.response)    # LoRA's layers are in base's
                loss, kl, cf = policy_loss(logp, old[mi], adv[mi])
                (loss * len(mi) / len(mb)).backward()
                kls.append(float(kl))
                clips.append(float(cf))
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
            opt.step()
        base.eval()
        moved = class_mass(base, seq, a.prompt_len, a.response, in_class) - float(mass.mean())
        row = {"step": step, "score": round(float(scores.mean()), 5), "se": round(se, 5),
               "expected": round(float(mass.mean()), 5), "moved": round(moved, 5),
               "entropy": round(float(ent.mean()), 4),
               "ppo_kl": round(sum(kls) / len(kls), 4), "clipfrac": round(sum(clips) / len(clips), 4),
               "grad_norm": round(sum(norms) / len(norms), 4), "s_rollout": round(t_roll, 1),
               "s": round(time.time() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = rise(rows)
    print(json.dumps(summary), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "steps": rows, "summary": summary}))
    return rows


def rise(rows: list[dict], last: int = 2) -> dict:
    """The burn-in's comparison (step 1 against the mean of the last ``last`` steps) on the class mass (``expected``:
    the policy's, no sampling noise) and on the sampled score, with the sampled score's standard error as the
    product's judge combines it (verl_lab_box/burnin_judge.py)."""
    if len(rows) <= last:
        return {"summary": "too few steps"}
    first, tail = rows[0], rows[-last:]
    se = math.sqrt(first["se"] ** 2 + sum(r["se"] ** 2 for r in tail) / last ** 2)
    return {"summary": f"step 1 -> mean of steps {tail[0]['step']}-{tail[-1]['step']}",
            "expected_rise": round(sum(r["expected"] for r in tail) / last - first["expected"], 5),
            "score_rise": round(sum(r["score"] for r in tail) / last - first["score"], 5),
            "score_se": round(se, 5), "moved_per_step": [r.get("moved") for r in rows]}


if __name__ == "__main__":
    main()
