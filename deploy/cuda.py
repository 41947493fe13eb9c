"""Install the CUDA 11.8 toolkit and cuDNN 8.9.7 alone: `pyinfra inventory/lab.py deploy/cuda.py`."""

from tasks.cuda import install_cuda
from tasks.hostdata import check_inventory, settings_for
from tasks.target import read_gpu

check_inventory()
settings = settings_for()
install_cuda(settings, read_gpu(settings))
