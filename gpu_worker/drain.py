"""A graceful stop (SIGTERM: a scale-down, a rollout, ``systemctl restart``) that hands everything back.

The order matters, and it is Celery's own warm shutdown with two changes:

1. the moment the stop begins, the worker heartbeats as "draining", so batchers send it nothing more, and
   the runner hands back, unstarted, every batch it has not begun (:meth:`BatchRunner.drain`);
2. Celery stops consuming and its pool finishes the running batch. Celery's thread pool would *cancel* the
   batches already prefetched into it, leaving their messages to return to a queue nobody consumes;
   :class:`DrainingThreadPool` lets them run instead, so each goes through the runner and is handed back;
3. once the pool is done, whatever is still in the worker's queue is handed back too (:func:`empty_queue`),
   and only then does the worker leave the fleet view.

A stop often arrives twice: ``docker stop`` or systemd signal the whole process group, and the supervisor
forwards its own SIGTERM too. Celery's handler is not reentrant (it takes a lock inside ``signals.send``), so
a second SIGTERM landing inside the first would deadlock the worker; :func:`hear_sigterm_once` ignores every
SIGTERM after the first, as Celery's warm shutdown means to.

Batches a batcher sends after step 3 are taken back by that batcher from its own memory when it sees the
worker gone (:mod:`tasks.broker.recovery`). Nothing is lost at any step, and nobody is blamed: handed-back batches
go again whole, charged no retry.
"""
from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType

from celery.concurrency.base import BasePool
from celery.concurrency.thread import TaskPool
from kombu import Connection

from tasks.broker.celery_app import batch_of_task
from tasks.schema import Batch, Failure

log = logging.getLogger("llmb.worker")

HandBack = Callable[[Batch, Failure, str, str], None]


class DrainingThreadPool(TaskPool):
    """Celery's thread pool, except that stopping runs the tasks already handed to it instead of cancelling
    them (the runner, draining by then, hands each unstarted batch back in a few milliseconds)."""

    def on_stop(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=False)
        BasePool.on_stop(self)


def empty_queue(broker_url: str, queue: str, hand_back: HandBack, worker_id: str) -> int:
    """Hand back every batch left in this worker's queue; returns how many. Each message is acknowledged only
    after its batch was handed back."""
    count = 0
    with Connection(broker_url, connect_timeout=5) as conn:
        channel = conn.channel()
        while (message := channel.basic_get(queue, no_ack=False)) is not None:
            batch = batch_of_task(message.body)
            if batch is not None:
                hand_back(batch, Failure.RETURNED, f"worker {worker_id} was stopping", worker_id)
                count += 1
            channel.basic_ack(message.delivery_tag)
    return count


def hear_sigterm_once() -> None:
    """Wrap the SIGTERM handler Celery installed so that only the first SIGTERM reaches it (main thread only)."""
    celery_handler = signal.getsignal(signal.SIGTERM)
    if not callable(celery_handler):
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # first, before anything that could take a lock
        celery_handler(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
