"""areal_jax: fully asynchronous RL for LLM reasoning, native to JAX."""

__version__ = "0.1.0"
