"""verl-lab's box-side programs: standard library only, shipped to the boxes as they are.

- ``train_launcher.py``: the training launcher (``<train_dir>/train-launcher``), reading the
  box's ``plan.json``, with its parts beside it: ``preflight.py`` (the checks before a run) and
  ``after_run.py`` (whether the run finished, the export and scores after it);
- ``gpu.py``: the GPU reader (nvidia-smi, NVML), the GPU fact's command and parser;
- ``checkpoints.py``: verl's saves and exports under the checkpoint folder and the disk a run
  needs (the preflight's check beside the launcher, the train stage's fact's command and parser),
  the lock of a step folder and the pruning of exports whose save is gone (the export and score
  programs load it from beside them);
- ``vllm_share.py``: vLLM 0.8.5's share arithmetic, the plan's and the launcher's (which sizes the
  share again at start for what other processes hold on the GPUs);
- ``hf_snapshot.py``: a pinned Hugging Face snapshot, fetched, verified, swapped in;
- ``gsm8k.py``: GSM8K in verl's RL format (run with the env's python: it needs pyarrow);
- ``env_prove.py``: the Python env's proofs (run by the env's python).
- ``nvidia_driver.py``: the NVIDIA driver's install, hold, load and proof (the driver stage), with
  ``nvidia_driver_state.py`` (the box read in one command, the load verdict) and
  ``nvidia_driver_apt.py`` (apt's simulation and the package's supported-GPU list judged).

What a module needs beyond the standard library (pyarrow, torch, verl, NVML, huggingface_hub)
is imported inside the function that runs where it exists (tests/unit/test_box_package.py).
"""
