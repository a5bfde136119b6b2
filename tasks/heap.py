"""The garbage collector of a long-running process, set once it has started.

Measured under load (three times the capacity of one 250 ms device): an API process's full collections took
65-250 ms every few seconds, and every caller waiting in that process, every refusal included, waited that long
with it (429s answered in p99 0.5-0.9 s). What a full collection scans is mostly what the process built as it
started (modules, the app, its clients, a model's Python objects), none of which ever becomes garbage;
:func:`settle` moves it out of the collector's sight (``gc.freeze``), so that a full collection looks only at what
was made since.
"""
import gc


def settle() -> None:
    """Collect what start-up left behind, then freeze the rest: call once the process is ready to serve."""
    gc.collect()
    gc.freeze()
