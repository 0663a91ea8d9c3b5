"""The environment GPU workers get beyond ``CUDA_VISIBLE_DEVICES`` (driver side).

Each variable is a default: a value the user set (the driver's environment for a local
agent, ``RunConfig`` env vars everywhere) wins.

- ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: a host list's ``gpus=`` ids, a sweep's GPU ids and
  ``nvidia-smi`` number GPUs in PCI bus order, but CUDA numbers them fastest first by default,
  so on a machine with two kinds of GPUs ``CUDA_VISIBLE_DEVICES=1`` would pick another GPU than
  ``nvidia-smi`` shows as 1.
- Workers that share a GPU (``resources_per_worker={"GPU": 0.5}``): JAX takes 75% of its GPU's
  memory at its first use and TensorFlow nearly all of it, so the second worker on the GPU
  fails out of memory. JAX gets ``XLA_PYTHON_CLIENT_MEM_FRACTION`` at its share of its default
  (0.75 x the worker's share of the GPU), TensorFlow ``TF_FORCE_GPU_ALLOW_GROWTH=true``.
"""

from __future__ import annotations

__all__ = ["JAX_DEFAULT_FRACTION", "set_gpu_defaults"]

# The share of a GPU's memory JAX preallocates in a process of its own.
JAX_DEFAULT_FRACTION = 0.75


def set_gpu_defaults(env: dict[str, str], gpus_per_worker: float) -> None:
    """Add to ``env`` (a GPU worker's environment) the defaults above that it does not set."""
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if 0 < gpus_per_worker < 1:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{JAX_DEFAULT_FRACTION * gpus_per_worker:.3g}")
        env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
