"""Install the CUDA 11.8 toolkit and cuDNN 8.9.7 alone: `pyinfra inventory/lab.py deploy/cuda.py`."""

from tasks.cuda import install_cuda
from tasks.hostdata import check_inventory, settings_for

check_inventory()
install_cuda(settings_for())
