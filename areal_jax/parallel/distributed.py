"""Multi-controller start-up and small cross-process agreements.

`initialize_distributed` must run before anything touches a JAX backend. `agree_max` /
`agree_sum` / `agree_sum_array` launch a program over every process, so (like any cross-process program)
only the trainer thread may call them, at the same point on every process.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

logger = logging.getLogger(__name__)

# What jax.distributed.initialize raises when no argument was given and no cluster
# environment (TPU pod, SLURM, Open MPI, ...) was detected.
_NO_CLUSTER_MESSAGE = "coordinator_address should be defined"

# Set once auto-detection found no cluster, so later calls stay no-ops even after the
# backend is up (jax.distributed.initialize would then refuse to run).
_single_process = False


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Starts the JAX distributed runtime once; returns whether it is running.

    With all arguments None, cluster parameters are auto-detected (TPU pods, SLURM,
    Open MPI); where nothing is detected the program runs as a single process and this
    returns False. CPU cross-process collectives use gloo unless already configured.
    Calling again after a successful start is a no-op.
    """
    global _single_process
    if jax.distributed.is_initialized():
        return True
    if _single_process:
        return False
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    auto = coordinator is None and num_processes is None and process_id is None
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
        )
    except ValueError as e:
        if auto and _NO_CLUSTER_MESSAGE in str(e):
            logger.info("no cluster environment detected: running as a single process")
            _single_process = True
            return False
        raise
    logger.info(
        "jax.distributed up: process %d of %d", jax.process_index(), jax.process_count()
    )
    return True


def _gather(x: int) -> np.ndarray:
    """This value from every process, indexed by process."""
    if jax.process_count() == 1:
        return np.array([x], dtype=np.int64)
    # int32: x64 is off by default; the counts agreed here (micro-batches, tokens) fit.
    if not -(2**31) <= x < 2**31:
        raise OverflowError(f"{x} does not fit the int32 used to agree across processes")
    gathered = multihost_utils.process_allgather(np.int32(x))
    return np.asarray(gathered).astype(np.int64).reshape(-1)


def agree_max(x: int) -> int:
    """The largest `x` over all processes (e.g. a micro-batch count every host must use)."""
    return int(_gather(int(x)).max())


def agree_sum(x: int) -> int:
    """The sum of `x` over all processes (e.g. the global count of valid tokens)."""
    return int(_gather(int(x)).sum())


def agree_sum_array(x: np.ndarray) -> np.ndarray:
    """The elementwise sum over all processes of a small float vector, in float64 (e.g. the
    partial sums of a statistic over the global batch).

    The float64 bits travel as bytes (x64 is off, so a float array would be gathered in float32)
    and are added in process order on every process: every process gets the same bits."""
    x = np.ascontiguousarray(x, np.float64)
    if jax.process_count() == 1:
        return x.copy()
    gathered = np.asarray(multihost_utils.process_allgather(x.reshape(-1).view(np.uint8)))
    per_process = gathered.reshape(jax.process_count(), -1).view(np.float64)  # [P, x.size]
    total = np.zeros(x.size, np.float64)
    for row in per_process:
        total += row
    return total.reshape(x.shape)


def gather_json(obj: Any) -> list[Any]:
    """`obj` (anything `json.dumps` takes) from every process, indexed by process.

    For host-side results that differ in size between processes (e.g. evaluated samples):
    the UTF-8 encodings are padded to the longest and all-gathered as bytes. Every process must
    call this at the same point."""
    data = json.dumps(obj, allow_nan=True).encode()
    if jax.process_count() == 1:
        return [json.loads(data)]
    width = agree_max(len(data))
    buffer = np.zeros(width, np.uint8)
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buffer)).reshape(jax.process_count(), width)
    # JSON text never holds a NUL byte: the padding is stripped from the end.
    return [json.loads(bytes(row).rstrip(b"\0")) for row in gathered]


def fully_local(tree: Any) -> Any:
    """`tree` with every leaf held whole by this process.

    A leaf that spans processes (training state on a multi-host mesh) is all-gathered and put on
    this process's first device, so every process must call this at the same point; other leaves
    are returned as they are. Evaluation and saving need whole weights, and `jax.device_get`
    refuses an array this process does not fully hold.
    """

    def whole(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(multihost_utils.process_allgather(x, tiled=True), jax.local_devices()[0])
        return x

    return jax.tree.map(whole, tree)
