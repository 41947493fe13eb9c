#!/usr/bin/env bash
# Install the GPU payload (.gpu/, built here by bench/gpu/payload.py and named in the device
# call's `carry`) on the device machine, from the repository root:
#   - .gpu/wheels/*.whl          -> pip install --no-index --no-deps --target "$SITE"
#   - .gpu/ray-2.46.0.tar.xz     -> unpacked into "$SITE" (the Ray wheel without ray/jars/)
#   - .gpu/verl/<NAME>.tar.xz    -> "$VERL_TREES/<NAME>/verl/...", so that
#                                   PYTHONPATH="$VERL_TREES/<NAME>:$SITE" imports that verl
# A stamp in "$SITE" holds the digest of the payload files, this script and both folders: a
# machine still warm from the last call (it keeps /tmp for 30 s) skips the install.
# Then it prints the versions that matter (torch, transformers, ray, tensordict, hydra, ...) and
# imports each verl tree.
#
#   bash bench/gpu/install.sh            # SITE=/tmp/site VERL_TREES=/tmp/verl-trees
#   export PYTHONPATH=/tmp/verl-trees/current:/tmp/site
#
# Knobs (tests on another machine): PAYLOAD (default .gpu), PYTHON (python3), PIP_TARGET_ARGS
# (extra words for pip install, e.g. --python-version 3.12 --platform ... to lay cp312 wheels
# down under another Python), CHECK=0 (skip the version and import lines).
set -euo pipefail

PAYLOAD="${PAYLOAD:-.gpu}"
SITE="${SITE:-/tmp/site}"
VERL_TREES="${VERL_TREES:-/tmp/verl-trees}"
PYTHON="${PYTHON:-python3}"
CHECK="${CHECK:-1}"
read -r -a extra_pip <<<"${PIP_TARGET_ARGS:-}"

fail() { echo "install.sh: $*" >&2; exit 1; }

[ -d "$PAYLOAD/wheels" ] || fail "no $PAYLOAD/wheels: run bench/gpu/payload.py here and carry .gpu"
shopt -s nullglob
wheels=("$PAYLOAD"/wheels/*.whl)
rays=("$PAYLOAD"/ray-*.tar.xz)
trees=("$PAYLOAD"/verl/*.tar.xz)
shopt -u nullglob
[ "${#wheels[@]}" -gt 0 ] || fail "no wheels in $PAYLOAD/wheels"
[ "${#rays[@]}" -eq 1 ] || fail "expected one $PAYLOAD/ray-*.tar.xz, found ${#rays[@]}"
[ "${#trees[@]}" -gt 0 ] || fail "no verl trees in $PAYLOAD/verl"

digest=$( { sha256sum "${BASH_SOURCE[0]}" "${wheels[@]}" "${rays[@]}" "${trees[@]}" | sed 's#  .*/#  #';
            echo "$SITE $VERL_TREES ${PIP_TARGET_ARGS:-}"; } | sha256sum | cut -d' ' -f1)
stamp="$SITE/.verl-lab-payload"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ]; then
  echo "install.sh: payload ${digest:0:12} already installed in $SITE and $VERL_TREES"
else
  t0=$SECONDS
  mkdir -p "$SITE" "$VERL_TREES"
  rm -f "$stamp"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${extra_pip[@]}" "${wheels[@]}"
  rm -rf "$SITE/ray" "$SITE"/ray-*.dist-info
  tar -xmJf "${rays[0]}" -C "$SITE"
  for t in "${trees[@]}"; do
    name=$(basename "$t" .tar.xz)
    rm -rf "${VERL_TREES:?}/$name"
    mkdir -p "$VERL_TREES/$name"
    tar -xmJf "$t" -C "$VERL_TREES/$name"
    [ -f "$VERL_TREES/$name/verl/__init__.py" ] || fail "$t holds no verl/ package"
  done
  echo "$digest" >"$stamp"
  echo "install.sh: installed ${#wheels[@]} wheels, $(basename "${rays[0]}"), ${#trees[@]} verl trees" \
       "in $((SECONDS - t0)) s (payload ${digest:0:12})"
fi

[ "$CHECK" = 1 ] || exit 0
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - <<'EOF'
import importlib, sys
import torch, transformers, ray, tensordict, hydra
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
for name in ("transformers", "tokenizers", "huggingface_hub", "peft", "datasets", "ray", "tensordict",
             "torchdata", "hydra", "omegaconf", "numpy", "pandas", "pyarrow", "accelerate"):
    mod = importlib.import_module(name)
    print(f"  {name:<16} {getattr(mod, '__version__', '?'):<12} {mod.__file__}")
EOF
for t in "${trees[@]}"; do
  name=$(basename "$t" .tar.xz)
  PYTHONPATH="$VERL_TREES/$name:$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c '
import sys, verl, verl.trainer.main_ppo
print(f"verl tree {sys.argv[1]}: verl {verl.__version__} from {verl.__file__}; verl.trainer.main_ppo imports")
' "$name"
done
