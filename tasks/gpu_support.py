"""Which GPUs the pinned stack can run at all, and why not the others (pure).

Two rules, each from a fact of the stack (docs/gpu-support.md gives the sources):

* **kernels**: torch 2.6.0+cu118 carries GPU code for the archs of the catalog's
  ``torch.cuda_archs`` (3.7, 5.0, 6.0, 7.0, 7.5, 8.0, 8.6, 9.0) and no PTX. A GPU of compute
  capability X.Y runs it only where an arch X.Z with Z <= Y is listed (a cubin runs on its own
  major only, at its minor or above): 3.0/3.2/3.5 and every Blackwell GPU (10.x, 12.x) have none.
* **driver**: CUDA 11.8 needs a driver >= the catalog's ``cuda_runfile.min_driver``
  (520.61.05). NVIDIA's last driver branch for Fermi (2.x) is R390 and for Kepler (3.x) R470,
  both older: no driver a Kepler GPU runs under is one CUDA 11.8 is supported on. CUDA 11.x's
  minor-version compatibility (11.x user-space libraries on a >= 450.80.02 driver, with a limited
  feature set) is not relied on: the pinned cuDNN (8.9.7 in the toolkit, 9.1 in torch's wheels)
  supports compute capability 5.0 and up only, and the CUDA stage refuses drivers below 520.61.05.

``refusal(ccs)`` is what every plan asks first (``tasks.plan.make_plan``), so the CLI, the
validation before any host changes and the training stage refuse the same GPUs with the same words.
"""

from __future__ import annotations

from collections.abc import Iterable

# (lowest compute capability, architecture, NVIDIA's last driver branch for it; None: current)
ARCHITECTURES: tuple[tuple[tuple[int, int], str, int | None], ...] = (
    ((2, 0), "Fermi", 390),
    ((3, 0), "Kepler", 470),
    ((5, 0), "Maxwell", 580),
    ((6, 0), "Pascal", 580),
    ((7, 0), "Volta", 580),
    ((7, 5), "Turing", None),
    ((8, 0), "Ampere", None),
    ((8, 9), "Ada Lovelace", None),
    ((9, 0), "Hopper", None),
    ((10, 0), "Blackwell", None),
)
DRIVER_BRANCH_MAX_OLD_GPUS = 580       # the last branch for Maxwell, Pascal and Volta (tasks/cuda.py reads it)


def architecture(cc: tuple[int, int]) -> tuple[str, int | None]:
    """The GPU architecture of a compute capability and its last driver branch (None: current)."""
    found = ("older than Fermi", 340)
    for lowest, name, branch in ARCHITECTURES:
        if cc >= lowest:
            found = (name, branch)
    return found


def _sm(cc: tuple[int, int]) -> str:
    return f"sm_{cc[0]}{cc[1]}"


def torch_archs(catalog=None) -> list[tuple[int, int]]:
    from tasks.catalog import default_catalog
    from verl_lab_box.gpu import parse_compute_capability

    torch = (catalog or default_catalog()).artifact("torch")
    return sorted(parse_compute_capability(str(a)) for a in torch.get("cuda_archs") or ())


def min_driver(catalog=None) -> str:
    from tasks.catalog import default_catalog

    return str((catalog or default_catalog()).artifact("cuda_runfile").get("min_driver"))


def supported_range(archs: list[tuple[int, int]], needed_branch: int) -> str:
    """The compute capabilities both rules allow, in words (for the fix)."""
    ok = [a for a in archs if (architecture(a)[1] or 10 ** 6) >= needed_branch]
    low, high = ok[0], ok[-1]
    return (f"compute capability {low[0]}.{low[1]} to {high[0]}.x ({architecture(low)[0]} to "
            f"{architecture(high)[0]})")


def refusal(ccs: Iterable[str], catalog=None) -> tuple[str, str] | None:
    """(reason, fix) where one of the compute capabilities ``ccs`` (a box's, e.g. "3.7") cannot run
    the pinned stack; None when every one can."""
    from verl_lab_box.gpu import parse_compute_capability

    archs, needs = torch_archs(catalog), min_driver(catalog)
    needed_branch = int(needs.split(".")[0])
    reasons = []
    for text in sorted(set(ccs), key=parse_compute_capability):
        cc = parse_compute_capability(text)
        name, branch = architecture(cc)
        if branch is not None and branch < needed_branch:
            reasons.append(f"compute capability {text} ({name}): NVIDIA's last driver branch for {name} GPUs is "
                           f"R{branch}, older than CUDA 11.8 needs (>= {needs}); the pinned cuDNN supports "
                           "compute capability 5.0 and up only, so CUDA 11's minor-version compatibility does not "
                           "rescue it (docs/gpu-support.md)")
        if not any(a[0] == cc[0] and a[1] <= cc[1] for a in archs):
            listed = ", ".join(_sm(a) for a in archs)
            reasons.append(f"compute capability {text} ({name}): torch 2.6.0+cu118 ships GPU code for {listed} "
                           f"and no PTX, none of which runs on {_sm(cc)}"
                           + (" (CUDA 11.8 predates it)" if cc[0] > archs[-1][0] else ""))
    if not reasons:
        return None
    return ("the pinned stack (torch 2.6.0+cu118, CUDA 11.8) cannot run this GPU: " + "; ".join(reasons) + ".",
            f"train on GPUs of {supported_range(archs, needed_branch)}, or leave this box out of the inventory")
