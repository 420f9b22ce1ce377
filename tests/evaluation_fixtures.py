"""Reward and answer extractor for the evaluation tests, importable by path (in-process or in pool workers).

Both look only at the completion text, so expected metrics can be recomputed from the JSONL.
The "answer" of a completion is its character count modulo 2 ("0" or "1"), except that a
count divisible by 5 gives no answer (None: no vote in maj@k); it is correct when the answer
equals the row's gold.
"""


def parity_answer(completion: str) -> str | None:
    """"0"/"1": the parity of the completion's character count; None when that count is a multiple of 5."""
    if len(completion) % 5 == 0:
        return None
    return str(len(completion) % 2)


def parity_reward(completion: str, gold: str) -> float:
    """1.0 when `parity_answer(completion)` equals `gold`, else 0.0."""
    return 1.0 if parity_answer(completion) == gold else 0.0


def hang_reward(completion: str, gold: str) -> float:
    """Never answers in time: sleeps a minute (the pool's deadline must cut it short)."""
    import time

    time.sleep(60.0)
    return 1.0
