"""This API process's view of each model's admission queue, for load shedding before admission: the fresh FULL
verdicts of its admissions (a short negative cache, :class:`tasks.policy.refusal.FullVerdictCache`) and where a call
arriving now would stand in the queue (:class:`tasks.policy.room.Room`), judged without asking Redis.

The gateway keeps it up to date (every verdict, every call through admission); the door
(:mod:`webapp.accept_door`) reads it as requests arrive. Both are handed the one object by the process's
composition root (:mod:`webapp.services`).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import redis

from tasks.config import Settings
from tasks.errors import BatchingError, QueueFull
from tasks.gateway.gate import Gate
from tasks.gateway.links import live_workers
from tasks.policy.capacity import deadline_cap, full_batches_margin, left_after, slowest_batch_s, throughput
from tasks.policy.refusal import AdmissionVerdict, FullVerdictCache, admission_refusal, not_served
from tasks.policy.room import Placed, Room
from tasks.policy.shedding import too_slow
from tasks.policy.standing import StandingQueue
from tasks.schema import Priority, WorkerInfo
from tasks.state.fleet import FleetCache

# a request let in by the queue's view stops counting there this long after the door's own bound on its wait (it
# was refused or dropped without a verdict)
ROOM_PENDING_SLACK_S = 0.5
# calls a second one API process takes through admission while others wait, until it has measured its pace over a
# whole window (a 2-core host under a flood: 450-1,200)
ROOM_ADMITS_PER_S = 400.0
# a model not in this process's view of the fleet hash is looked for there again at most this often: a new worker's
# model is served at once, and a flood of made-up names costs a read of the hash a tenth of a second at most
KNOWN_RECHECK_S = 0.1
# the lines of models no live worker serves any more are dropped at most this often (at a verdict)
ROOM_PRUNE_S = 10.0


class AdmissionQueue:
    """Each model's admission queue as this process sees it: what the door refuses a call with on arrival
    (:meth:`place`, :meth:`held_full`), and what admission needs of it (:meth:`model_cap`, :meth:`decided`,
    :meth:`ended`). ``workers``: the live fleet as this process caches it; ``gate``: the turnstile in front of
    admission, whose count of recent callers tells a light tenant (none: no tenant is light)."""

    def __init__(self, settings: Settings, workers: FleetCache, gate: Gate | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.workers = workers
        self.gate = gate
        self.clock = clock
        self.full = FullVerdictCache()  # the fresh FULL verdicts of this process's admissions
        self.room = Room(settings.web.workers, settings.admission.door_max_delay_s + ROOM_PENDING_SLACK_S, clock)
        self.standing = StandingQueue(settings.admission.queue_interval_s, settings.admission.queue_target_s, clock)
        # since when each model's line has held more than its workers take (their outstanding batches) and a full
        # batch each beside: every batch formed meanwhile was full (never standing: only its age is read)
        self.deep = StandingQueue(0.0, 0.0, clock)
        self._pruned_at = clock()

    def cap_for(self, model: str, timeout_s: float, workers: list[WorkerInfo] | None = None,
                deep_for_s: float | None = None) -> int:
        """Items of ``model`` that may be in flight for a new one to be answered within ``timeout_s`` (``workers``:
        the model's live workers, when the caller has them): the whole deadline fit (``LLMB_QUEUE_SHARE``) while
        the model's line is a burst's; while it stands (:class:`tasks.policy.standing.StandingQueue`), the
        standing share's margin, and at most what the fleet answers in ``LLMB_QUEUE_TARGET_MS`` when that is
        set. The door places calls against it and the admission script is given it: one cap. The margin for the
        batches running is one batch time once the line has held more than the workers take long enough for
        those to be full (:func:`tasks.policy.capacity.full_batches_margin`), two before: ``deep_for_s`` is how
        long it will have by then (None: as the admission script's counts have seen it, up to now)."""
        if workers is None:
            workers = [w for w in live_workers(self.workers) if w.model == model]
        admission = self.settings.admission
        if deep_for_s is None:
            deep_for_s = self.deep.busy_for(model)
        margin = full_batches_margin(workers, deep_for_s, self.settings.worker.max_outstanding_batches)
        cap = deadline_cap(workers, timeout_s, admission.cap, admission.queue_share, margin)
        if workers and self.standing.standing(model):  # a standing line keeps the margin (and the target, if set)
            cap = min(cap, deadline_cap(workers, timeout_s, admission.cap, admission.queue_standing_share))
            if admission.queue_target_s > 0:
                cap = min(cap, deadline_cap(workers, admission.queue_target_s + 2 * slowest_batch_s(workers),
                                            admission.cap, 1.0))
        return cap

    def refuse_unknown(self, model: str, named: str | None = None) -> None:
        """Raise ModelNotFound (404) for a model that no worker in the fleet hash serves or lately served, before
        anything is kept for its call (a line here, a held verdict, a turn at the gate, Redis's sets): a flood of
        made-up names leaves nothing behind. A model whose workers are all down is known, and so is the configured
        default model (a fleet not up yet): its call goes on to the gateway's 503. A fleet that cannot be read
        refuses nothing here (that 503 comes later). ``named``: the model as the caller named it (an adapter)."""
        if model == self.settings.models.default_model:
            return
        try:
            if self.workers.knows(model, KNOWN_RECHECK_S):
                return
        except redis.RedisError:
            return
        raise not_served(named or model, [w.model for w in self.workers.last])

    def light(self, tenant: str) -> bool:
        """Whether ``tenant`` sends well under an even share of this process's recent calls (its gate's count)."""
        return self.gate is not None and self.gate.callers.light(tenant)

    def model_cap(self, tenant: str, model: str, remaining_s: float) -> int:
        """The model's cap for a call: the deadline cap (what the fleet can answer within ``remaining_s``), or for
        a light tenant the configured cap. The batchers serve tenants fairly, so a light tenant's items run
        ahead of a flood's queue, and refusing them because the flood filled the model was what the steady
        tenant beside a 5,000-call flood saw (10-54 of its 200 calls 429 queue_full); a light tenant is by
        definition a small share of the calls, so letting it past adds little."""
        if self.light(tenant):
            return self.settings.admission.cap
        return self.cap_for(model, remaining_s)

    def held_full(self, model: str, priority: Priority) -> QueueFull | None:
        """The refusal a call of ``model`` in class ``priority`` gets now without asking Redis (None: ask): the
        last FULL verdict for them, while it is fresh. Idempotent retries are not held (the gateway's ``_enter``)."""
        return self.full.held(model, priority, self.clock())

    def holds_full(self) -> bool:
        """Whether any FULL verdict is fresh: the door looks for one at accept only then."""
        return self.full.any_fresh(self.clock())

    def forming(self) -> bool:
        """Whether calls this process let in on arrival are waiting for admission: only then is an arriving call
        whose body trails its headers worth waiting a moment for (:mod:`webapp.accept_door`)."""
        return self.room.waiting() > 0

    def place(self, model: str, priority: Priority, timeout_s: float,
              waited_s: float = 0.0) -> QueueFull | Placed:
        """Where a call of a heavy caller arriving now stands in its model's queue, as this process sees it
        (:class:`tasks.policy.room.Room`). Its turn at admission comes once the calls this process let in before
        it are through, at the pace it takes calls through. Refused (Overloaded) when that turn would come
        later than the door's bound (``LLMB_DOOR_MAX_DELAY_MS`` from its arrival, ``waited_s`` ago), where the
        door would refuse it then; refused (QueueFull) when the fleet could not answer it within ``timeout_s``
        by the cap the admission script applies, reckoned at its turn (the queue shorter by then by what the
        fleet answers meanwhile: :func:`tasks.policy.capacity.left_after`); otherwise let in and counted ahead of
        the next. Nothing is judged while no live worker of the model is known (its answer comes the usual
        way)."""
        # the process's view of the fleet, kept fresh between calls (webapp.services): no I/O here, where a burst's
        # arrivals are judged in the event loop itself; read there, it failed (gevent cannot switch from the loop),
        # and a process whose view was empty let a whole burst through unjudged
        fleet = self.workers.last
        workers = [w for w in fleet if w.model == model]
        if not workers:
            return Placed.UNKNOWN
        key = (model, priority)
        ahead = self.room.place(key)
        through_per_s = self.room.pace(ROOM_ADMITS_PER_S) or ROOM_ADMITS_PER_S
        turn_s = self.room.waiting() / through_per_s
        bound_s = self.settings.admission.door_max_delay_s
        if bound_s and waited_s + turn_s > bound_s:
            return too_slow(waited_s + turn_s, max(1, math.ceil(turn_s)))
        at_turn = left_after(ahead, workers, turn_s)  # the fleet works through the queue meanwhile
        # a line deeper than the workers take until the call's turn has run full batches by then
        deep_for_s = self.deep.busy_for(model) + turn_s if at_turn > self._taken(workers) else 0.0
        if at_turn + 1 > self.cap_for(model, timeout_s - turn_s, workers, deep_for_s):
            return admission_refusal(AdmissionVerdict.FULL, None, int(ahead), model=model, tenant="", tenant_cap=None,
                                     hashes=(), workers=workers, admission_cap=self.settings.admission.cap,
                                     retry_floor_s=self.settings.admission.retry_after_s)  # type: ignore[return-value]
        self.room.let_in(key)
        return Placed.IN_LINE

    def decided(self, model: str, priority: Priority, verdict: AdmissionVerdict, ahead: int,
                error: BatchingError | None) -> None:
        """An admission verdict for a call of ``model`` in class ``priority``: a FULL one is held for them, and the
        model's count (``ahead``) goes into the queue's view."""
        if verdict is AdmissionVerdict.FULL and isinstance(error, QueueFull):
            self.full.hold(model, priority, error, self.clock())
        if verdict in (AdmissionVerdict.OK, AdmissionVerdict.FULL):
            served = [w for w in self.workers.last if w.model == model]
            self.room.decided((model, priority), ahead, throughput(served))
            if priority == Priority.INTERACTIVE and served:  # whether the line empties: from the script's counts
                self.standing.observe(model, ahead - sum(w.max_batch for w in served))  # alone, not the estimate
                self.deep.observe(model, ahead - self._taken(served))
        now = self.clock()
        if now - self._pruned_at > ROOM_PRUNE_S:  # the lines of models no longer served go
            self._pruned_at = now
            models = {w.model for w in self.workers.last}
            self.room.keep_only(lambda key: isinstance(key, tuple) and key[0] in models)
            self.standing.keep_only(lambda key: key in models)
            self.deep.keep_only(lambda key: key in models)

    def _taken(self, workers: list[WorkerInfo]) -> int:
        """Items beyond which a model's line is deep: what its workers take (their outstanding batches) and one full
        batch each beside, waiting (:func:`tasks.policy.capacity.full_batches_margin`)."""
        return (self.settings.worker.max_outstanding_batches + 1) * sum(w.max_batch for w in workers)

    def ended(self, model: str, priority: Priority) -> None:
        """A call of ``model`` in class ``priority`` is through admission, whatever came of it."""
        self.room.ended((model, priority))
