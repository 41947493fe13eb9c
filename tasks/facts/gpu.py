"""The GPU fact: every NVIDIA GPU of a box and its driver, from one nvidia-smi call.

The command, its parsing and the ``Gpu`` / ``GpuInventory`` records are box-side code,
standard library only (``verl_lab_box/gpu.py``, also shipped beside the training launcher);
this module is the pyinfra fact around them. Their names stay importable from here.
"""

from __future__ import annotations

from pyinfra.api import FactBase

from verl_lab_box.gpu import (  # noqa: F401  (re-exported: the GPU fact's vocabulary)
    GPU_NAME_TABLE,
    QUERY_FIELDS,
    QUERY_FIELDS_OLD_DRIVER,
    Gpu,
    GpuInventory,
    compute_capability_from_name,
    driver_view,
    fact_command,
    parse_compute_capability,
    parse_fact_output,
    parse_gpu_query,
    parse_proc_driver_version,
    parse_smi_banner,
    query_command,
    read_nvml,
)


class NvidiaGpus(FactBase[GpuInventory]):
    """Every NVIDIA GPU of the box and its driver, as a ``GpuInventory``: the one GPU fact.

    A box with no nvidia-smi, no loaded driver or no GPU returns an inventory with
    ``problem`` set and no GPUs (and, where the GPU query failed, the driver version from
    nvidia-smi's banner or /proc: ``driver_view``); a driver without the ``compute_cap``
    field gets the compute capability from the GPU name table, noted in ``notes``. The
    default, no output at all: an inventory with no GPUs and the problem that says so.
    """

    @staticmethod
    def default() -> GpuInventory:
        return parse_fact_output("")

    def command(self) -> str:
        return fact_command()

    def process(self, output) -> GpuInventory:
        return parse_fact_output("\n".join(output))
