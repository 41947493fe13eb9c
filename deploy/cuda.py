"""Install the CUDA 11.8 toolkit and cuDNN 8.9.7 alone: `pyinfra inventory/lab.py deploy/cuda.py`."""

from tasks.base import base_layout
from tasks.cuda import install_cuda
from tasks.hostdata import check_inventory, settings_for

check_inventory()
settings = settings_for()
# the host's target: GPU and host compiler, decided once; the toolkit alone needs no training plan
# (a build box without a GPU installs it with allow_no_driver)
install_cuda(settings, base_layout(settings, trains=False))
