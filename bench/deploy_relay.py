"""One artifact onto each box through tasks.artifacts.artifact_file (bench/artifact_relay.py
uses it with the cuda_runfile artifact replaced by a 1 GiB file). Not a bench script itself:
`pyinfra INV bench/deploy_relay.py`."""

from tasks.artifacts import artifact_file
from tasks.hostdata import check_inventory, settings_for

check_inventory()
artifact_file(name="bench: relay cuda_runfile", settings=settings_for(), artifact="cuda_runfile")
