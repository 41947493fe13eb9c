"""One workstation, provisioned in place: `pyinfra inventory/local.py deploy/full.py`
(same as `pyinfra @local deploy/full.py`, but this one also reads inventory/group_data/)."""

workstation = [("@local", {})]
