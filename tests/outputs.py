"""Backend outputs as tests read them: a generating backend's outputs, each checked to be generated text."""
from __future__ import annotations

from collections.abc import Sequence

from tasks.schema import GenerationOutput


def generated(outputs: Sequence[object]) -> list[GenerationOutput]:
    """``outputs``, every one of them generated text (an ItemError fails the test here, with what it said)."""
    assert all(isinstance(o, GenerationOutput) for o in outputs), outputs
    return [o for o in outputs if isinstance(o, GenerationOutput)]
