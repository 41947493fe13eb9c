"""Provision every box end to end: `pyinfra -y inventory/lab.py deploy/full.py`.

Stages run in this order; each is idempotent alone and has its own deploy file
(deploy/cuda.py, env.py, data.py, train.py). A box whose env is broken gets it rebuilt
beside the old one (the env stage swaps only after the new env passes its proofs).
"""

from tasks.base import base_layout
from tasks.cuda import install_cuda
from tasks.hfdata import install_data
from tasks.hostdata import check_inventory, settings_for
from tasks.pyenv import python_env
from tasks.training import install_training

check_inventory()
settings = settings_for()

gpu = base_layout(settings)        # the host's GPU target, decided once for every stage
install_cuda(settings, gpu)
python_env(settings, gpu)
install_data(settings)
install_training(settings, gpu)
