"""Example rollout workflows, named on the command line by import path (`RLConfig.workflow`).

- `multi_turn_math:MultiTurnMathWorkflow`: a wrong answer gets a feedback turn and another try,
  the reward discounted per turn (AReaL's multi-turn math example, written for this system).

The contract a workflow meets is in `areal_jax/rollout/workflow.py`.
"""
