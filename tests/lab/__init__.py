"""verl-lab's lab in a box: Debian boxes booted with systemd-nspawn, reached over ssh, with
a local mirror and a stand-in nvidia-smi, driven by the real pyinfra. See tests/lab/lab.py."""

from tests.lab.box import Box, BoxError, BoxSpec
from tests.lab.gpus import GPUS, GpuModel
from tests.lab.lab import Lab, requirements_missing
from tests.lab.mirror import Mirror
from tests.lab.results import DeployResult

__all__ = ["Lab", "BoxSpec", "DeployResult", "Box", "BoxError", "GPUS", "GpuModel", "Mirror",
           "requirements_missing"]
