"""The GPU harness's profiles: real verl 0.5.0 PPO runs of the product's own launcher on the
device's H200, each under a memory cap that stands for a smaller card.

Runs here (it needs the project's planning code and pyinfra's jinja2; the device machine has
neither). ``render`` writes, for each profile, what deploy/train.py would put in a box's
``<lab_root>/train`` (launcher, plan.json, train.env, the GPU reader) with the profile's lab_root
``/tmp/vl/<name>``, plus ``profile.json`` (cap, verl tree, extra overrides, what it stands for)
into ``.gpu/profiles/<name>/``. bench/gpu/run_profile.py runs one on the device.

    .venv/bin/python bench/gpu/ppo_profiles.py render [--only p40,t4] [--today-ref REF]
    .venv/bin/python bench/gpu/ppo_profiles.py list

Profiles whose plan says vLLM (which cannot run on the device: vLLM 0.8.5 needs torch 2.6 and
its wheel is far over a call's carry limit) are planned and run with the HF rollout for that
run only (``rollout_engine='hf'``); their record says so. The current code's launcher is the
static verl_lab_box/train_launcher.py reading the profile's plan.json; ``today`` profiles take
the launcher (rendered from that tree's template) with the project's code and verl patches as
of ``--today-ref`` (a git worktree), ``speed-before`` profiles as of ``SPEED_BEFORE_REF``, for a
before/after comparison in one session (the payload's verl tree of that name holds the patches as
of the same ref). ``seed`` runs the hand recipe the project replaces.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT_DEFAULT = REPO / ".gpu" / "profiles"
LAB_BASE = "/tmp/vl"             # a profile's lab_root is <LAB_BASE>/<name> on the device
RAY_PORT = 6379                  # a Ray-node profile's cluster port (the setting's default)
# the Ray nodes of a profile with nodes > 1, all on the device's one host: the head and then each worker on its
# own loopback address. Not 127.0.0.1: `ray start --node-ip-address=127.0.0.1` is replaced by the host's own
# address (ray 2.46 ray/_private/services.py resolve_ip_for_localhost), so the head would not be on lo.
NODE_ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
TODAY_REF = "7d6e4b8"            # main before the training-path fixes (issue 14)
SPEED_BEFORE_REF = "aa9f1e3"
PROOF_BEFORE_REF = "50d4e45"     # main before the fast proof (issue 34): its export.py proves on the CPU
TENSORBOARD_LOGGER = "trainer.logger=['console','tensorboard']"   # verl 0.5.0's own tracker (verl/utils/tracking.py)     # main before the 8-12 GB cards' speed work (issue 29): code "speed-before"
OUTSIDE_TORCH_MIB = 1311         # CUDA context etc. per process on the H200 (docs/training-runs.md)
STEPS = 5
# Every run: no checkpoint (12 GB of fp32 states, ~18 s, not what is measured) and validation
# after the last step (verl validates at the last step when test_freq > 0).
RUN_OVERRIDES = ["trainer.save_freq=-1"]
# An export profile's run: a save at every step (with the plan's retention), and when verl finishes,
# the launcher's export, its proof and the GSM8K scores (verl_lab_box/after_run.py after_run).
EXPORT_RUN_OVERRIDES = ["trainer.save_freq=1"]


@dataclass(frozen=True)
class Profile:
    name: str
    gpu_name: str
    compute_capability: str
    memory_mib: int
    capped: bool = True                  # cap the allocator at memory_mib - OUTSIDE_TORCH_MIB
    code: str = "current"                # "current" | "today" | "speed-before": which planning code and patches
    rollout_engine: str = "auto"         # "hf" where the plan would use vLLM
    steps: int = STEPS
    validate: bool = True
    stands_for: str = ""
    seed_recipe: bool = False
    plan_memory_mib: int | None = None   # plan for this much memory (else memory_mib), then ...
    overrides: tuple[str, ...] = ()      # ... run it with these Hydra overrides after the plan's
    model: str | None = None             # workload.model (a catalog model); None: the default 0.5B
    rollout: str | None = None           # workload.rollout (the product's setting, through the settings)
    finetune: str | None = None          # workload.finetune: "full" keeps a small card on the full rungs, "lora"
    resume_after: int | None = None      # run to this step saving a checkpoint, then again: it resumes
    export: bool = False                 # save every step; the launcher exports and scores when verl finishes
    probe_profile: str = ""              # VERL_LAB_PROFILE: the worker calls the probe profiles (phase[:N],...)
    env: tuple[tuple[str, str], ...] = ()    # more environment for the run (the launcher passes it to Ray's workers)
    gpus: int = 1                        # GPUs of the box (of each Ray node when nodes > 1), each capped on its own
    nodes: int = 1                       # Ray nodes on the one host (tasks/cluster.py's units, bench/gpu/ray_nodes.py)
    compare_with: str = ""               # the profile whose prompts/s this one's is a ratio against (same machine)
    tensorboard: bool = False            # verl's own TensorBoard logger too (trainer.logger), its events kept
    proof_baseline: str = ""             # a git ref: after the run, its export proof timed against today's

    @property
    def cap_mib(self) -> int | None:
        return self.memory_mib - OUTSIDE_TORCH_MIB if self.capped else None


PPO_KEEP_ONE = ("trainer.max_actor_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=1")
GRPO_FSDP2 = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=64",
              "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.use_kl_loss=True",
              "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
              "actor_rollout_ref.actor.entropy_coeff=0", "algorithm.use_kl_in_reward=False",
              "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.fsdp_config.offload_policy=True")

# issue 29: the 8-12 GB cards' plans as they were before the speed work (code "speed-before": the planning code
# and verl patches of SPEED_BEFORE_REF) and as they are now, one at a time, 2 steps each (prompts/s over step 2,
# validation off); the probe profiles windows of step 1's generation and update (step 2 runs unprofiled)
SPEED_PROBE_PROFILE = "generate_sequences@6,update_actor@4"    # windows: 6 decoding steps, 4 update micro-batches
SPEED_CARDS = (("gtx1080", "NVIDIA GeForce GTX 1080", "6.1", 8192, "auto", "GTX 1080 (8 GiB)"),
               ("rtx3060", "NVIDIA GeForce RTX 3060", "8.6", 12288, "hf", "RTX 3060 (12 GiB)"),
               ("rtx2080ti", "NVIDIA GeForce RTX 2080 Ti", "7.5", 11264, "hf", "RTX 2080 Ti (11 GiB)"))
SPEED_PROFILES = [
    Profile(f"{name}-{when}", gpu, cc, mib, code="speed-before" if when == "before" else "current",
            rollout_engine=engine, steps=2, validate=False, probe_profile=SPEED_PROBE_PROFILE,
            finetune=None if when == "before" else "full",     # the code before LoRA has no such key
            stands_for=f"{label}, the plan {'before the speed work' if when == 'before' else 'as it is now'}"
                       + ("; HF rollout instead of the plan's vLLM, for this run only" if engine == "hf" else ""))
    for when in ("before", "after") for name, gpu, cc, mib, engine, label in SPEED_CARDS
]

# issue 27: several GPUs, on the device's nvidia-h200-x2 (two H200s), each GPU capped as its card (the probe caps
# every worker process on the GPU Ray gave it). Each run of 2 GPUs: 2 steps and validation (verl validates at the
# last step); prompts/s over step 2 against ``compare_with``'s, a one-GPU baseline of 2 steps without validation
# (prompts/s leaves validation out anyway) in the same call (the cluster's: the call after; bench/gpu/run_multi.sh).
# NCCL says at its start which interface and transport each connection took (NCCL_DEBUG=INFO: ppo_results reads it):
# the channels under INIT, the socket transport's interface under NET, the bootstrap's interface under INIT before
# NCCL 2.23 and under BOOTSTRAP since (src/bootstrap.cc: "Bootstrap : Using" became "Bootstrap: Using").
NCCL_INFO = (("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,NET,BOOTSTRAP"))
# two Ray nodes on one host: NCCL finds both ranks on one machine and takes its GPU-to-GPU (P2P) or shared-memory
# transport; these force its socket transport over the nodes' loopback interface (ray.env's NCCL_SOCKET_IFNAME),
# as between two machines with a NIC
NCCL_SOCKETS = (("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"))
MULTI_PROFILES = [
    Profile("p40-1gpu", "Tesla P40", "6.1", 24576, steps=2, validate=False,
            stands_for="Tesla P40 (24 GiB), one card: the plan as built now (baseline of p40-2gpu)"),
    Profile("p40-2gpu", "Tesla P40", "6.1", 24576, steps=2, gpus=2, compare_with="p40-1gpu", env=NCCL_INFO,
            stands_for="2 x Tesla P40 in one box: PPO with the critic sharded over both (FSDP1, fp32, HF rollout)"),
    Profile("gtx1080-1gpu", "NVIDIA GeForce GTX 1080", "6.1", 8192, steps=2, validate=False,
            finetune="full",
            stands_for="GTX 1080 (8 GiB), one card: grpo-cpu-offload as planned now (baseline of gtx1080-2gpu)"),
    Profile("gtx1080-2gpu", "NVIDIA GeForce GTX 1080", "6.1", 8192, steps=2, gpus=2, compare_with="gtx1080-1gpu",
            env=NCCL_INFO, finetune="full",
            stands_for="2 x GTX 1080 in one box: grpo-cpu-offload (GRPO n=4, the actor on FSDP2 "
                       "CPUOffloadPolicy over both, fp32, HF rollout)"),
    Profile("p40-2nodes", "Tesla P40", "6.1", 24576, steps=2, nodes=2, compare_with="p40-2gpu", env=NCCL_INFO,
            stands_for="two boxes of one Tesla P40 each in a Ray cluster (trainer.nnodes=2): the product's Ray units "
                       "(head 127.0.0.2 on GPU 0, worker 127.0.0.3 on GPU 1), cluster-check, the cluster plan"),
    Profile("p40-2nodes-socket", "Tesla P40", "6.1", 24576, steps=2, nodes=2, compare_with="p40-2gpu",
            env=NCCL_INFO + NCCL_SOCKETS,
            stands_for="p40-2nodes with NCCL's GPU-to-GPU and shared-memory transports off: its collectives over "
                       "sockets on lo, as between two machines"),
    # a checkpoint of a 2-GPU run (FSDP2, two ranks' shards): step 1 saved, a second run resumes from it and trains
    # step 2, saves, and the launcher exports (verl's merger over both ranks' shards), proves and scores it
    Profile("gtx1080-2gpu-export", "NVIDIA GeForce GTX 1080", "6.1", 8192, steps=2, gpus=2, validate=False,
            resume_after=1, export=True, env=NCCL_INFO,
            overrides=("data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4"),
            finetune="full",
            stands_for="2 x GTX 1080 plan (grpo-cpu-offload) on 16 prompts a step: step 1 saved, resumed by a second "
                       "run for step 2, which is saved, exported from both ranks' shards, proven and scored"),
]

PROFILES = [
    Profile("p40", "Tesla P40", "6.1", 24576, stands_for="Tesla P40 (24 GiB), the plan as built now"),
    Profile("t4", "Tesla T4", "7.5", 15360, rollout_engine="hf",
            stands_for="Tesla T4 (15 GiB); HF rollout instead of the plan's vLLM, for this run only"),
    Profile("rtx3090", "NVIDIA GeForce RTX 3090", "8.6", 24576, rollout_engine="hf",
            stands_for="RTX 3090 (24 GiB); HF rollout instead of the plan's vLLM, for this run only"),
    Profile("h200", "NVIDIA H200", "9.0", 143771, capped=False, rollout_engine="hf",
            stands_for="the H200 itself; HF rollout instead of the plan's vLLM, for this run only"),
    Profile("p40-today", "Tesla P40", "6.1", 24576, code="today", steps=2, validate=False,
            stands_for="Tesla P40, the plan and verl patches as they were before this work (throughput baseline)"),
    # probes for a rung the plan does not have yet: GRPO (no critic: verl 0.5.0's FSDP2 cannot wrap
    # the critic's Qwen2ForTokenClassification, "__class__ assignment ... object layout differs",
    # call 6) with the actor on FSDP2 with CPUOffloadPolicy (params, grads and the AdamW step on the
    # CPU; the ref is offloaded the same way by verl), on the P40 plan's fp32 + HF rollout
    Profile("grpo-11g", "NVIDIA GeForce GTX 1080 Ti", "6.1", 11264, plan_memory_mib=24576, steps=2, validate=False,
            overrides=GRPO_FSDP2 + ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
                                    "++actor_rollout_ref.rollout.micro_batch_size=128"),
            finetune="full",
            stands_for="GTX 1080 Ti / RTX 2080 Ti (11 GiB): GRPO n=4, actor on FSDP2 CPU offload, micro 2, chunk 128"),
    Profile("grpo-8g", "NVIDIA GeForce GTX 1080", "6.1", 8192, plan_memory_mib=24576, steps=2, validate=False,
            overrides=GRPO_FSDP2 + ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                                    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                                    "++actor_rollout_ref.rollout.micro_batch_size=64",
                                    "actor_rollout_ref.model.enable_gradient_checkpointing=True"),
            finetune="full",
            stands_for="GTX 1080 / RTX 4060 (8 GiB): GRPO n=4, actor on FSDP2 CPU offload, micro 1, chunk 64, "
                       "gradient checkpointing"),
    # the product's own plans on the grpo-cpu-offload rung (no overrides): what tasks/plan/ gives these cards
    Profile("gtx1080ti", "NVIDIA GeForce GTX 1080 Ti", "6.1", 11264, steps=2, validate=False,
            finetune="full",
            stands_for="GTX 1080 Ti (11 GiB), the product's plan: grpo-cpu-offload (GRPO n=4, actor on FSDP2 "
                       "CPUOffloadPolicy, fp32, HF rollout)"),
    Profile("gtx1080", "NVIDIA GeForce GTX 1080", "6.1", 8192, steps=1, validate=False,
            finetune="full",
            stands_for="GTX 1080 (8 GiB), the product's plan: grpo-cpu-offload (GRPO n=4, actor on FSDP2 "
                       "CPUOffloadPolicy, fp32, HF rollout)"),
    # the grpo rung (GRPO on FSDP1, no critic, the ref for the KL loss), never measured before call 12
    Profile("rtx3060", "NVIDIA GeForce RTX 3060", "8.6", 12288, rollout_engine="hf", steps=2, validate=False,
            finetune="full",
            stands_for="RTX 3060 (12 GiB), the product's plan with the HF rollout: grpo (GRPO n=4 on FSDP1, bf16)"),
    # checkpoint save and resume on the CPU-offload rung (FSDP2 + CPUOffloadPolicy): the GTX 1080 Ti's
    # plan on a small batch (16 prompts x 4, mini-batch 4 x 4: the save and load are what is tested)
    Profile("gtx1080ti-resume", "NVIDIA GeForce GTX 1080 Ti", "6.1", 11264, steps=2, validate=False, resume_after=1,
            overrides=("data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4"),
            finetune="full",
            stands_for="GTX 1080 Ti plan (grpo-cpu-offload) on 16 prompts a step: step 1 saves a checkpoint, a "
                       "second run resumes from it and trains step 2"),
    # another catalog model's shape (random weights from its config.json): the plan an 80 GB A100 gets
    # for Qwen2.5-1.5B-Instruct (PPO with the critic, bf16), vLLM -> HF rollout for this run only
    Profile("a100-1.5b", "NVIDIA A100-SXM4-80GB", "8.0", 81920, rollout_engine="hf", steps=2, validate=False,
            model="Qwen/Qwen2.5-1.5B-Instruct",
            stands_for="A100 80 GB with Qwen2.5-1.5B-Instruct (workload.model), the product's plan; HF rollout "
                       "instead of the plan's vLLM, for this run only"),
    # workload.rollout = 'hf' (the user's escape hatch from vLLM) as the product plans it for a vLLM-capable
    # card: through the setting, not the harness's rollout_engine, so the run proves that path
    Profile("rtx3090-rollout-hf", "NVIDIA GeForce RTX 3090", "8.6", 24576, rollout="hf", steps=3, validate=False,
            stands_for="RTX 3090 (24 GiB) with workload.rollout = 'hf': the product's plan for the HF rollout on a "
                       "card vLLM could run on"),
    # a run's end product on three rungs (issue 24): 3 steps, a save at each (retention shows at the third),
    # then the launcher's export (verl's merger, the proof) and the GSM8K scores of the base model and
    # the export on the payload's 256 test rows (random weights: both score ~0; the pipeline is what runs).
    # Smaller batches than the plans' (a save's size does not depend on the batch) keep three runs in one call;
    # the two PPO runs keep one save (12.43 GB each predicted: fp32 actor and critic with AdamW states): with the
    # plans' keep + 1 = 2 on disk the three side by side would hold about 62 GB at once on the device's 64 GiB
    # disk. The GTX 1080 run keeps the plan's (5.94 GB a save).
    Profile("p40-export", "Tesla P40", "6.1", 24576, steps=3, validate=False, export=True, tensorboard=True,
            overrides=("data.train_batch_size=64", *PPO_KEEP_ONE),
            stands_for="Tesla P40 plan (PPO with the critic, FSDP1, fp32, HF rollout) on 64 prompts a step: saves, "
                       "export, proof, GSM8K scores"),
    Profile("rtx3090-export", "NVIDIA GeForce RTX 3090", "8.6", 24576, rollout_engine="hf", steps=3, validate=False,
            export=True, tensorboard=True, overrides=("data.train_batch_size=64", *PPO_KEEP_ONE),
            stands_for="RTX 3090 plan (PPO with the critic, FSDP1, bf16; HF rollout instead of the plan's vLLM) on 64 "
                       "prompts a step: saves, export, proof, GSM8K scores"),
    Profile("gtx1080-export", "NVIDIA GeForce GTX 1080", "6.1", 8192, steps=3, validate=False, export=True,
            tensorboard=True, proof_baseline=PROOF_BEFORE_REF,
            overrides=("data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4"),
            finetune="full",
            stands_for="GTX 1080 plan (grpo-cpu-offload: GRPO, the actor on FSDP2 CPUOffloadPolicy, fp32, HF rollout) "
                       "on 16 prompts a step: saves, export, proof, GSM8K scores"),
    Profile("seed", "Tesla P40", "6.1", 24576, code="today", seed_recipe=True,
            stands_for="Tesla P40, the hand recipe (batch 1, 128 + 128 tokens) on the same verl"),
    *SPEED_PROFILES,
    # issue 29, the knobs measured on their own: the RTX 2080 Ti's plan as it was before the speed work (its
    # batches pinned: update micro-batch 8 with checkpointing, log-prob 8, chunk 256; they fit the knobs: update
    # 5202 + 2 x 1885 MiB of the 9953 cap) with every speed knob of patches 0007-0009 on, and torch's
    # CPU threads for the offloaded AdamW step and gradient sums (Ray gives an actor without num_cpus one)
    Profile("rtx2080ti-gathered", "NVIDIA GeForce RTX 2080 Ti", "7.5", 11264, rollout_engine="hf", steps=2,
            validate=False, probe_profile=SPEED_PROBE_PROFILE, env=(("OMP_NUM_THREADS", "8"),),
            overrides=("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                       "actor_rollout_ref.model.enable_gradient_checkpointing=True",
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                       "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
                       "+actor_rollout_ref.rollout.micro_batch_size=256",
                       "+actor_rollout_ref.rollout.gather_once=True", "+actor_rollout_ref.actor.fsdp_config.gather_once=True",
                       "+actor_rollout_ref.ref.fsdp_config.gather_once=True",
                       "+actor_rollout_ref.actor.fsdp_config.accumulate_grads_unsharded=True",
                       "+actor_rollout_ref.actor.optim.fused=True"),
            finetune="full",
            stands_for="RTX 2080 Ti (11 GiB), its plan before the speed work (micro-batches pinned) with the HF "
                       "rollout and patches 0007-0009's knobs on (gather once per pass and per mini-batch, "
                       "gradients reduced once per mini-batch, fused AdamW), OMP_NUM_THREADS=8"),
]
PROFILES += MULTI_PROFILES           # issue 27's, kept apart from the list above

# issue 35: LoRA. Each 8-12 GB card's LoRA plan (workload.finetune = "lora": grpo-lora, the actor's base frozen, no
# ref model) against the same card's full plan of this session (``*-after``: grpo-cpu-offload), one at a time, 2 steps,
# prompts/s over step 2 (validation off); vLLM cards with the HF rollout for this run only, as their ``*-after``.
# The 3B on 24 GB cards: the P40's fp32 plan and a bf16 card's with workload.rollout = 'hf' (2 steps each); and one
# LoRA run to its end (saves, the export merged and as an adapter, the proof, the scores) on the GTX 1080's plan.
LORA_PROFILES = [
    Profile(f"{name}-lora", gpu, cc, mib, rollout_engine=engine, steps=2, validate=False, finetune="lora",
            probe_profile=SPEED_PROBE_PROFILE, compare_with=f"{name}-after",
            stands_for=f"{label}, the LoRA plan (grpo-lora)"
                       + ("; HF rollout instead of the plan's vLLM, for this run only" if engine == "hf" else ""))
    for name, gpu, cc, mib, engine, label in SPEED_CARDS
] + [
    Profile("p40-3b-lora", "Tesla P40", "6.1", 24576, steps=2, validate=False, finetune="lora",
            model="Qwen/Qwen2.5-3B-Instruct",
            stands_for="Tesla P40 (24 GiB) with Qwen2.5-3B-Instruct, the LoRA plan (fp32 base, HF rollout)"),
    Profile("rtx3090-3b-lora", "NVIDIA GeForce RTX 3090", "8.6", 24576, steps=2, validate=False, finetune="lora",
            model="Qwen/Qwen2.5-3B-Instruct", rollout="hf",
            stands_for="RTX 3090 (24 GiB) with Qwen2.5-3B-Instruct and workload.rollout = 'hf', the LoRA plan "
                       "(bf16 base)"),
    Profile("gtx1080-lora-export", "NVIDIA GeForce GTX 1080", "6.1", 8192, steps=3, validate=False, export=True,
            finetune="lora", overrides=("data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4"),
            stands_for="GTX 1080 LoRA plan (grpo-lora, fp32, HF rollout) on 16 prompts a step: saves with "
                       "lora_adapter/, the export (merged model and the adapter alone), proof, GSM8K scores"),
]
# issue 42: the call-15 pairs again, with patch 0013 (the ranks' one merge decision, one FSDP unit at a time, the fp32
# merge rounded once) and the LoRA rungs' micro-batches chosen by speed; each alone on the machine, one step of 16
# prompts (64 sequences: one mini-batch of the plan's 16 prompts, one HF generation chunk), no profiler windows. The
# device time for all of issue 42 is about 12 minutes and a run's start-up ~60 s: the plan's step of 64 prompts twice
# over would need ~25 minutes. What 16 prompts change, the same for both plans of a pair: every phase but generation
# does a quarter of the plan's step; generation is one chunk where the plan runs ceil(256 / chunk) (GTX 1080: 2,
# RTX 3060 and 2080 Ti: 1), and a chunk takes about as long whatever its size (calls 9-10), so generation weighs more
# and the measured ratio is nearer 1 than the plan's step would give: conservative for LoRA. bench/gpu/lora_pairs.py
# prints the measured ratio and the plan's step rebuilt from the measured phases (chunks x generation + 4 x the rest).
# The RTX 3060's LoRA run to its end in bf16 (its plan's base dtype): one step, the save, the export (the adapter
# merged in fp32 and rounded once, lora_export.py), its proof against PEFT's merge, the GSM8K scores.
I42_STEP = ("data.train_batch_size=16",)
I42_FULL = [
    Profile(f"{name}-full-i42", gpu, cc, mib, rollout_engine=engine, steps=1, validate=False, finetune="full",
            overrides=I42_STEP, stands_for=f"{label}, the full plan (grpo-cpu-offload), one step of 16 prompts"
            + ("; HF rollout instead of the plan's vLLM, for this run only" if engine == "hf" else ""))
    for name, gpu, cc, mib, engine, label in SPEED_CARDS
]
LORA_PROFILES += [
    Profile(f"{name}-lora-i42", gpu, cc, mib, rollout_engine=engine, steps=1, validate=False, finetune="lora",
            overrides=I42_STEP, compare_with=f"{name}-full-i42",
            stands_for=f"{label}, the LoRA plan (grpo-lora) with patch 0013 and the micro-batches by speed, one "
                       "step of 16 prompts"
                       + ("; HF rollout instead of the plan's vLLM, for this run only" if engine == "hf" else ""))
    for name, gpu, cc, mib, engine, label in SPEED_CARDS
] + [
    Profile("rtx3060-lora-export", "NVIDIA GeForce RTX 3060", "8.6", 12288, rollout_engine="hf", steps=1,
            validate=False, export=True, finetune="lora", overrides=I42_STEP,
            stands_for="RTX 3060 LoRA plan (grpo-lora, bf16 base; HF rollout instead of the plan's vLLM, for this run "
                       "only) on 16 prompts: one step, its save with lora_adapter/, the bf16 export (the adapter "
                       "merged in fp32, rounded once), its proof against PEFT's merge, GSM8K scores"),
]
PROFILES += I42_FULL + LORA_PROFILES
BY_NAME = {p.name: p for p in PROFILES}


def lab_root(profile: Profile, base: str = LAB_BASE) -> str:
    return f"{base}/{profile.name}"


def node_hosts(profile: Profile) -> list[str]:
    """The inventory names of a Ray-node profile's nodes: the head first."""
    return [profile.name] + [f"{profile.name}-worker{i}" for i in range(1, profile.nodes)]


