"""The NVIDIA driver alone: `pyinfra inventory/lab.py deploy/driver.py --data driver=install`.

With driver = "check" (the default) the CUDA stage checks the driver; this releases only what an earlier
driver = "install" left, its hold and pin, keeping the driver (docs/driver.md, "Back to check").
"""

from tasks.base import base_layout
from tasks.driver.stage import install_driver
from tasks.hostdata import check_inventory, settings_for

check_inventory()
settings = settings_for()
# the host's GPUs, read once by the base stage; the driver alone needs no training plan
install_driver(settings, base_layout(settings, trains=False))
