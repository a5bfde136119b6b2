"""Which worker gets the next batch, and when: a pure decision over the fleet view.

Least outstanding *work*, never round-robin. For each worker the scheduler keeps the batches it sent and has
not heard finish, when the running one started, and a moving average of the worker's batch time (workers
announce each batch's start and finish on the fleet exchange). From those it estimates the worker's
backlog: how long until that worker could start one more batch. The batch goes to the worker with the
smallest backlog, so a worker twice as fast drains its backlog twice as fast and receives about twice the
batches.

Two limits keep batches large without letting a device idle:

- at most ``max_outstanding`` batches per worker (default 2: one running, the next waiting);
- a batch is handed to a busy worker only when that worker's backlog is within the lead: the time a
  hand-over takes, capped at a quarter of the worker's batch time (a 20 ms model must not receive its next
  batch 15 ms early, frozen at whatever arrived by then). Until then the batch stays in the batcher and keeps
  filling: waiting behind a busy device costs the items nothing, and they are better off in a larger batch
  than in a small one frozen early.

The lead is learnt per worker, starting from ``lead_s``. A worker says, as it starts a batch that was sent
while it was busy, how long its device had sat free before that batch reached it (``idle_s``). A hand-over
that came late lengthens the lead; one on time shortens it a little, so that about ``late_share`` of the
hand-overs come late (a quantile tracker). On an idle host that settles at a few ms (the items of the last ms
still make the batch); on a saturated one, where the batcher and the broker run late, it grows to what the
hand-over really takes there, instead of leaving the device idle for it between every two batches.

For a generation model whose workers advertise a KV cache (``kv_tokens``, the real limit on how many
sequences a device holds), the scheduler also counts each worker's *KV room*: its budget less the estimated
tokens (prompt + max_tokens, :mod:`tasks.policy.tokens`) of the batches sent to it and not finished. A worker
with no room takes nothing more; among the others, equal backlogs go to the one with the most room; and the
chosen worker's room caps the next batch's tokens (:attr:`Choice.kv_room`).

When no worker can take a batch now, :meth:`choose` says how long until one can (work conservation: the
batcher keeps accumulating meanwhile). ``now`` is the batcher's monotonic clock; an outstanding batch not
heard of for ``forget_after_s`` is forgotten so that a lost announcement cannot block a worker for ever.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from tasks.schema import WorkerInfo


@dataclass
class _Track:
    """What the scheduler knows of one worker."""

    outstanding: dict[str, float] = field(default_factory=dict)  # batch id -> sent at
    tokens: dict[str, int] = field(default_factory=dict)  # batch id -> its estimated tokens (KV it will hold)
    running: str | None = None
    running_since: float = 0.0
    batch_s: float | None = None  # moving average of run time
    last_sent: float = 0.0
    lead_s: float | None = None  # learnt lead (None: the configured one)
    behind: set[str] = field(default_factory=set)  # batches sent while it was busy: their hand-over is timed


@dataclass(frozen=True)
class Choice:
    worker: WorkerInfo | None
    retry_in_s: float | None = None  # with no worker: when one could take a batch (None: on the next event)
    kv_room: int | None = None  # the chosen worker's KV room in tokens (None: it advertises no KV budget)


class Scheduler:
    def __init__(self, max_outstanding: int = 2, lead_s: float = 0.015, forget_after_s: float = 60.0,
                 ema_alpha: float = 0.3, reconcile_margin_s: float = 1.0, *, min_lead_s: float = 0.002,
                 lead_step_s: float = 0.005, late_share: float = 0.1, late_after_s: float = 0.001) -> None:
        if max_outstanding < 1:
            raise ValueError("max_outstanding must be at least 1")
        if not 0 < late_share < 1:
            raise ValueError("late_share must be between 0 and 1")
        self.max_outstanding = max_outstanding
        self.lead_s = lead_s
        self.min_lead_s = min(min_lead_s, lead_s)
        self.lead_step_s = lead_step_s
        self.late_share = late_share
        self.late_after_s = late_after_s  # a device free this long before its batch came: a late hand-over
        self.forget_after_s = forget_after_s
        self.reconcile_margin_s = reconcile_margin_s  # how far two hosts' clocks may disagree
        self.alpha = ema_alpha
        self._tracks: dict[str, _Track] = {}

    def _track(self, worker_id: str) -> _Track:
        track = self._tracks.get(worker_id)
        if track is None:
            track = self._tracks[worker_id] = _Track()
        return track

    # -- estimates -----------------------------------------------------------------------------------
    def batch_s(self, worker: WorkerInfo) -> float:
        """Estimated run time of one batch on ``worker``: measured here, else its heartbeat's figure."""
        measured = self._track(worker.id).batch_s
        return measured if measured is not None else worker.batch_ms_estimate / 1000

    def lead(self, worker: WorkerInfo) -> float:
        """How long before a busy worker could start another batch that batch is handed to it."""
        learnt = self._track(worker.id).lead_s
        lead = self.lead_s if learnt is None else learnt
        est = self.batch_s(worker)
        return min(lead, est / 4) if est > 0 else lead

    def _learn_lead(self, track: _Track, idle_s: float) -> None:
        """One timed hand-over: late ones lengthen the lead, others shorten it (``late_share`` come late)."""
        lead = self.lead_s if track.lead_s is None else track.lead_s
        if idle_s > self.late_after_s:
            lead += self.lead_step_s * (1 - self.late_share)
        else:
            lead -= self.lead_step_s * self.late_share
        est = track.batch_s
        ceiling = est / 4 if est else self.lead_s * 4
        track.lead_s = min(max(lead, self.min_lead_s), max(ceiling, self.min_lead_s))

    def outstanding(self, worker_id: str, now: float) -> int:
        track = self._track(worker_id)
        for batch_id, sent_at in list(track.outstanding.items()):
            if now - sent_at > self.forget_after_s:
                self._forget(track, batch_id)
        return len(track.outstanding)

    def kv_room(self, worker: WorkerInfo) -> int | None:
        """Tokens of KV cache ``worker`` has left for more batches (None when it advertises no KV budget)."""
        if worker.kv_tokens <= 0:
            return None
        track = self._track(worker.id)
        return worker.kv_tokens - sum(track.tokens.get(b, 0) for b in track.outstanding)

    @staticmethod
    def _forget(track: _Track, batch_id: str) -> None:
        track.outstanding.pop(batch_id, None)
        track.tokens.pop(batch_id, None)
        track.behind.discard(batch_id)
        if track.running == batch_id:
            track.running = None

    def backlog_s(self, worker: WorkerInfo, now: float) -> float:
        """Estimated time until ``worker`` could start one more batch."""
        n = self.outstanding(worker.id, now)
        if n == 0:
            return 0.0
        track, est = self._track(worker.id), self.batch_s(worker)
        if track.running is not None:
            remaining = max(0.0, est - (now - track.running_since))
            return remaining + est * (n - 1)
        return est * n  # sent, not started yet

    # -- the decision --------------------------------------------------------------------------------
    def choose(self, workers: Iterable[WorkerInfo], model: str, now: float,
               avoid: Collection[str] = ()) -> Choice:
        """The worker for the next batch of ``model``, or how long until one could take it.

        Workers in ``avoid`` (those a retried batch died on) are passed over while another worker serves the
        model, even a busy one: the batch then waits for it.
        """
        choices, soonest = self.choices(workers, model, now, avoid)
        return choices[0] if choices else Choice(None, soonest)

    def choices(self, workers: Iterable[WorkerInfo], model: str, now: float,
                avoid: Collection[str] = ()) -> tuple[list[Choice], float | None]:
        """Every worker that could take a batch of ``model`` now, best first (:meth:`choose`'s order: least
        backlog, fewest outstanding, most KV room); with none, how long until one could (None: on the next
        event)."""
        candidates = [w for w in workers if w.model == model]
        others = [w for w in candidates if w.id not in avoid]
        able: list[tuple[tuple[float, int, float, float, str], Choice]] = []
        soonest: float | None = None
        for w in others or candidates:
            n = self.outstanding(w.id, now)
            room = self.kv_room(w)
            if room is not None and room <= 0:
                continue  # its KV cache is spoken for: a finished batch frees room (the next event)
            limit = self.max_outstanding + w.slots - 1
            backlog = 0.0 if n < w.slots else self.backlog_s(w, now)
            lead = self.lead(w)
            if n < limit and backlog <= lead:
                fullness = 0.0 if room is None else 1.0 - room / w.kv_tokens
                able.append(((backlog, n, fullness, self._track(w.id).last_sent, w.id), Choice(w, kv_room=room)))
            elif n < limit:
                wait = backlog - lead
                soonest = wait if soonest is None else min(soonest, wait)
        able.sort(key=lambda pair: pair[0])
        return [c for _, c in able], soonest

    def load(self, worker: WorkerInfo, now: float) -> float:
        """The share of ``worker``'s capacity it has outstanding: the estimated tokens of its batches over its KV
        budget (generation models that advertise one), else its batches over the most it may hold."""
        track = self._track(worker.id)
        if worker.kv_tokens > 0:
            return sum(track.tokens.get(b, 0) for b in track.outstanding) / worker.kv_tokens
        return self.outstanding(worker.id, now) / (self.max_outstanding + worker.slots - 1)

    # -- what happened -------------------------------------------------------------------------------
    def sent(self, worker_id: str, batch_id: str, now: float, tokens: int = 0) -> None:
        """A batch went to ``worker_id``; ``tokens``: its estimated KV footprint (0 for a non-generation one)."""
        track = self._track(worker_id)
        if track.outstanding:
            track.behind.add(batch_id)
        track.outstanding[batch_id] = now
        if tokens:
            track.tokens[batch_id] = tokens
        track.last_sent = now

    def started(self, worker_id: str, batch_id: str, now: float, idle_s: float | None = None) -> None:
        """A batch started at ``now``; ``idle_s``: how long the device had been free when it reached the worker
        (None: not measured)."""
        track = self._track(worker_id)
        if batch_id in track.outstanding:
            track.running, track.running_since = batch_id, now
            if batch_id in track.behind and idle_s is not None:
                track.behind.discard(batch_id)
                self._learn_lead(track, idle_s)

    def finished(self, worker_id: str, batch_id: str, run_s: float | None = None) -> bool:
        """Record a finished batch; True if it freed a slot this scheduler was counting."""
        track = self._track(worker_id)
        if run_s is not None and run_s > 0:
            track.batch_s = run_s if track.batch_s is None else track.batch_s + self.alpha * (run_s - track.batch_s)
        was_counted = batch_id in track.outstanding
        self._forget(track, batch_id)
        return was_counted

    def reconcile(self, workers: Iterable[WorkerInfo], wall_to_mono: float) -> None:
        """Forget batches a worker's own heartbeat says are over: it was idle with nothing outstanding at
        ``heartbeat_at`` (its wall clock; ``wall_to_mono`` converts it to ours), so whatever was sent to it more
        than ``reconcile_margin_s`` before then has finished and its announcement was lost (a broker
        connection cut drops the fanout queue it travels on). Without this, lost announcements would hold a
        worker at its outstanding limit until ``forget_after_s``."""
        for w in workers:
            track = self._tracks.get(w.id)
            if track is None or not track.outstanding or w.outstanding or w.state != "idle":
                continue
            seen = w.heartbeat_at + wall_to_mono - self.reconcile_margin_s
            for batch_id in [b for b, sent_at in track.outstanding.items() if sent_at < seen]:
                self._forget(track, batch_id)

    def forget_worker(self, worker_id: str) -> None:
        self._tracks.pop(worker_id, None)
