"""`areal-jax plan`: compile every program of a run for its target hardware, without the hardware,
and check that each fits its device (plan/job.py), with a roofline throughput prediction."""
