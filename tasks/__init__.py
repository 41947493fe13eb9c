"""verl-lab: provision NVIDIA GPU boxes to train verl PPO, with pyinfra."""
