"""The Celery app shared by the batcher and the GPU workers.

Batches are Celery tasks (``RUN_BATCH``), so Flower shows every GPU worker and every batch. Requests are
*not* tasks: the batcher consumes them with its own bootstep (:mod:`tasks.broker.consumer`).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from celery import Celery

from tasks.config import Settings
from tasks.schema import Batch

RUN_BATCH = "llmb.run_batch"


def make_celery(settings: Settings) -> Celery:
    app = Celery("llmb", broker=settings.broker.url, set_as_current=True)
    app.conf.update(
        llmb_settings=settings,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,  # outputs travel through Redis keys, not a result backend
        task_acks_late=True,  # a batch is acknowledged after it ran: a crashed worker's batch is redelivered
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=settings.worker.max_outstanding_batches,
        broker_transport_options={"confirm_publish": True},
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_default_queue=settings.batcher_queue,  # never the shared default 'celery' queue
        # Remote control and events per namespace, so two systems on one broker never see each other's
        # workers (and two workers of the same name in different namespaces do not collide).
        control_exchange=settings.broker.namespace,
        event_exchange=f"{settings.broker.namespace}.events",
        task_create_missing_queues=True,
        # GPU worker queues are created on first use, by the worker or by a batcher's send: of the configured
        # type (quorum: Celery then also drops the global QoS that quorum queues do not support).
        task_create_missing_queue_type=settings.broker.queue_type,
        # A host cut off without a word (no FIN, no RST) is noticed by its missed heartbeats: RabbitMQ then
        # closes its connection, so a batcher's requests go to a standby and a worker's batches come back.
        broker_heartbeat=settings.broker.heartbeat_s,
        worker_send_task_events=True,  # Flower
        task_send_sent_event=True,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        # On a lost broker connection keep running the batch (a thread cannot be cancelled anyway): its message
        # comes back, and the claim tells this run the redelivery is its own (tasks.state.claims "mine").
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # After a lost connection Celery cuts the prefetch to what is running and restores it one ack at a time,
        # from the ack's callback, with synchronous basic.qos calls on the event loop. Measured (a GPU worker
        # under 40 requests/s, every broker connection closed): after the reconnect the worker took no batch
        # and sent no ack or AMQP heartbeat for 3 s, until RabbitMQ closed the new connection for missed
        # heartbeats and a second reconnect followed: callers sent 2-5 s after the cut got 504. Our prefetch is
        # already small (LLMB_MAX_OUTSTANDING_BATCHES), so the connection resumes with it at once.
        worker_enable_prefetch_count_reduction=False,
    )
    return app


def register_run_batch(app: Celery, run: Callable[[Batch], dict[str, Any]]) -> None:
    """Define the one Celery task of the system in a GPU worker process: run a batch (``run`` is the worker's
    batch runner). Acknowledged late, after the batch ran, so a batch whose worker died is redelivered."""

    @app.task(name=RUN_BATCH, acks_late=True, ignore_result=True)
    def run_batch(batch: dict[str, Any]) -> dict[str, Any]:
        return run(Batch.from_dict(batch))


def batch_of_task(body: bytes | str) -> Batch | None:
    """The batch inside a ``RUN_BATCH`` task message (protocol 2: [args, kwargs, embed]); None if it is not one."""
    try:
        return Batch.from_dict(json.loads(body)[0][0])
    except (ValueError, KeyError, IndexError, TypeError):
        logging.getLogger("llmb").error("a message in a batch queue is not a batch task; dropping it")
        return None


def settings_of(app: Celery) -> Settings:
    settings = app.conf.get("llmb_settings")
    if not isinstance(settings, Settings):
        raise RuntimeError("this Celery app was not built by tasks.broker.celery_app.make_celery")
    return settings


# For Celery's own tools: `celery -A tasks.broker.celery_app flower` (or `... inspect active`).
app = make_celery(Settings.from_env())
