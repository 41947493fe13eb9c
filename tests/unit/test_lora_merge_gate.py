"""Patch 0013's host-memory gate: the HF rollout of a LoRA actor merges the adapter only where the host can hold the
saved base weights twice over (``_host_room``, MemAvailable); else it generates unmerged, as before 0013. Run with
verl 0.5.0's patched hf_rollout module, a real PEFT LoRA model (tiny, CPU, no FSDP) and fake /proc/meminfo files:
with room, the weights are merged inside and bit-identical after; without, nothing is merged and it says so once.
(The merge under FSDP1 and FSDP2 with verl's own worker: tests/unit/test_lora_worker.py.)"""

from __future__ import annotations

import json
import subprocess

PROBE = r"""
import contextlib, functools, io, json, sys
import torch
from peft import LoraConfig, get_peft_model
from verl.workers.rollout import hf_rollout as hr

meminfo = sys.argv[1]
real_room = hr._host_room
room = real_room(1 << 30, meminfo=meminfo + "/roomy")            # 1 GiB twice over, 4 GiB available
tight = real_room(3 << 30, meminfo=meminfo + "/roomy")           # 3 GiB twice over: no
missing = real_room(1, meminfo=meminfo + "/none")                # no meminfo: no
hr._SAID.clear()                                                  # the tight call said it: again below

torch.manual_seed(0)
base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"], init_lora_weights=False))
layer = model.base_model.model[0]
before = layer.base_layer.weight.detach().clone()
x = torch.randn(3, 8)
with torch.no_grad():
    with_adapter = model(x)


def rollout(meminfo_file):
    # the gate as the patch calls it, reading the given meminfo file
    hr._host_room = functools.partial(real_room, meminfo=meminfo_file)
    said = io.StringIO()
    with torch.no_grad(), contextlib.redirect_stdout(said), hr._adapter_merged(model):
        inside = {"moved": not torch.equal(layer.base_layer.weight, before), "merged": list(layer.merged_adapters),
                  "close": torch.allclose(model(x), with_adapter, atol=1e-5)}
    after = {"identical": torch.equal(layer.base_layer.weight, before), "merged": list(layer.merged_adapters)}
    return {"inside": inside, "after": after, "said": said.getvalue()}


print("RESULT " + json.dumps({"room": room, "tight": tight, "missing": missing,
                               "roomy": rollout(meminfo + "/roomy"), "small": rollout(meminfo + "/small"),
                               "small_again": rollout(meminfo + "/small")}))
"""


def _meminfo(tmp_path):
    folder = tmp_path / "meminfo"
    folder.mkdir()
    (folder / "roomy").write_text("MemTotal:       16777216 kB\nMemFree:         1048576 kB\n"
                                  "MemAvailable:    4194304 kB\n")
    (folder / "small").write_text("MemTotal:       16777216 kB\nMemAvailable:          0 kB\n")   # none
    return folder


def test_the_adapter_is_merged_only_with_room_for_the_saved_weights(verl_python, patched_verl_root, tmp_path):
    res = subprocess.run([str(verl_python), "-c", PROBE, str(_meminfo(tmp_path))], cwd=patched_verl_root,
                         capture_output=True, text=True, timeout=300)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, res.stdout[-2000:] + res.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    assert (got["room"], got["tight"], got["missing"]) == (True, False, False)
    roomy, small = got["roomy"], got["small"]
    assert roomy["inside"] == {"moved": True, "merged": ["default"], "close": True}, roomy
    assert roomy["after"] == {"identical": True, "merged": []} and roomy["said"] == "", roomy
    assert small["inside"] == {"moved": False, "merged": [], "close": True}, small     # generated unmerged
    assert small["after"] == {"identical": True, "merged": []}, small
    assert "the LoRA adapter is not merged for generation" in small["said"] and "MiB is available" in small["said"]
    assert got["small_again"]["said"] == "", "said once"
