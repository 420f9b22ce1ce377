"""A reward for the resume tests, imported by path ("tests.resume_fixtures:digit_share").

The tests' tiny policy never answers an arithmetic problem right, so the task's own reward is 0
for every sample: zero advantages, zero loss and gradients, and an optimizer state that a resume
could lose unnoticed. This reward varies between samples and depends only on the text.
"""


def digit_share(completion: str, gold: object = None) -> float:
    """The fraction of the completion's characters that are digits (0 for an empty one)."""
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0