def settings_data(profile: dict) -> dict:
    """The host data a profile (its record, or ``asdict`` of it) is planned with: its lab_root and
    step cap, and the ``workload`` keys it sets (model, rollout, finetune)."""
    root = profile.get("lab_root") or f"/tmp/vl/{profile['name']}"
    workload = {k: profile[k] for k in ("model", "rollout", "finetune") if profile.get(k)}
    return {"lab_root": root, "env_prefix": f"{root}/env", "train_steps": profile.get("steps", STEPS),
            **({"workload": workload} if workload else {})}


def seed_overrides(profile: Profile) -> list[str]:
    """The hand recipe verl-lab replaces, with only its keys that exist in verl 0.5.0: one prompt
    per step, 128 + 128 tokens, every micro-batch 1, HF rollout, fp32, sdpa, no offload."""
    root = lab_root(profile)
    model = f"{root}/models/Qwen--Qwen2.5-0.5B-Instruct"
    data = f"{root}/data/gsm8k"
    keys = [
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/val_small.parquet",
        "data.train_batch_size=1", "data.max_prompt_length=128", "data.max_response_length=128",
        "data.filter_overlong_prompts=True",
        f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.model.use_remove_padding=False", "critic.model.use_remove_padding=False",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "+actor_rollout_ref.model.override_config._attn_implementation=sdpa",
        "+critic.model.override_config._attn_implementation=sdpa",
    ]
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model"):
        keys += [f"+{role}.fsdp_config.mixed_precision.param_dtype=fp32",
                 f"+{role}.fsdp_config.mixed_precision.reduce_dtype=fp32",
                 f"+{role}.fsdp_config.mixed_precision.buffer_dtype=fp32",
                 f"+{role}.fsdp_config.model_dtype=fp32"]
    keys += ["trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.logger=['console']",
             f"trainer.total_training_steps={profile.steps}", f"trainer.test_freq={profile.steps}",
             "trainer.val_before_train=False", f"trainer.default_local_dir={root}/train/checkpoints",
             "trainer.project_name=verl-lab", "trainer.experiment_name=seed-recipe"]
    return keys


