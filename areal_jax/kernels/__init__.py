"""Attention kernels: paged decode attention and flash attention, a jnp reference and Pallas kernels per platform."""
