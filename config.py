"""pyinfra's config file for verl-lab (pyinfra reads ./config.py when run from the repo root).

pyinfra opens SSH connections before any deploy file runs, so a bad inventory value such as a
missing ssh_key file would surface as a connection error without a fix. This hooks the check
of every host's data (tasks.hostdata.check_inventory) into the moment the inventory is loaded,
for the hosts of this run (pyinfra's --limit/--exclude): a value that stops pyinfra from
connecting (``ssh_*``) stops the run here, before any host is contacted, naming the host, the key
and the fix; so does a ``--limit``/``--exclude`` pattern that matches no host or group (pyinfra only
warns, then runs the other hosts or none). The other problems are kept: every deploy file's first line
reports them, and deploy/full.py reports them together with what the boxes tell (tasks/base.py ``check_run``), so
one typo does not hide the problems only a box can show. Connecting and asking facts change nothing.

It also gives pyinfra's scp client (the relay's transfers: ``ssh_file_transfer_protocol = "scp"``, the
default in inventory/group_data/all.py) more time for each reply of the box's scp: pyinfra 3.10 waits
10 s (``pyinfra.connectors.scp.client.SCPClient``, ``socket_timeout``), and the reply after a file's last
byte comes only once the box has written it, so a busy box or a slow disk failed with "Timeout waiting
for scp response" (seen in the kill drill on a loaded 2-core machine).
"""

import functools

import click
import pyinfra.connectors.ssh as pyinfra_ssh
from pyinfra.api.state import State
from pyinfra.connectors.scp.client import SCPClient

from tasks.hostdata import InventoryError, check_inventory, report, unmatched_limits

_pyinfra_state_init = State.init


def _init_then_check_inventory(self, inventory, config, *args, **kwargs):
    _pyinfra_state_init(self, inventory, config, *args, **kwargs)
    # the patterns as typed: pyinfra's CLI keeps them in its click context (it only warns of one that matches
    # nothing and runs the rest, or no host at all, with exit 0)
    cli = click.get_current_context(silent=True)
    params = cli.params if cli is not None else {}
    wrong = unmatched_limits(inventory, params.get("limit"), params.get("exclude"), self.limit_hosts)
    if wrong:
        raise InventoryError(wrong)
    run = self.limit_hosts if self.limit_hosts is not None else list(inventory)
    problems = check_inventory(run, stop=False, everyone=list(inventory))
    connecting = [p for p in problems if p.key.startswith("ssh_")]
    if connecting:
        raise InventoryError(report(problems))


State.init = _init_then_check_inventory

SCP_REPLY_TIMEOUT_S = 300
pyinfra_ssh.SCPClient = functools.partial(SCPClient, socket_timeout=SCP_REPLY_TIMEOUT_S)
