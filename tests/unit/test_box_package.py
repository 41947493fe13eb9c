"""The box-side package (verl_lab_box/): standard library only, programs not templates.

Every module is shipped to the boxes as it is and runs there with the system's Python or the
training env's. At module level it imports only the standard library and its sibling modules;
what it needs beyond that (pyarrow, torch, verl, NVML, huggingface_hub) is imported inside the
function that runs where that package exists, and is named here (``LATE_IMPORTS``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "verl_lab_box"
MODULES = sorted(PACKAGE.glob("*.py"))
SIBLINGS = {p.stem for p in MODULES} | {"verl_lab_box"}
# module -> what it imports late (inside a function), and where that runs
LATE_IMPORTS = {
    "cluster_check": {"ray"},                                # the env's Ray, on the head
    "cluster_gather": {"ray", "verl_lab_checkpoints"},      # the env's Ray, on the head; checkpoints.py beside it
    "env_prove": {"torch", "vllm", "xformers", "verl"},      # the env's python proves its env
    "env_lock": {"packaging", "pip"},                        # the env's packaging (or pip's copy): its lock
    "export_proof": {"torch", "transformers", "safetensors", "accelerate"},   # the env's python: the export's proof
    "gpu": {"pynvml"},                                       # read_nvml, in the training env
    "nvidia_driver": {"ctypes"},                             # cuInit, where the driver is proven
    "nvidia_driver_state": {"verl_lab_gpu"},                 # gpu.py, shipped beside it on the box
    "gsm8k": {"pyarrow"},                                    # the env's pyarrow (verl's own)
    "gsm8k_score": {"pyarrow", "torch", "transformers", "verl", "vllm"},   # the env's python scores a model
    "lora_export": {"torch", "safetensors", "transformers", "peft"},        # the env's python: a LoRA export
    "hf_snapshot": {"huggingface_hub", "tqdm"},              # fetch: controller, or the env's python
    "preflight": {"torch", "verl"},                          # the launcher's --probe-env, under the env's python
    "burnin_driver": {"ray", "verl"},                        # the burn-in's verl run, under the env's python
    "burnin_probe": {"pynvml"},                              # sitecustomize of the burn-in's processes (the env's)
    "burnin_reward": {"torch", "safetensors"},               # verl's reward manager in the burn-in's TaskRunner
    "burnin_weights": {"torch", "safetensors"},              # the env's python: the saved weights against the model
}


def imports(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(top-level names imported at module level, those imported inside functions)."""
    top, late = set(), set()

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                names = {a.name.split(".")[0] for a in child.names}
            elif isinstance(child, ast.ImportFrom):
                names = {"verl_lab_box"} if child.level else {(child.module or "").split(".")[0]}
            else:
                names = set()
            (late if inner else top).update(names)
            visit(child, inner)

    visit(tree, False)
    return top, late


def test_the_package_holds_the_box_programs():
    assert {"__init__", "gpu", "hf_snapshot", "gsm8k", "env_prove", "train_launcher"} <= {p.stem for p in MODULES}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_module_imports_only_the_standard_library(path):
    top, late = imports(ast.parse(path.read_text(), str(path)))
    allowed = set(sys.stdlib_module_names) | SIBLINGS | {"__future__"}
    assert not top - allowed, f"{path.name} imports {sorted(top - allowed)} at module level"
    extra = late - allowed
    assert extra <= LATE_IMPORTS.get(path.stem, set()), (
        f"{path.name} imports {sorted(extra - LATE_IMPORTS.get(path.stem, set()))} in a function; "
        "name them in LATE_IMPORTS with where they run")


def test_importable_modules_load_without_site_packages():
    """``python -S``: no site-packages at all, so a third-party import at module level fails.
    (env_prove.py is a script: it runs its proofs when loaded.)"""
    names = [p.stem for p in MODULES if p.stem not in ("__init__", "env_prove")]
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import importlib\n"
            f"for name in {names!r}: importlib.import_module('verl_lab_box.' + name)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_no_program_under_templates():
    """files/templates/ holds configuration templates only: the box's programs live in verl_lab_box/."""
    templates = REPO / "files" / "templates"
    programs = [p.name for p in templates.iterdir() if p.name.endswith((".py", ".py.j2"))]
    assert not programs, programs
    for path in MODULES:
        assert templates not in path.resolve().parents, path
