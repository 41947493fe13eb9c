"""The box's route to its Ray cluster's head, for the network-interface choice (tasks/cluster.py)."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

ADDRS_LINE = "@@verl-lab-addrs@@"


class RouteToHead(FactBase[dict[str, str]]):
    """``ip -o route get <head>`` (its error message too: a missing route is an answer) and
    ``ip -o -4 addr show`` (which interface holds an address the route says is this box's own):
    ``{"route": str, "addrs": str}``; both empty (the default) where ``ip`` printed nothing."""

    @staticmethod
    def default() -> dict[str, str]:
        return {"route": "", "addrs": ""}

    def command(self, address: str) -> str:
        return (f"ip -o route get {shlex.quote(address)} 2>&1 || true; echo {ADDRS_LINE}; "
                "ip -o -4 addr show 2>/dev/null || true")

    def process(self, output) -> dict[str, str]:
        lines = [line.rstrip("\n") for line in output]
        cut = lines.index(ADDRS_LINE) if ADDRS_LINE in lines else len(lines)
        return {"route": "\n".join(lines[:cut]).strip(), "addrs": "\n".join(lines[cut + 1:]).strip()}


HOSTS_LINE = "@@verl-lab-hosts@@"


class HostnameLookup(FactBase[dict]):
    """The box's hostname (``hostname``: what NCCL, Gloo and Ray look up), the IPv4 addresses
    ``getent ahostsv4`` resolves it to, in the order a lookup answers them, and ``/etc/hosts``:
    ``{"hostname": str, "resolves": [address, ...], "hosts": str}``; the default, nothing read:
    no hostname, no address, no hosts file."""

    @staticmethod
    def default() -> dict:
        return {"hostname": "", "resolves": [], "hosts": ""}

    def command(self) -> str:
        return ("h=$(hostname 2>/dev/null); echo \"$h\"; [ -z \"$h\" ] || getent ahostsv4 \"$h\" 2>/dev/null "
                f"| awk '!seen[$1]++ {{ print $1 }}'; echo {HOSTS_LINE}; cat /etc/hosts 2>/dev/null || true")

    def process(self, output) -> dict:
        lines = [line.rstrip("\n") for line in output]
        cut = lines.index(HOSTS_LINE) if HOSTS_LINE in lines else len(lines)
        head = [line.strip() for line in lines[:cut] if line.strip()]
        hosts = lines[cut + 1:]
        return {"hostname": head[0] if head else "", "resolves": head[1:],
                "hosts": "\n".join(hosts) + "\n" if hosts else ""}
