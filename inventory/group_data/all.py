"""Site-wide choices for every box. Defaults live in tasks/settings/load.py (DEFAULTS); set here
only what your site changes. Examples:

    mirror_profile = "cn"                      # hf-mirror, TUNA PyPI, NJU PyTorch, nvidia.cn
    mirror_urls = {"pypi": "http://pypi.internal/simple"}   # replace one source's base URL
    artifact_mode = "direct"                   # each box downloads itself (default: relay)
    env_backend = "venv"                       # use the box's Python >= 3.10 instead of Miniforge
    train_unit_state = "started"               # start training at the end of deploy/full.py
    hf_token_file = "~/.config/verl-lab/hf_token"   # never put the token itself here
"""

# SSH host keys are checked: a box must be in ~/.ssh/known_hosts (or set ssh_known_hosts_file).
ssh_strict_host_key_checking = "yes"

# Upload artifacts with scp rather than pyinfra's default SFTP: measured 2.7x faster for a
# 1 GiB relay push (docs/benchmarks.md). Needs scp on the boxes (openssh-client/server ship it).
ssh_file_transfer_protocol = "scp"
