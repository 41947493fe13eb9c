"""Patch 0013's merge on one process without FSDP (verl 0.5.0's patched hf_rollout module, a real PEFT LoRA model,
tiny, CPU) and its host-memory gate: the HF rollout of a LoRA actor merges the adapter only where the host can
hold the copies of the adapted weights twice over (``_host_room``: MemAvailable, read from ``hf_rollout._MEMINFO``,
here stand-in meminfo files); else it generates unmerged, as before 0013, and says so once.

* The merge is PEFT's own, bit for bit, for an fp32, a bf16 and an fp16 base (adapters in fp32, as peft keeps them
  on a half-precision base): inside the merge each weight equals what PEFT's ``merge_adapter()`` makes of the same
  layer; rounding A and B to the base's dtype before the product (the export's and 0013's old way) differs in
  many bf16 and fp16 weights, which this test sees.
* The host copies are made at the first merge and reused (the same tensors at the second), and after each merge
  the weights are the saved ones, bit for bit.

(Two ranks, FSDP1 and FSDP2, with verl's own worker: tests/unit/test_lora_merge_ranks.py.)"""

from __future__ import annotations

import json
import subprocess

PROBE = r"""
import contextlib, io, json, sys
import torch
from peft import LoraConfig, get_peft_model
from verl.workers.rollout import hf_rollout as hr

meminfo = sys.argv[1]
hr._MEMINFO = meminfo + "/roomy"
room = hr._host_room(1 << 30)                   # 1 GiB twice over, 4 GiB available
box = hr._host_room(1 << 30, ranks=2)           # two ranks of 1 GiB each, twice over: 4 GiB, just
tight = hr._host_room(1 << 30, ranks=3)         # three: no
hr._MEMINFO = meminfo + "/none"
missing = hr._host_room(1)                       # no meminfo: no
hr._SAID.clear()


def model_of(dtype):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32)).to(dtype)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5)               # a trained adapter, large enough to move many weights
    return model


def weights(model):
    return [m.base_layer.weight.detach().clone() for m in (model.base_model.model[0], model.base_model.model[2])]


def peft_merged(dtype):
    model = model_of(dtype)
    model.merge_adapter()
    return weights(model)


def rounded_twice(dtype):
    # the old way: A and B rounded to the weight's dtype before the product
    model, out = model_of(dtype), []
    for m in (model.base_model.model[0], model.base_model.model[2]):
        w, a, b = m.base_layer.weight, m.lora_A["default"].weight, m.lora_B["default"].weight
        out.append(w + (b.to(w.dtype) @ a.to(w.dtype)) * m.scaling["default"])
    return out


def rollout(model, merge, meminfo_file):
    hr._MEMINFO = meminfo_file
    layers = (model.base_model.model[0], model.base_model.model[2])
    before = weights(model)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(before[0].dtype)
    with torch.no_grad():
        with_adapter = model(x).float()
    said = io.StringIO()
    with torch.no_grad(), contextlib.redirect_stdout(said), merge.merged():
        inside = weights(model)
        close = float((model(x).float() - with_adapter).abs().max() / with_adapter.abs().max())
        merged = [list(m.merged_adapters) for m in layers]
    after = weights(model)
    return {"inside": inside, "close": close, "merged": merged, "said": said.getvalue(),
            "moved": [not torch.equal(a, b) for a, b in zip(inside, before)],
            "identical_after": all(torch.equal(a, b) for a, b in zip(after, before)),
            "unmerged_after": all(not m.merged_adapters for m in layers)}


found = {"room": room, "box": box, "tight": tight, "missing": missing}
for name in ("float32", "bfloat16", "float16"):
    dtype = getattr(torch, name)
    model = model_of(dtype)
    merge = hr._AdapterMerge(model)
    first = rollout(model, merge, meminfo + "/roomy")
    copies = [c.data_ptr() for c in merge.copies]
    second = rollout(model, merge, meminfo + "/none")     # made already: no room needed again
    peft = peft_merged(dtype)
    twice = rounded_twice(dtype)
    found[name] = {
        "units": len(merge.units), "why_not": merge.why_not,
        "same_as_peft": [torch.equal(a, b) for a, b in zip(first["inside"], peft)],
        "second_same_as_peft": [torch.equal(a, b) for a, b in zip(second["inside"], peft)],
        "twice_differs": [int((a != b).sum()) for a, b in zip(twice, peft)],
        "weights": [int(w.numel()) for w in peft],
        "copies_reused": copies == [c.data_ptr() for c in merge.copies],
        **{k: first[k] for k in ("close", "merged", "said", "moved", "identical_after", "unmerged_after")},
        "second_identical_after": second["identical_after"], "second_said": second["said"]}

model = model_of(torch.float32)
small = hr._AdapterMerge(model)
found["small"] = {k: v for k, v in rollout(model, small, meminfo + "/small").items() if k != "inside"}
found["small_again"] = rollout(model, small, meminfo + "/small")["said"]
found["small_copies"] = small.copies
print("RESULT " + json.dumps(found))
"""


def _meminfo(tmp_path):
    folder = tmp_path / "meminfo"
    folder.mkdir()
    (folder / "roomy").write_text("MemTotal:       16777216 kB\nMemFree:         1048576 kB\n"
                                  "MemAvailable:    4194304 kB\n")
    (folder / "small").write_text("MemTotal:       16777216 kB\nMemAvailable:          0 kB\n")   # none
    return folder


def test_the_merge_is_peft_s_and_made_only_with_room_for_the_copies(verl_python, patched_verl_root, tmp_path):
    res = subprocess.run([str(verl_python), "-c", PROBE, str(_meminfo(tmp_path))], cwd=patched_verl_root,
                         capture_output=True, text=True, timeout=300)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, res.stdout[-2000:] + res.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    assert (got["room"], got["box"], got["tight"], got["missing"]) == (True, True, False, False)
    for name, close in (("float32", 1e-5), ("bfloat16", 0.05), ("float16", 0.01)):
        one = got[name]
        assert one["units"] == 2 and one["why_not"] is None
        # PEFT's merge, bit for bit, at the first merge and the second (the host copies reused)
        assert one["same_as_peft"] == [True, True] and one["second_same_as_peft"] == [True, True], one
        assert one["copies_reused"] and one["second_identical_after"] and one["second_said"] == ""
        assert one["merged"] == [["default"], ["default"]] and one["moved"] == [True, True], one
        assert one["close"] < close, (name, one["close"])      # the merged model computes the adapter model (relative)
        assert one["identical_after"] and one["unmerged_after"] and one["said"] == "", one
        if name == "float32":
            assert one["twice_differs"] == [0, 0]
        else:    # rounding A and B first is another merge: this test tells the two apart
            assert all(n > 0.01 * total for n, total in zip(one["twice_differs"], one["weights"], strict=True)), one
    small = got["small"]
    assert small["merged"] == [[], []] and small["moved"] == [False, False], small      # generated unmerged
    assert small["identical_after"] and small["unmerged_after"] and small["close"] < 1e-5
    assert "the LoRA adapter is not merged for generation" in small["said"] and "MiB is (MemAvailable)" in \
        small["said"], small["said"]
    assert got["small_again"] == "" and got["small_copies"] is None, "said once, no copies made"