def profile_layout(profile: Profile, code_root: Path, root: str | None = None):
    """The training stage's layout of the profile's box (its settings, and the plan deploy/train.py makes for its
    ``gpus``, or for a Ray cluster of ``nodes`` such boxes), with the planning code under ``code_root``; and the
    settings' data."""
    sys.path.insert(0, str(code_root))
    from tasks.plan import GpuTarget, make_plan
    from tasks.settings import load_settings
    try:
        from tasks.train import TrainingLayout, training_workload
    except ImportError:                  # trees before the stages had one name each
        from tasks.training import TrainingLayout, training_workload

    data = settings_data({**asdict(profile), "lab_root": root or lab_root(profile)})
    settings = load_settings(profile.name, data)
    target = GpuTarget(profile.gpu_name, profile.compute_capability, profile.plan_memory_mib or profile.memory_mib,
                       profile.gpus)
    workload = training_workload(settings)
    if profile.rollout_engine != "auto":
        workload = replace(workload, rollout_engine=profile.rollout_engine)
    if profile.nodes > 1:
        from tasks.plan import cluster_plan

        plan = cluster_plan({host: target for host in node_hosts(profile)}, workload)
    else:
        plan = make_plan(target, workload)
    return TrainingLayout(settings=settings, plan=plan, plan_source="gpu_override"), data


