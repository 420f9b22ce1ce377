"""The simulator costs a training step from `microbatch_shapes_for_lengths`: it must be the trainer's layout."""

import numpy as np
import pytest

from areal_jax.trainer.batching import make_microbatches, microbatch_shapes_for_lengths


def _seqs(lengths):
    return [{"input_ids": np.zeros(n, np.int32), "loss_mask": np.ones(n, np.float32)} for n in lengths]


@pytest.mark.parametrize("seed,row_multiple,minibatches", [(0, 1, 1), (1, 2, 2), (2, 1, 4)])
def test_shapes_are_make_microbatches_shapes(seed, row_multiple, minibatches):
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in np.minimum(rng.geometric(1 / 90, size=96) + 20, 1000)]
    built = make_microbatches(_seqs(lengths), max_tokens_per_microbatch=1024, num_minibatches=minibatches,
                              row_multiple=row_multiple)
    shapes = microbatch_shapes_for_lengths(lengths, max_tokens_per_microbatch=1024, num_minibatches=minibatches,
                                           row_multiple=row_multiple)
    assert shapes == [[mb.shape for mb in minibatch] for minibatch in built]
    assert sum(len(m) for m in shapes) > minibatches  # several micro-batches: the comparison means something
