"""An example lab: edit hostnames and per-host data, then
`pyinfra inventory/lab.py deploy/full.py`.

Groups are free-form; these ones name GPU generations so group_data can tune them.
Every key verl-lab reads, with its default, is in tasks/settings/load.py (DEFAULTS);
site-wide choices go in inventory/group_data/all.py.
"""

# Pascal boxes (Tesla P40): no bf16, no FlashAttention, no vLLM: the plan picks fp32 and HF rollout.
pascal = [
    ("p40-a.lab.example", {"ssh_user": "admin", "ssh_port": 22}),
]

# Turing / Volta boxes: fp16 vLLM rollout, fp32 training.
turing = [
    ("t4-a.lab.example", {"ssh_user": "admin"}),
]

# Ampere and newer: bf16 everywhere.
ampere = [
    ("3090-a.lab.example", {"ssh_user": "admin", "ssh_key": "~/.ssh/id_ed25519"}),
    ("a100-a.lab.example", {"ssh_user": "admin", "artifact_mode": "direct"}),
]