def render_one(profile: Profile, out: Path, code_root: Path, root: str | None = None, ray_port: int = RAY_PORT,
               node_addresses: tuple[str, ...] = NODE_ADDRESSES) -> dict:
    """Render one profile with the planning code under ``code_root`` (imported here): the plan for its
    ``gpus`` as deploy/train.py makes it for a box of that many (``make_plan``), or for a Ray cluster of
    ``nodes`` such boxes as the training stage makes it for a cluster member (``tasks.plan.cluster_plan``),
    whose nodes' units are rendered too (``render_ray_nodes``)."""
    layout, data = profile_layout(profile, code_root, root)
    settings, plan = layout.settings, layout.plan
    try:
        from tasks.train import training_wanted
    except ImportError:                  # trees before the stages had one name each
        from tasks.training import training_wanted

    train = out / "train"
    train.mkdir(parents=True, exist_ok=True)
    for want in training_wanted(layout):
        if want.content is None or not want.path.startswith(layout.train_dir + "/"):
            continue                         # folders, and the unit under /etc/systemd
        target_path = train / want.path[len(layout.train_dir) + 1:]
        target_path.write_bytes(want.content)
        target_path.chmod(0o755 if want.path == layout.launcher else 0o644)
    d = plan.to_dict()
    model_dir = Path(settings.model_dir).name
    return {"model_dir": model_dir, "model_config": str(Path("files") / "models" / model_dir.split("--", 1)[1].lower()
                                                        / "config.json"),
            "predicted_peak_mib": d["predicted_peak_mib"], "breakdown": d["breakdown"],
            "budget_mib": d["budget_mib"], "micro_batches": d["micro_batches"], "offload": d["offload"],
            "gradient_checkpointing": d.get("gradient_checkpointing", True), "rollout": d["rollout"],
            "rung": d.get("rung"), "lora": d.get("lora"),
            "train_batch_size": next(int(o.split("=", 1)[1]) for o in d["overrides"]
                                     if o.startswith("data.train_batch_size=")),
            **({"cluster": render_ray_nodes(profile, data, plan, out, ray_port,
                                                                     node_addresses)} if profile.nodes > 1 else {})}


