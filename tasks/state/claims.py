"""Who runs a batch: an atomic claim per batch id in Redis, so a batch is run or recovered exactly once.

A batch's claim goes from absent to the *run id* of the worker process that started it (``<worker id>/<a
token per process start>``: a worker restarted by its supervisor keeps its worker id but is another run),
then to DONE when its results are written. A batch whose worker is lost is recovered by whoever moves its
claim first:

- absent -> "~s:<token>": it never started (stranded); it is sent elsewhere, and if the lost worker comes
  back and receives it, the claim tells it to skip it;
- <run id> -> "~d:<token>|<run id>" (or "~recovered", when a worker finds it): it was running when its
  worker died; it goes back to the batcher to be split, blaming that run's worker;
- any other value starting with "~": someone already dealt with it; skip.

A run that finds its own run id (its broker connection dropped and the batch was redelivered to it, or it
requeued the batch itself) hears "mine": it did not die, so nobody is blamed.

The token is the id of the recovery message doing the work, so a batcher that crashes half way and gets
the same message again resumes with the same verdict instead of skipping a batch nobody finished.

Claims expire after ``ttl_s`` (they only need to outlive redeliveries).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import redis

from tasks.config import Settings
from tasks.state.keys import Keys
from tasks.state.lua import source

DONE, RECOVERED = "~done", "~recovered"


class ClaimVerdict(StrEnum):
    """What a claim script says to do with a batch (the scripts return these names)."""

    RUN = "run"  # nobody had it: run it
    SKIP = "skip"  # done, recovered or taken back already: leave it
    MINE = "mine"  # this run holds it already (redelivered to it)
    DIED = "died"  # the run named in the claim died holding it
    STRANDED = "stranded"  # it never started: send it elsewhere


@dataclass(frozen=True)
class Claim:
    """A claim script's verdict and, for DIED, the run that died holding the batch."""

    verdict: ClaimVerdict
    owner: str = ""

    @property
    def worker(self) -> str:
        """The worker id of the run that died (a run id is ``<worker id>/<token>``)."""
        return self.owner.split("/", 1)[0]


class Claims:
    def __init__(self, client: redis.Redis, prefix: str, ttl_s: int = 3600) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._for_run = client.register_script(source("claims_for_run"))
        self._for_recovery = client.register_script(source("claims_for_recovery"))

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis) -> Claims:
        return cls(client, Keys.from_settings(settings).claims)

    def key(self, batch_id: str) -> str:
        return f"{self.prefix}:{batch_id}"

    def for_run(self, batch_id: str, run_id: str) -> Claim:
        """A worker about to run a batch: RUN it, SKIP it, MINE (it holds the claim already), or DIED."""
        return _claim(self._for_run(keys=[self.key(batch_id)], args=[run_id, self.ttl_s]))

    def for_recovery(self, batch_id: str, token: str) -> Claim:
        """A batcher taking back a lost worker's batch: STRANDED, DIED (was running) or SKIP."""
        return _claim(self._for_recovery(keys=[self.key(batch_id)], args=[self.ttl_s, token]))

    def restore(self, batch_id: str, run_id: str) -> None:
        """Undo a recovery claim that could not be acted on, so that the next look at it tries again."""
        self.client.set(self.key(batch_id), run_id, ex=self.ttl_s)

    def give_back(self, batch_id: str) -> None:
        """The worker hands a batch back to the batcher: nobody else may recover it too."""
        self.client.set(self.key(batch_id), RECOVERED, ex=self.ttl_s)


def _claim(value: object) -> Claim:
    text = value.decode() if isinstance(value, bytes) else str(value)
    verdict, _, owner = text.partition(":")
    return Claim(ClaimVerdict(verdict), owner)
