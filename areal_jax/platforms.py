"""Which jax platforms a command starts, chosen before jax is imported.

jax initialises every installed PJRT plugin on first use. On a machine with no GPU or TPU, the
CUDA plugin (installed by the [plan] and [test] extras) prints a cuDNN traceback and libtpu an
INVALID_ARGUMENT error before falling back to the CPU: noise that looks like a failure. When no
accelerator device is present and the user has not set JAX_PLATFORMS, commands run with
JAX_PLATFORMS=cpu, so those plugins are never initialised. `areal-jax plan` is unaffected: it
compiles for its target through the plugins' compilers directly (plan/targets.py), not through
a jax platform. Imports nothing heavy.
"""

from __future__ import annotations

import glob
import os

__all__ = ["accelerator_present", "choose_platforms"]

# Device nodes of the accelerators jax's plugins drive: NVIDIA GPUs, TPU (v2-v4 /dev/accel*,
# v5+ through VFIO), AMD GPUs (ROCm).
_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd")


def accelerator_present() -> bool:
    """Whether this machine exposes a GPU or TPU device node (or says it is a TPU VM)."""
    if os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() not in ("", "-1"):
        return True
    return any(glob.glob(pattern) for pattern in _DEVICE_NODES)


def choose_platforms() -> str | None:
    """Sets JAX_PLATFORMS=cpu when unset and no accelerator is present; returns the value set
    (None: left to the user's setting or to jax's own choice)."""
    if "JAX_PLATFORMS" in os.environ or accelerator_present():
        return None
    os.environ["JAX_PLATFORMS"] = "cpu"
    return "cpu"
