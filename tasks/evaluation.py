"""How a box scores a model on GSM8K after training: engine, dtype and batch (pure).

``evaluation_plan(plan, test_file)`` gives the ``evaluation`` section of plan.json's ``launch``
(the launcher's after-run, verl_lab_box/after_run.py, reads it and runs verl_lab_box/gsm8k_score.py with it, for the
base model once and for each export):

* engine and dtype: the plan's rollout, as training generates on that GPU: the HF-transformers
  ``generate`` below compute capability 7.0 (no vLLM on Pascal), vLLM from 7.0 (tasks/plan/precision.py's
  ``choose_precision``), in the rollout's dtype (fp32 on Pascal, fp16 vLLM on 7.x, bf16 on 8.0+);
* the batch: prompts per ``generate()`` call (HF) or vLLM's ``max_num_seqs``, the largest of
  ``BATCH_CHOICES`` the memory model fits on the plan's GPU for prompts of ``max_prompt_length``
  and answers of ``max_response_length`` tokens (the training shape): HF through
  ``tasks.memory.generate_peak`` plus the CUDA context and workspace, within the plan's budget
  (``gpu_budget_mib``; the process is alone on the GPU once training has finished); vLLM through
  ``tasks.memory.vllm_memory`` with nothing else held at its start (its share then holds that many
  sequences' KV cache, at most ``VLLM_SHARE_MAX`` of the GPU). Longer prompts make fewer per call
  (the score program counts tokens), so a batch never holds more than was sized.

The answer length is the training's ``max_response_length``: the score compares base and trained
policy under the length the policy was trained for (answers cut there score 0; the JSON counts them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

BATCH_CHOICES = (256, 128, 64, 32, 16, 8, 4, 2, 1)
TORCH_DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
                "bf16": "bfloat16", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class EvaluationPlan:
    engine: str                     # "hf" | "vllm"
    dtype: str                      # torch dtype name: "float32" | "float16" | "bfloat16"
    batch: int                      # prompts per HF generate() call, or vLLM's max_num_seqs
    prompt_len: int                 # the prompt length the batch is sized for
    max_new_tokens: int
    predicted_peak_mib: int
    budget_mib: int
    test_file: str
    vllm_gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    why: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def evaluation_plan(plan, test_file: str) -> EvaluationPlan:
    """The GSM8K evaluation of a ``tasks.plan.TrainingPlan``'s model on the plan's GPU."""
    from tasks.memory import CUDA_CONTEXT_MIB, WORKSPACE_MIB, ModelShape, generate_peak, vllm_memory
    from tasks.plan import VLLM_SHARE_MAX, VLLM_SHARE_MIN, PlanError, gpu_budget_mib, vllm_engine
    from tasks.plan.estimator import _MEM_DTYPE

    w, gpu, precision = plan.workload, plan.gpu, plan.precision
    shape = ModelShape.from_config(dict(w.model_config))
    mem_dtype = _MEM_DTYPE[precision.rollout_dtype]
    prompt, new = w.max_prompt_length, w.max_response_length
    budget = gpu_budget_mib(gpu)
    common = {"engine": precision.rollout, "dtype": TORCH_DTYPES[precision.rollout_dtype], "prompt_len": prompt,
              "max_new_tokens": new, "budget_mib": budget, "test_file": test_file}
    if precision.rollout == "vllm":
        tp = plan.memory.rollout_tp
        engine = vllm_engine(gpu)
        for batch in BATCH_CHOICES:
            vm = vllm_memory(shape, engine=engine, dtype=mem_dtype, gpu_memory_mib=gpu.memory_mib, seqs=batch,
                             seq_len=prompt + new, max_num_batched_tokens=max(8192, prompt + new),
                             held_at_start_mib=0.0, share_min=VLLM_SHARE_MIN, share_max=VLLM_SHARE_MAX, tp=tp)
            if vm.kv_granted_mib >= vm.kv_wanted_mib:
                return EvaluationPlan(**common, batch=batch, vllm_gpu_memory_utilization=vm.share,
                                      tensor_parallel_size=tp,
                                      predicted_peak_mib=int(round(vm.share * gpu.memory_mib)),
                                      why=f"vLLM {engine.upper()} as the rollout on this GPU: {batch} sequences at once "
                                          f"need a gpu_memory_utilization of {vm.share} (weights, profile and "
                                          f"{int(vm.kv_wanted_mib)} MiB of KV cache; nothing else on the GPU)")
        raise PlanError(f"vLLM cannot hold one {prompt + new}-token sequence of the model on {gpu.name} for the "
                        "evaluation")
    for batch in BATCH_CHOICES:
        peak = generate_peak(shape, batch, prompt, new, mem_dtype, "sdpa").peak_mib + CUDA_CONTEXT_MIB + WORKSPACE_MIB
        if peak <= budget:
            return EvaluationPlan(**common, batch=batch, predicted_peak_mib=int(round(peak)),
                                  why=f"HF generate as the rollout on this GPU ({precision.rollout_dtype}): {batch} "
                                      f"prompts of {prompt} + {new} tokens per call, estimated {int(round(peak))} MiB "
                                      f"of the {budget} MiB budget (tasks.memory.generate_peak)")
    raise PlanError(f"HF generate of one {prompt} + {new}-token sequence does not fit {gpu.name} for the evaluation")
