"""The jobs the CLI runs (train = optional SFT warm start + async RL), built from gin configs."""
