"""Per-token KL estimators (Schulman's k1/k2/k3) between a policy and a reference.

With tokens x sampled from the policy p and log-ratio d = log p(x) - log q(x):
    k1 = d                           unbiased for KL(p || q), high variance, can be < 0
    k2 = d**2 / 2                    biased, low variance, >= 0 (second-order match)
    k3 = exp(-d) - (-d) - 1          unbiased for KL(p || q), >= 0
Works on NumPy and JAX arrays alike (host-side advantages use NumPy, losses use JAX).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(logp, ref_logp, estimator: KLEstimator = "k1"):
    """Per-token KL(p || ref) estimate from log-probs of the sampled tokens.

    Args:
        logp: [...] log-probs of the sampled tokens under the policy p.
        ref_logp: [...] (same shape) log-probs of the same tokens under the reference.
        estimator: "k1", "k2" or "k3" (see module docstring).
    Returns:
        [...] array of the same kind (NumPy or JAX) and shape.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if np.shape(logp) != np.shape(ref_logp):
        raise ValueError(
            f"logp shape {np.shape(logp)} != ref_logp shape {np.shape(ref_logp)}"
        )
    xp = jnp if isinstance(logp, jax.Array) or isinstance(ref_logp, jax.Array) else np
    log_ratio = xp.asarray(logp) - xp.asarray(ref_logp)  # log p/q
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    # k3: q/p - log(q/p) - 1 with log(q/p) = -log_ratio; expm1 keeps precision near 0.
    return xp.expm1(-log_ratio) + log_ratio
