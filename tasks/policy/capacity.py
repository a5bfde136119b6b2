"""How much work the fleet can take: the arithmetic behind admission and autoscaling (pure).

Both come from the live workers' own measurements (batch size over the moving average of batch time):

- :func:`deadline_cap` is how many items may be in flight for a new request still to be answered in time,
  so overload is refused at once rather than left to time out;
- :func:`left_after` is what is left of a line some seconds from now, the fleet working through it meanwhile;
- :func:`retry_after_s` is when a refused caller should come back: once the work ahead of it has drained at
  the fleet's measured rate;
- :func:`recommended_workers` is the steady-state worker count for a model's arrival rate, the autoscaling
  signal beside the age of the oldest waiting request (``llmb_recommended_workers`` on /metrics);
- for generation models, :func:`token_budget` is the tokens that may be admitted at once (KV memory, not
  compute, caps how many sequences a device holds) and :func:`largest_fit` the most one item may ever take.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from tasks.schema import WorkerInfo


def throughput(workers: Sequence[WorkerInfo]) -> float:
    """Items per second the workers run, from their measured batch times (0 for workers not yet measured)."""
    return sum(w.max_batch / (w.batch_ms_estimate / 1000) for w in workers if w.batch_ms_estimate > 0)


def slowest_batch_s(workers: Sequence[WorkerInfo]) -> float:
    """The longest measured batch time of ``workers``, in seconds: how long a batch may run ahead of a new item."""
    return max(w.batch_ms_estimate for w in workers) / 1000


def deadline_cap(workers: Sequence[WorkerInfo], timeout_s: float, configured: int, share: float,
                 margin_batches: float = 2.0) -> int:
    """How many items may be in flight for a new request to still be answered within ``timeout_s``.

    The fleet's throughput (batch size over measured batch time, summed over live workers) times the time
    the caller is willing to wait less ``margin_batches`` batch times: one full batch per worker, and ``share``
    of the rest (``LLMB_QUEUE_SHARE``); never more than the configured cap. A request beyond it would only wait
    to time out, so it is refused at once instead.

    Two batch times cover any line: the batch running when the request's turn comes, which may hold only a few
    of the items counted in flight, and the request's own batch. Where every running batch is known to be full
    (:func:`full_batches_margin`), one is enough: the items in flight then run in whole batches, the running
    ones among them, so the request's own batch ends at most one batch time after the items ahead of it are
    through at the fleet's rate.

    The rest is margin. :func:`throughput` is the batch rate of the workers' measured run times, which a fleet
    under overload does not quite reach (the gaps between batches; 90-97% busy measured on a saturated 2-core
    host), and an answer still has to get back through an API process that may be short of CPU itself. With
    the whole of it (1.0) on an earlier door, one 250 ms worker's full queue was answered 4.5-5 s after
    admission against a 4.5 s deadline: 504s and answers after the client's deadline. (A share of the whole,
    not of the part beyond the running batches, refused calls at 90% load on 2 workers x 1 s batches.) The
    share's trade-off, measured with today's door, is in the setting's own description.
    """
    rate = throughput(workers)
    if rate <= 0:
        return configured
    floor = sum(w.max_batch for w in workers)
    # an item admitted now waits for those ahead, then for the batch running when its turn comes, then its own
    fits = rate * (timeout_s - margin_batches * slowest_batch_s(workers))
    return min(configured, max(floor, int(floor + (fits - floor) * share)))


def full_batches_margin(workers: Sequence[WorkerInfo], deep_for_s: float, outstanding: int) -> float:
    """The margin in batch times :func:`deadline_cap` needs for a line that has held, for ``deep_for_s`` seconds,
    more items than its workers take (``outstanding`` batches each) and one full batch each beside: one once that
    is ``outstanding`` batch times or longer, two otherwise. A batch starts at most ``outstanding - 1`` batch times
    after it was formed (a worker takes that many beyond the one it runs) and runs one, so every batch running
    after that long a deep line was formed while a full batch was waiting: it is full. Before that a running
    batch may be a burst's first few items (measured: a burst of 3,000 into an idle worker ran batches of 1 and
    16 items before its full ones).

    The second batch time is what a burst lost at its end: with two, the last of 3,000 calls admitted were answered
    0.54 s before their deadlines and the device went idle with callers still in time (the figures with one are
    in docs/benchmarks.md)."""
    if workers and deep_for_s >= max(1, outstanding) * slowest_batch_s(workers):
        return 1.0
    return 2.0


def left_after(ahead: float, workers: Sequence[WorkerInfo], seconds: float) -> float:
    """Of ``ahead`` items in flight or on their way to admission, those still unanswered ``seconds`` from now:
    the fleet works through them meanwhile at its throughput, after two batch times (as in :func:`deadline_cap`:
    the batch running when the first of them arrives, and the first batch of them). A request whose turn at
    admission is a second away finds the line shorter by then: under a 3,000-call burst into an idle worker,
    reckoning its place as if nothing drained refused every call past about 980, while the worker ran out of
    work 1.5 s before the last of them was due."""
    if not workers:
        return ahead
    return max(0.0, ahead - throughput(workers) * max(0.0, seconds - 2 * slowest_batch_s(workers)))


def recommended_workers(rate_per_s: float, workers: Sequence[WorkerInfo], headroom: float) -> int | None:
    """Workers a model needs for its arrival rate: rate x batch time / batch size x headroom, rounded up.

    Batch time and size are the live workers' own (measured EMA and advertised maximum); None when no worker
    has measured a batch yet. At least one while requests arrive; zero when none do (scale to zero is the
    operator's choice: KEDA's ``minReplicaCount``).
    """
    timed = [w for w in workers if w.batch_ms_estimate > 0]
    if not timed:
        return None
    if rate_per_s <= 0:
        return 0
    per_worker = throughput(timed) / len(timed)  # items/s
    return max(1, math.ceil(rate_per_s / per_worker * headroom))


def retry_after_s(ahead: int, workers: Sequence[WorkerInfo], *, floor_s: int = 1, ceiling_s: int = 60) -> int:
    """Seconds a caller refused for room should wait: the ``ahead`` items admitted before it, drained at the
    workers' measured throughput, rounded up (whole seconds: HTTP's Retry-After), between ``floor_s`` and
    ``ceiling_s``. The floor alone while nothing has been measured."""
    rate = throughput(workers)
    if rate <= 0:
        return floor_s
    return int(min(ceiling_s, max(floor_s, math.ceil(ahead / rate))))



def token_budget(workers: Sequence[WorkerInfo], factor: float) -> int:
    """Tokens (prompt + max_tokens) of a generation model that may be admitted at once: its live workers' KV
    caches together, times ``factor`` (work queued for room as it frees); 0 (no token budget) unless every
    worker advertises a KV cache."""
    if not workers or any(w.kv_tokens <= 0 for w in workers):
        return 0
    return int(sum(w.kv_tokens for w in workers) * factor)


def largest_fit(workers: Sequence[WorkerInfo]) -> int:
    """The most tokens one item of this model may hold on any of its workers (context and KV cache); 0 when no
    worker states a limit."""
    fits = []
    for w in workers:
        limits = [x for x in (w.max_context, w.kv_tokens) if x > 0]
        if not limits:
            return 0  # a worker with no stated limit could take anything
        fits.append(min(limits))
    return max(fits, default=0)
