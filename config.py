"""pyinfra's config file for verl-lab (pyinfra reads ./config.py when run from the repo root).

pyinfra opens SSH connections before any deploy file runs, so a bad inventory value such as a
missing ssh_key file would surface as a connection error without a fix. This hooks the check
of every host's data (tasks.hostdata.check_inventory) into the moment the inventory is loaded,
for the hosts of this run (pyinfra's --limit/--exclude): a value that stops pyinfra from
connecting (``ssh_*``) stops the run here, before any host is contacted, naming the host, the key
and the fix. The other problems are kept: every deploy file's first line reports them, and
deploy/full.py reports them together with what the boxes tell (tasks/base.py ``check_run``), so
one typo does not hide the problems only a box can show. Connecting and asking facts change nothing.
"""

from pyinfra.api.state import State

from tasks.hostdata import InventoryError, check_inventory, report

_pyinfra_state_init = State.init


def _init_then_check_inventory(self, inventory, config, *args, **kwargs):
    _pyinfra_state_init(self, inventory, config, *args, **kwargs)
    run = self.limit_hosts if self.limit_hosts is not None else list(inventory)
    problems = check_inventory(run, stop=False, everyone=list(inventory))
    connecting = [p for p in problems if p.key.startswith("ssh_")]
    if connecting:
        raise InventoryError(report(problems))


State.init = _init_then_check_inventory
