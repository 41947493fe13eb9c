"""deploy/full.py without the env stage: base, CUDA, data, training (bench/fleet_scale.py uses it
where building the Python env on every box would not fit the bench's time on 2 cores; the bench
gives each box the small venv the data stage runs in instead).
Not a bench script itself: `pyinfra INV bench/deploy_without_env.py`."""

from tasks.base import base_layout
from tasks.cuda import install_cuda
from tasks.data.stage import install_data
from tasks.hostdata import check_inventory, settings_for
from tasks.train import install_train

check_inventory()
settings = settings_for()

gpu = base_layout(settings)
if not gpu.refused:
    install_cuda(settings, gpu)
    install_data(settings)
    install_train(settings, gpu)
