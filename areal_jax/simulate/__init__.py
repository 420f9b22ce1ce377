"""`areal-jax simulate`: a discrete-event simulation of the asynchronous RL system, calibrated on runs.

Modules, one job each: config (the workload and a row's choices), lengths (rollout dumps and
parametric long tails), events (the clock), costs (fitted linear costs, or the analytic roofline of
a target), generation (one host's engine), system (controllers, channel, trainer), calibrate (the
fit to a run's recorded timings), driver (the command).
"""