def render_ray_nodes(profile: Profile, data: dict, plan, out: Path, port: int,
                     node_addresses: tuple[str, ...] = NODE_ADDRESSES) -> dict:
    """What the cluster stage places on each node (``tasks.cluster.cluster_wanted``: the Ray unit, ray.env, the
    training unit's drop-in, cluster-check), each node a loopback address of this one host (``node_addresses``: the
    head first), into ``out/cluster/<host>/``; the cluster from the product's own check of the members' settings
    (``check_clusters``) and NCCL's and Gloo's interface from the route to the head as the RouteToHead fact reads it
    (its command run here: every Linux host routes 127/8 over lo). Returns what bench/gpu/ray_nodes.py needs to start
    them: each node's role, address and GPUs (node i: GPUs i*gpus .. (i+1)*gpus - 1)."""
    from tasks.cluster import RayNode, choose_interface, cluster_wanted
    from tasks.facts.cluster import RouteToHead
    from tasks.settings import check_clusters, load_settings

    hosts = node_hosts(profile)
    spec = {"name": "bench", "head": hosts[0], "port": port}
    members = {host: load_settings(host, {**data, "cluster": spec, "cluster_address": node_addresses[i]})
               for i, host in enumerate(hosts)}
    clusters, problems = check_clusters(members)
    if problems:
        raise SystemExit("; ".join(str(p) for p in problems))
    cluster = clusters[spec["name"]]
    fact = RouteToHead()
    route = fact.process(subprocess.run(["sh", "-c", fact.command(cluster.head_address)], capture_output=True,
                                        text=True).stdout.splitlines())
    interface = choose_interface(route["route"], route["addrs"], cluster.head_address)
    nodes = []
    for i, host in enumerate(hosts):
        node = RayNode(members[host], cluster, interface, profile.gpus, plan.env)
        folder = out / "cluster" / host
        folder.mkdir(parents=True, exist_ok=True)
        placed = {}
        for want in cluster_wanted(node):
            if want.content is not None:
                (folder / Path(want.path).name).write_bytes(want.content)
                placed[Path(want.path).name] = want.path
        nodes.append({"host": host, "role": node.role, "address": node.node_address, "dir": f"cluster/{host}",
                      "placed": placed, "num_gpus": profile.gpus,
                      "cuda_visible_devices": ",".join(str(i * profile.gpus + k) for k in range(profile.gpus))})
    return {"name": cluster.name, "address": cluster.address, "interface": interface.name,
            "interface_reason": interface.reason, "nodes": nodes}


