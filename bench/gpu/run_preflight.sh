#!/usr/bin/env bash
# On a GPU machine: run the training launcher's --check that bench/gpu/render_preflight.py
# rendered for this GPU. The env stage has not run there: env_python is the machine's own
# python3 (torch, no verl), and no markers, data or model exist, so those checks must fail
# while the GPU checks (nvidia-smi, /dev/nvidia*, torch.cuda, NVML, free memory) must pass.
# Usage: bash bench/gpu/run_preflight.sh RENDERED_DIR [OUT_DIR]
set -u
src=${1:?rendered dir (holds train/)}; out=${2:-.}
root=/tmp/verl-lab-preflight
rm -rf "$root"; mkdir -p "$root/env/bin" "$root/train/work" "$root/train/checkpoints" "$root/train/cache"
cp -r "$src/train/." "$root/train/"
# a wrapper, not a symlink: python3 may be a venv's, found only through its own path
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > "$root/env/bin/python"
chmod +x "$root/env/bin/python"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
python3 -c 'import pynvml' 2>/dev/null && echo "nvml: importable" || echo "nvml: not importable"
python3 "$root/train/train-launcher" --check 2>&1 | tee "$out/h200-preflight.txt"
echo "launcher --check exit: ${PIPESTATUS[0]}" | tee -a "$out/h200-preflight.txt"
