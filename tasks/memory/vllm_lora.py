"""What vLLM 0.8.5 holds on each GPU for LoRA (``vllm_lora_mib``): the buffers its engine allocates when verl
0.5.0 starts it with ``enable_lora``, ``max_loras=1`` and ``max_lora_rank`` = the adapters' rank
(``verl/workers/fsdp_workers.py`` ``_build_rollout``), for ``max_num_seqs`` sequences and
``max_num_batched_tokens`` tokens a forward.

Read in vLLM 0.8.5's source (the wheel; tests/unit/test_vllm_lora.py reads the same facts from it with ``ast``):

* ``vllm/lora/models.py`` ``LoRAModelManager._create_lora_modules``: when the model is loaded, every module whose
  name ends in one of ``get_supported_lora_modules`` (``vllm/lora/utils.py``: the suffix of every ``LinearBase``,
  plus the model class's ``embedding_modules``) is replaced by its LoRA layer, which ``create_lora_weights`` at
  once, whatever the adapter later targets. The buffers are zeros in ``LoRAConfig.lora_dtype`` ("auto": the
  model's dtype, ``vllm/config.py`` ``LoRAConfig.verify_with_model_config``);
* ``vllm/lora/layers.py`` ``BaseLinearLayerWithLoRA.create_lora_weights`` (and ``MergedColumnParallelLinearWithLoRA``'s
  for packed modules): per slice of a packed module (``packed_modules_mapping``: Qwen2's and Llama's ``qkv_proj``
  is q, k, v; ``gate_up_proj`` gate, up; Phi-3's are one slice each) an A of ``max_lora_rank x input_size`` and a
  B of ``output_size x max_lora_rank``; a column-parallel layer (qkv, gate_up) keeps the whole input and its
  output's share of the tensor-parallel group, a row-parallel one (o, down) its input's share and the whole output;
* ``VocabParallelEmbeddingWithLoRA`` and ``LogitsProcessorWithLoRA`` only for a model class with
  ``embedding_modules`` (Llama, Mistral, Phi-3; not Qwen2): an A over the vocabulary plus
  ``lora_extra_vocab_size`` (256) rows, a B, and 256 extra embedding rows each; the model itself is built with 256
  more vocabulary rows in its embedding and its head (``vllm/model_executor/models/llama.py`` ``LlamaModel``,
  ``LlamaForCausalLM``: the head padded to ``lora_vocab_padding_size`` 256 instead of 64);
* the punica workspace (``vllm/lora/punica_wrapper/punica_base.py`` ``PunicaWrapperBase.__init__``, ``punica_gpu.py``
  ``PunicaWrapperGPU.__init__``, ``vllm/lora/ops/triton_ops/lora_kernel_metadata.py`` ``LoRAKernelMeta.make``):
  six int64 index tensors of ``max_num_batched_tokens`` and three of ``max_num_seqs``, two int32 metadata tensors of
  each (V0: of ``max_num_batched_tokens`` for the prompts too), and in each LoRA linear layer's forward a float32
  buffer of slices x tokens x rank (``add_lora_linear``), which vLLM's profiling run sees as activations;
* the warm-up's dummy adapters and the adapter verl sends are made on the CPU (``create_dummy_lora``: "cpu") and
  copied into the buffers above: nothing more on the GPU.

Unproven on a GPU: vLLM has not run on the device (it needs torch 2.6); a run of a vLLM LoRA plan measures it.
"""

from __future__ import annotations

from tasks.memory.shape import MIB, ModelShape, _bytes

# vLLM 0.8.5's LoRAConfig (vllm/config.py): max_lora_rank must be one of these (__post_init__)
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
VLLM_LORA_EXTRA_VOCAB = 256      # LoRAConfig.lora_extra_vocab_size's default
VLLM_LORA_VOCAB_PADDING = 256    # LoRAConfig.lora_vocab_padding_size (a ClassVar)
VLLM_VOCAB_PADDING = 64          # vllm/model_executor/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
MAX_LORAS = 1                    # verl 0.5.0's lora_kwargs

# Per model class (config.json "architectures"): the slices of vLLM's packed qkv_proj and gate_up_proj
# (packed_modules_mapping) and whether the class has embedding_modules (LoRA on the embedding and the head).
VLLM_LORA_LAYOUTS = {
    "Qwen2ForCausalLM": (3, 2, False),
    "LlamaForCausalLM": (3, 2, True),
    "MistralForCausalLM": (3, 2, True),
    "Phi3ForCausalLM": (1, 1, True),
}
# a class not in the table: the larger of these (every slice apart, the embedding and the head adapted)
UNKNOWN_LAYOUT = (3, 2, True)


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def vllm_lora_buffers(shape: ModelShape, rank: int, dtype: str, tp: int = 1, architecture: str = "",
                      max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                      engine: str = "v1") -> dict[str, float]:
    """The parts, MiB on one GPU of the engine: ``linear`` (A and B of every linear layer of the decoder),
    ``embedding`` (the embedding's and the head's LoRA and their extra vocabulary rows; 0 for Qwen2), ``workspace``
    (the punica index tensors and one layer's float32 shrink buffer)."""
    qkv_slices, gate_up_slices, embedding = VLLM_LORA_LAYOUTS.get(architecture, UNKNOWN_LAYOUT)
    h, q, f, r = shape.hidden, shape.q_dim, shape.ffn, rank
    kv = max(1, shape.kv_heads // tp) * shape.head_dim          # vLLM replicates a KV head over more GPUs than heads
    linear = shape.layers * (
        qkv_slices * r * h + (q // tp + 2 * kv) * r             # qkv_proj: column-parallel, A over the whole input
        + gate_up_slices * r * h + 2 * f // tp * r              # gate_up_proj: column-parallel
        + r * q // tp + h * r                                   # o_proj: row-parallel, B over the whole output
        + r * f // tp + h * r)                                  # down_proj: row-parallel
    emb = 0.0
    if embedding:
        extra, vocab = VLLM_LORA_EXTRA_VOCAB * MAX_LORAS, shape.vocab
        emb = extra * h / tp                                    # the embedding's added rows (the model's weights)
        emb += extra * h + (vocab + extra) * r + h * r          # VocabParallelEmbeddingWithLoRA's tensors, A, B
        logits = _pad(vocab + extra, VLLM_LORA_VOCAB_PADDING)
        emb += r * h + logits * r + extra * h                   # LogitsProcessorWithLoRA's A, B and extra rows
        if not shape.tied_embeddings:                           # the head's rows: padded to 256, with the extra ones
            emb += (_pad(vocab, VLLM_LORA_VOCAB_PADDING) + extra - _pad(vocab, VLLM_VOCAB_PADDING)) * h / tp
    prompts = max_num_seqs if engine == "v1" else max_num_batched_tokens
    workspace = 8 * (6 * max_num_batched_tokens + 3 * max_num_seqs) + 4 * 2 * (max_num_batched_tokens + prompts) \
        + 4 * max(qkv_slices, gate_up_slices) * max_num_batched_tokens * r
    b = _bytes(dtype)
    return {"linear": b * MAX_LORAS * linear / MIB, "embedding": b * MAX_LORAS * emb / MIB,
            "workspace": workspace / MIB}


def vllm_lora_mib(shape: ModelShape, rank: int, dtype: str, tp: int = 1, architecture: str = "",
                  max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, engine: str = "v1") -> float:
    """vLLM 0.8.5's memory for LoRA on one GPU of the engine (``vllm_lora_buffers``, summed)."""
    return sum(vllm_lora_buffers(shape, rank, dtype, tp, architecture, max_num_batched_tokens, max_num_seqs,
                                 engine).values())
