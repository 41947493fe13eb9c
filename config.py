"""pyinfra's config file for verl-lab (pyinfra reads ./config.py when run from the repo root).

pyinfra opens SSH connections before any deploy file runs, so a bad inventory value such as a
missing ssh_key file would surface as a connection error without a fix. This hooks the check
of every host's data (tasks.hostdata.check_inventory) into the moment the inventory is loaded:
a bad value stops the run before any host is contacted, naming the host, the key and the fix.
"""

from pyinfra.api.state import State

from tasks.hostdata import check_inventory

_pyinfra_state_init = State.init


def _init_then_check_inventory(self, inventory, config, *args, **kwargs):
    _pyinfra_state_init(self, inventory, config, *args, **kwargs)
    check_inventory(inventory)


State.init = _init_then_check_inventory
