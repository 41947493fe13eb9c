"""vLLM 0.8.5's memory for LoRA (tasks/memory/vllm_lora.py): every fact the arithmetic rests on, read from vLLM's own
source in its wheel with ``ast`` (tests/fixtures/vllm_signatures.py; never imported: vLLM needs CUDA), and the
arithmetic on the catalog's models.

What this proves: the term is what vLLM 0.8.5's code allocates for verl's settings. Not proven: any GPU number (vLLM
never ran on the device); the plan's reason says so.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from tasks.memory import ModelShape
from tasks.memory.lora import LoraSpec, adapter_params
from tasks.memory.vllm_lora import (
    MAX_LORAS,
    VLLM_LORA_EXTRA_VOCAB,
    VLLM_LORA_LAYOUTS,
    VLLM_LORA_RANKS,
    VLLM_LORA_VOCAB_PADDING,
    VLLM_VOCAB_PADDING,
    vllm_lora_buffers,
    vllm_lora_mib,
)
from tasks.plan import GpuTarget, make_plan
from tests.fixtures import vllm_signatures as vllm
from tests.unit.test_plan import workload

REPO = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
MODELS = REPO / "files" / "models"


def config(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


def flat(node: ast.AST, path: str) -> str:
    """A node's source, comments and whitespace removed (the allocations are spread over lines)."""
    return re.sub(r"\s+", "", re.sub(r"#[^\n]*", "", ast.get_source_segment(vllm.source(path), node)))


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def class_value(cls: ast.ClassDef, name: str):
    """A class attribute's literal value (``name = ...`` or ``name: T = ...``), or None where the class has none."""
    for n in cls.body:
        target = n.targets[0] if isinstance(n, ast.Assign) else n.target if isinstance(n, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == name and n.value is not None:
            return ast.literal_eval(n.value)
    return None


# ---------------------------------------------------------------- vLLM 0.8.5's source

def test_lora_config_defaults_are_vllms():
    cfg = vllm.class_def("vllm/config.py", "LoRAConfig")
    assert class_value(cfg, "lora_extra_vocab_size") == VLLM_LORA_EXTRA_VOCAB
    assert class_value(cfg, "lora_vocab_padding_size") == VLLM_LORA_VOCAB_PADDING
    assert class_value(cfg, "lora_dtype") == "auto" and class_value(cfg, "fully_sharded_loras") is False
    assert class_value(cfg, "bias_enabled") is False
    post = flat(method(cfg, "__post_init__"), "vllm/config.py")
    assert f"possible_max_ranks={VLLM_LORA_RANKS}".replace(" ", "") in post
    verify = flat(method(cfg, "verify_with_model_config"), "vllm/config.py")
    assert 'ifself.lora_dtypein(None,"auto"):self.lora_dtype=model_config.dtype' in verify   # the model's dtype
    src = vllm.source("vllm/model_executor/layers/vocab_parallel_embedding.py")
    assert f"DEFAULT_VOCAB_PADDING_SIZE = {VLLM_VOCAB_PADDING}" in src


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM"])
def test_each_model_class_packs_and_adapts_as_the_table_says(arch):
    """Slices of the packed qkv_proj and gate_up_proj (packed_modules_mapping) and whether the class adapts the
    embedding and the head (embedding_modules; the SupportsLoRA interface's default is {}), for the class vLLM's
    registry runs for that architecture; an attribute the class does not set comes from its base model class."""
    registry = vllm.source("vllm/model_executor/models/registry.py")
    module, name = re.search(rf'"{arch}": \("(\w+)", "(\w+)"\)', registry).groups()
    cls = vllm.class_def(f"vllm/model_executor/models/{module}.py", name)
    bases = [b.id for b in cls.bases if isinstance(b, ast.Name) and b.id.endswith("ForCausalLM")]
    parent = vllm.class_def("vllm/model_executor/models/llama.py", bases[0]) if bases else None
    assert bases in ([], ["LlamaForCausalLM"]), bases

    def attr(key):
        own = class_value(cls, key)
        return own if own is not None or parent is None else class_value(parent, key)

    interface = vllm.class_def("vllm/model_executor/models/interfaces.py", "SupportsLoRA")
    assert class_value(interface, "embedding_modules") == {}
    packed, embedding = attr("packed_modules_mapping"), attr("embedding_modules") or {}
    assert (len(packed["qkv_proj"]), len(packed["gate_up_proj"]), bool(embedding)) == VLLM_LORA_LAYOUTS[arch]


def test_the_linear_layers_allocate_a_and_b_per_slice_at_max_lora_rank():
    path = "vllm/lora/layers.py"
    base = flat(method(vllm.class_def(path, "BaseLinearLayerWithLoRA"), "create_lora_weights"), path)
    assert "torch.zeros(max_loras,1,lora_a_out_size,self.input_size,dtype=lora_config.lora_dtype" in base
    assert "torch.zeros(max_loras,1,lora_b_out_size,lora_config.max_lora_rank,dtype=lora_config.lora_dtype" in base
    assert "for_inrange(self.n_slices)" in base
    # column-parallel: A over the whole input, B over its output share; row-parallel: A over its input share
    assert "elifisinstance(self.base_layer,ColumnParallelLinear):lora_a_out_size=(lora_config.max_lora_rankif" in base
    row = flat(method(vllm.class_def(path, "RowParallelLinearWithLoRA"), "__init__"), path)
    assert "self.input_size=self.base_layer.input_size_per_partition" in row
    merged = flat(method(vllm.class_def(path, "MergedColumnParallelLinearWithLoRA"), "create_lora_weights"), path)
    assert "torch.zeros(max_loras,1,output_size,lora_config.max_lora_rank" in merged
    assert "foroutput_sizeinself.output_slices" in merged


def test_the_embedding_and_the_head_allocate_their_extra_vocabulary():
    path = "vllm/lora/layers.py"
    emb = flat(method(vllm.class_def(path, "VocabParallelEmbeddingWithLoRA"), "create_lora_weights"), path)
    assert "(max_loras,lora_config.lora_extra_vocab_size,self.base_layer.embedding_dim,)" in emb
    assert "(max_loras,self.base_layer.org_vocab_size+lora_config.lora_extra_vocab_size,lora_config.max_lora_rank,)" \
        in emb
    head = flat(method(vllm.class_def(path, "LogitsProcessorWithLoRA"), "create_lora_weights"), path)
    assert "math.ceil(self.base_layer.vocab_size/lora_config.lora_vocab_padding_size)*" \
           "lora_config.lora_vocab_padding_size,lora_config.max_lora_rank," in head
    assert "(max_loras,lora_config.lora_extra_vocab_size,self.hidden_size)" in head


def test_the_punica_workspace_is_sized_by_tokens_and_sequences():
    base = flat(method(vllm.class_def("vllm/lora/punica_wrapper/punica_base.py", "PunicaWrapperBase"), "__init__"),
                "vllm/lora/punica_wrapper/punica_base.py")
    assert base.count("torch.empty(max_num_batched_tokens,dtype=torch.long") == 4
    assert "torch.empty(2,max_num_batched_tokens,dtype=torch.long" in base
    assert base.count("torch.empty(max_batches,dtype=torch.long") == 3
    gpu = flat(method(vllm.class_def("vllm/lora/punica_wrapper/punica_gpu.py", "PunicaWrapperGPU"), "__init__"),
               "vllm/lora/punica_wrapper/punica_gpu.py")
    assert "max_num_prompts=(max_batchesifenvs.VLLM_USE_V1elsemax_num_batched_tokens)" in gpu
    meta = vllm.source("vllm/lora/ops/triton_ops/lora_kernel_metadata.py")
    assert meta.count("torch.empty(max_num_tokens,") == 2
    linear = flat(method(vllm.class_def("vllm/lora/punica_wrapper/punica_gpu.py", "PunicaWrapperGPU"),
                         "add_lora_linear"), "vllm/lora/punica_wrapper/punica_gpu.py")
    assert "torch.zeros((len(output_slices),x.size(0),r),dtype=torch.float32" in linear


def test_warm_up_adapters_are_made_on_the_cpu():
    """The dummy adapters of vLLM's profiling run are built on the CPU and copied into the buffers: no more GPU."""
    dummy = flat(method(vllm.class_def("vllm/lora/models.py", "LoRAModelManager"), "create_dummy_lora"),
                 "vllm/lora/models.py")
    assert dummy.count("create_dummy_lora_weights(") == dummy.count('"cpu",') == 3


def test_verl_starts_vllm_with_one_adapter_slot_at_the_rank(patched_verl_root):
    src = (patched_verl_root / "verl/workers/fsdp_workers.py").read_text()
    assert '{"enable_lora": True, "max_loras": 1, "max_lora_rank": self._lora_rank}' in src
    assert MAX_LORAS == 1


# ---------------------------------------------------------------- the arithmetic

def test_qwen2_adapts_every_linear_layer_and_not_the_embedding():
    shape = ModelShape.from_config(config("qwen2.5-0.5b-instruct"))
    parts = vllm_lora_buffers(shape, 32, "bf16", architecture="Qwen2ForCausalLM")
    # at one GPU the stacked A and B of the seven linear layers are PEFT's all-linear adapter, in the model's dtype
    assert parts["linear"] == pytest.approx(2 * adapter_params(shape, LoraSpec(rank=32)) / MIB)
    assert parts["embedding"] == 0
    # 6 + 3 int64 index tensors, 2 + 2 int32 metadata, the largest shrink buffer: 3 slices x 8192 tokens x 32 x fp32
    assert parts["workspace"] == pytest.approx((8 * (6 * 8192 + 3 * 256) + 4 * 2 * (8192 + 256)
                                                + 4 * 3 * 8192 * 32) / MIB)
    assert sum(parts.values()) == pytest.approx(vllm_lora_mib(shape, 32, "bf16", architecture="Qwen2ForCausalLM"))
    assert 36 < sum(parts.values()) < 38
    # V0 sizes its prompt metadata by tokens
    v0 = vllm_lora_buffers(shape, 32, "fp16", architecture="Qwen2ForCausalLM", engine="v0")
    assert v0["workspace"] - parts["workspace"] == pytest.approx(4 * 2 * (8192 - 256) / MIB)


def test_tensor_parallel_splits_only_the_parallel_dimension():
    shape = ModelShape.from_config(config("qwen2.5-3b-instruct"))
    one = vllm_lora_buffers(shape, 32, "bf16", 1, "Qwen2ForCausalLM")["linear"]
    two = vllm_lora_buffers(shape, 32, "bf16", 2, "Qwen2ForCausalLM")["linear"]
    h, r, L = shape.hidden, 32, shape.layers
    whole = 2 * L * r * (3 * h + 2 * h + h + h) / MIB     # qkv's and gate_up's A, o's and down's B: never split
    assert two == pytest.approx(whole + (one - whole) / 2, rel=1e-9)


def test_phi3_adds_its_embedding_and_head_lora():
    shape = ModelShape.from_config(config("phi-3-mini-4k-instruct"))
    parts = vllm_lora_buffers(shape, 32, "bf16", architecture="Phi3ForCausalLM")
    V, h, r = shape.vocab, shape.hidden, 32
    head_rows = -(-(V + 256) // 256) * 256
    expected = 256 * h + 256 * h + (V + 256) * r + h * r + r * h + head_rows * r + 256 * h \
        + (-(-V // 256) * 256 + 256 - -(-V // 64) * 64) * h
    assert parts["embedding"] == pytest.approx(2 * expected / MIB)
    # its fused qkv_proj and gate_up_proj are one slice each: A once over the input
    qwen_like = vllm_lora_buffers(shape, 32, "bf16", architecture="LlamaForCausalLM")
    assert qwen_like["linear"] - parts["linear"] == pytest.approx(2 * shape.layers * (2 + 1) * r * h / MIB)
    unknown = vllm_lora_buffers(shape, 32, "bf16", architecture="SomethingForCausalLM")
    assert unknown == qwen_like                      # an unknown class: every slice apart and the embedding adapted


def test_vllm_lora_plans_say_where_the_term_comes_from_and_that_no_gpu_ran_it():
    plan = make_plan(GpuTarget("NVIDIA GeForce RTX 3060", "8.6", 12288), workload())
    assert plan.rung == "grpo-lora" and plan.precision.rollout == "vllm"
    why = next(r for r in plan.reasons if r.setting == "vllm_lora")
    assert why.value == f"{plan.estimate.breakdown['vllm_lora']} MiB" and plan.estimate.breakdown["vllm_lora"] > 30
    assert "vllm/lora/layers.py create_lora_weights" in why.why and "unproven on a GPU" in why.why
    assert "Qwen2ForCausalLM has no embedding_modules" in why.why
    assert plan.estimate.vllm["own_mib"] > plan.estimate.breakdown["vllm_lora"]
    full = make_plan(GpuTarget("NVIDIA GeForce RTX 3060", "8.6", 12288), workload(finetune="full"))
    assert not [r for r in full.reasons if r.setting in ("vllm_lora", "lora_merge")]