def _code_tree(ref: str) -> Path:
    dest = Path(tempfile.gettempdir()) / f"verl-lab-{ref}"
    if not any((dest / "tasks" / p).is_file() for p in ("plan.py", "plan/__init__.py")):   # before or after the split
        shutil.rmtree(dest, ignore_errors=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(dest), ref], check=True,
                       capture_output=True)
    return dest


def render(names: list[str], out_root: Path, today_ref: str, steps: int | None = None, probe: bool = True,
           lab_base: str = LAB_BASE, ray_port: int = RAY_PORT, node_addresses: tuple[str, ...] = NODE_ADDRESSES) -> None:
    """Render ``names``; ``steps`` replaces each profile's step count (a device call too short for two steps
    each), ``probe=False`` drops their VERL_LAB_PROFILE windows (the wall-clock splits stay); ``lab_base`` and
    ``ray_port``, ``node_addresses``: where the lab_roots are, the Ray-node profiles' port and their nodes' loopback
    addresses (a test on a machine that other tests' Ray nodes share)."""
    for name in names:
        profile = BY_NAME[name]
        if steps:
            profile = replace(profile, steps=steps)
        if not probe:
            profile = replace(profile, probe_profile="")
        out = out_root / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        code_ref = {"today": today_ref, "speed-before": SPEED_BEFORE_REF}.get(profile.code, "HEAD")
        record = {**asdict(profile), "cap_mib": profile.cap_mib, "lab_root": lab_root(profile, lab_base),
                  "verl_tree": profile.code, "env": dict(profile.env), "probe_profile": profile.probe_profile,
                  "extra_overrides": list(EXPORT_RUN_OVERRIDES if profile.export else RUN_OVERRIDES),
                  "code_ref": code_ref}
        if profile.seed_recipe:
            record.update(kind="overrides", overrides=seed_overrides(profile), plan=None)
            (out / "train").mkdir()
        else:
            code_root = REPO if code_ref == "HEAD" else _code_tree(code_ref)
            res = subprocess.run([sys.executable, __file__, "render-one", name, str(out), "--code-root", str(code_root),
                                  "--steps", str(profile.steps), "--lab-root", record["lab_root"],
                                  "--ray-port", str(ray_port), "--node-addresses", ",".join(node_addresses)],
                                 capture_output=True, text=True, cwd=code_root)
            if res.returncode:
                raise SystemExit(f"render {name} failed:\n{res.stdout}\n{res.stderr}")
            plan = json.loads(res.stdout.strip().splitlines()[-1])
            record.update(kind="launcher", plan=plan, **({"cluster": plan.pop("cluster")} if "cluster" in plan else {}))
            # a launcher older than the `--` passthrough: run its overrides directly
            if "-- KEY=VALUE" not in (out / "train" / "train-launcher").read_text():
                record["kind"] = "print-overrides"
        record["extra_overrides"] += list(profile.overrides)
        if profile.tensorboard:
            record["extra_overrides"].append(TENSORBOARD_LOGGER)
        if profile.proof_baseline:
            old = subprocess.run(["git", "-C", str(REPO), "show", f"{profile.proof_baseline}:verl_lab_box/export.py"],
                                 capture_output=True, text=True, check=True).stdout
            (out / "old_export.py").write_text(old)
        if not profile.validate:
            record["extra_overrides"].append("trainer.test_freq=-1")
        (out / "profile.json").write_text(json.dumps(record, indent=2) + "\n")
        plan = record.get("plan") or {}
        print(f"{name:10} {record['kind']:16} cap {profile.cap_mib or '-':>6} MiB  "
              f"predicted {plan.get('predicted_peak_mib', '-')} MiB  micro {plan.get('micro_batches', '-')}  "
              f"ckpt {plan.get('gradient_checkpointing', '-')}  offload "
              f"{[k for k, v in (plan.get('offload') or {}).items() if v]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("--only", default=",".join(p.name for p in PROFILES))
    r.add_argument("--out", type=Path, default=OUT_DEFAULT)
    r.add_argument("--today-ref", default=TODAY_REF)
    r.add_argument("--steps", type=int, help="train this many steps in every rendered profile (default: each its own)")
    r.add_argument("--no-profile", action="store_true", help="no torch.profiler windows (VERL_LAB_PROFILE)")
    one = sub.add_parser("render-one")
    one.add_argument("name")
    one.add_argument("out", type=Path)
    one.add_argument("--code-root", type=Path, required=True)
    one.add_argument("--steps", type=int)
    one.add_argument("--lab-root")
    one.add_argument("--ray-port", type=int, default=RAY_PORT)
    one.add_argument("--node-addresses", default=",".join(NODE_ADDRESSES))
    sub.add_parser("list")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for p in PROFILES:
            print(f"{p.name:10} cap {p.cap_mib or '-':>6}  {p.gpus * p.nodes} GPU(s)  {p.stands_for}")
        return 0
    if args.cmd == "render-one":
        profile = BY_NAME[args.name]
        print(json.dumps(render_one(replace(profile, steps=args.steps) if args.steps else profile, args.out,
                                    args.code_root, args.lab_root, args.ray_port,
                                    tuple(args.node_addresses.split(",")))))
        return 0
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown profile(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    render(names, args.out, args.today_ref, steps=args.steps, probe=not args.no_profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
