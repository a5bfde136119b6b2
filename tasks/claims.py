"""Who runs a batch: an atomic claim per batch id in Redis, so a batch is run or recovered exactly once.

A batch's claim goes from absent to the id of the worker that started it, then to DONE when its results
are written. A batch whose worker is lost is recovered by whoever moves its claim first:

- absent -> "~s:<token>": it never started (stranded); it is sent elsewhere, and if the lost worker comes
  back and receives it, the claim tells it to skip it;
- <worker> -> "~d:<token>" (or RECOVERED, when a worker finds it): it was running when its worker died;
  it goes back to the batcher to be split;
- any other value starting with "~": someone already dealt with it; skip.

The token is the id of the recovery message doing the work, so a batcher that crashes half way and gets
the same message again resumes with the same verdict instead of skipping a batch nobody finished.

Claims expire after ``ttl_s`` (they only need to outlive redeliveries).
"""
from __future__ import annotations

import redis

DONE, RECOVERED = "~done", "~recovered"

# KEYS[1] claim; ARGV[1] worker id; ARGV[2] ttl -> "run" | "skip" | "died"
_FOR_RUN = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 'run' end
local owner = redis.call('GET', KEYS[1])
if owner == false or string.sub(owner, 1, 1) == '~' then return 'skip' end
redis.call('SET', KEYS[1], '~recovered', 'EX', ARGV[2])
return 'died'
"""

# KEYS[1] claim; ARGV[1] ttl; ARGV[2] token -> "stranded" | "died" | "skip"
_FOR_RECOVERY = """
if redis.call('SET', KEYS[1], '~s:' .. ARGV[2], 'NX', 'EX', ARGV[1]) then return 'stranded' end
local owner = redis.call('GET', KEYS[1])
if owner == '~s:' .. ARGV[2] then return 'stranded' end
if owner == '~d:' .. ARGV[2] then return 'died' end
if owner == false or string.sub(owner, 1, 1) == '~' then return 'skip' end
redis.call('SET', KEYS[1], '~d:' .. ARGV[2], 'EX', ARGV[1])
return 'died'
"""


class Claims:
    def __init__(self, client: redis.Redis, prefix: str, ttl_s: int = 3600) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._for_run = client.register_script(_FOR_RUN)
        self._for_recovery = client.register_script(_FOR_RECOVERY)

    def key(self, batch_id: str) -> str:
        return f"{self.prefix}:{batch_id}"

    def for_run(self, batch_id: str, worker_id: str) -> str:
        """A worker about to run a batch: 'run' it, 'skip' it, or report that its last runner 'died'."""
        return _text(self._for_run(keys=[self.key(batch_id)], args=[worker_id, self.ttl_s]))

    def for_recovery(self, batch_id: str, token: str) -> str:
        """A batcher taking back a lost worker's batch: 'stranded', 'died' (was running) or 'skip'."""
        return _text(self._for_recovery(keys=[self.key(batch_id)], args=[self.ttl_s, token]))

    def restore(self, batch_id: str, worker_id: str) -> None:
        """Undo a recovery claim that could not be acted on, so that the next look at it tries again."""
        self.client.set(self.key(batch_id), worker_id, ex=self.ttl_s)

    def give_back(self, batch_id: str) -> None:
        """The worker hands a batch that raised back to the batcher: nobody else may recover it too."""
        self.client.set(self.key(batch_id), RECOVERED, ex=self.ttl_s)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
