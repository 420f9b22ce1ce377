"""Cheap rewards for system benchmarks (throughput, not learning): importable by path."""


def parity_reward(completion: str, answer: object) -> float:
    """1.0 when the completion has an even number of characters: mixed groups, no verifier cost."""
    return float(len(completion) % 2 == 0)
