"""`gpu-worker`: one worker pinned to one device, consuming its own batch queue.

    gpu-worker --gpu 0                 # queue <namespace>.gpu.<host>.0, sim backend
    gpu-worker --gpu 1 --backend sim   # a second device on the same host

``--gpu N`` sets CUDA_VISIBLE_DEVICES=N before any model code is imported, so the process sees exactly one
device (it runs on the CPU where there is none). By default the command supervises the worker process and
restarts it if the model kills it (see :mod:`gpu_worker.supervisor`). A second worker for a device that a live
worker holds refuses to start, naming the holder, with exit code 3 (see :mod:`gpu_worker.device_lock`).
"""
from __future__ import annotations

import os
import socket
import sys

import click

DEVICE_SWITCH_INTERVAL_S = 0.0005  # the GIL's hand-over interval in a worker process (Python's default: 5 ms)


@click.command()
@click.option("--gpu", "device", default=0, show_default=True, type=click.IntRange(min=0),
              help="Device index; sets CUDA_VISIBLE_DEVICES.")
@click.option("--backend", default="sim", show_default=True,
              type=click.Choice(["sim", "sim-lm", "hf-causal", "hf-embed"]), help="Model backend.")
@click.option("--model", default=None,
              help="hf-*: a hub id or a local folder (hf-embed defaults to the packaged all-MiniLM-L6-v2); "
                   "sim: the name to serve.")
@click.option("--host", default=socket.gethostname(), show_default=True, help="Host name used in the queue name.")
@click.option("--queue", default=None, help="Batch queue to consume (default: <namespace>.gpu.<host>.<gpu>).")
@click.option("--supervise/--no-supervise", default=True, show_default=True,
              help="Run the worker as a child process and restart it if it dies.")
def main(device: int, backend: str, model: str | None, host: str, queue: str | None, supervise: bool) -> None:
    """Run one GPU worker: one batch at a time, results to Redis, heartbeats to the fleet view."""
    if supervise:
        from gpu_worker.supervisor import supervise as run_supervised
        from tasks.config import Settings
        from tasks.logs import setup_logging

        setup_logging(Settings.from_env())
        argv = [sys.executable, "-m", "gpu_worker", *sys.argv[1:], "--no-supervise"]
        sys.exit(run_supervised(argv))
    os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
    run_worker(device, backend, model, host, queue)


def run_worker(device: int, backend: str, model: str | None, host: str, queue: str | None) -> None:
    from celery import signals

    from gpu_worker.backends.interface import NO_ADAPTERS, NO_PREFIX_CACHE
    from gpu_worker.backends.registry import load_backend
    from gpu_worker.cancellations import Cancellations
    from gpu_worker.device_lock import DeviceLock, DeviceTaken
    from gpu_worker.device_slots import HOST_THREADS
    from gpu_worker.drain import empty_queue, hear_sigterm_once
    from gpu_worker.heartbeat import Announcer, GiveBack, HeartbeatStep, WorkerRuntime
    from gpu_worker.runner import BatchRunner
    from gpu_worker.supervisor import CANNOT_START, DEVICE_TAKEN
    from gpu_worker.worker_state import WorkerState, measure_full_batch
    from tasks import tracing
    from tasks.broker.celery_app import make_celery, register_run_batch
    from tasks.broker.queues import recovery_queue
    from tasks.config import Settings
    from tasks.heap import settle
    from tasks.logs import setup_logging
    from tasks.state.claims import Claims
    from tasks.state.clock import SharedClock
    from tasks.state.connect import redis_client
    from tasks.state.fleet import Fleet
    from tasks.state.keys import Keys
    from tasks.state.metrics import Stats
    from tasks.state.results import ResultWriter
    from tasks.store.ledger_writer import LedgerWriter

    settings = Settings.from_env()
    setup_logging(settings)
    tracing.setup("llmb-worker")
    queue = queue or settings.gpu_queue(host, device)
    worker_id = f"gpu{device}@{host}"
    client = redis_client(settings, socket_timeout=5, socket_connect_timeout=2)
    # Before the model loads, and before anything is written under this worker's name (heartbeat, queue,
    # Celery's remote-control queue): one worker per device.
    device_lock = DeviceLock.from_settings(settings, worker_id, queue, client)
    try:
        device_lock.acquire()
    except DeviceTaken as exc:
        click.echo(f"gpu-worker: {exc}", err=True)
        sys.exit(DEVICE_TAKEN if exc.alive else 1)  # looks dead: the supervisor tries again after a pause
    try:
        model_backend = load_backend(backend, settings, model, device)
    except Exception as exc:  # a worker that cannot load its model must not start half-alive
        click.echo(f"gpu-worker: cannot load backend {backend!r}: {exc}", err=True)
        sys.exit(CANNOT_START)

    app = make_celery(settings)
    state = WorkerState(clock=SharedClock.from_settings(settings, client))
    measure_full_batch(model_backend, state)
    stats = Stats.from_settings(settings, client)
    ledger = LedgerWriter.from_settings(settings, on_drop=lambda n: stats.add("ledger_dropped", n))
    runner = BatchRunner(
        model_backend,
        ResultWriter.from_settings(settings, client, count=True),
        worker_id, state,
        announce=Announcer(settings.broker.url, settings.broker.namespace),
        claims=Claims.from_settings(settings, client),
        give_back=GiveBack(app, recovery_queue(settings.recovery_queue, settings.broker.queue_type), worker_id),
        record=ledger.record,
        observe=stats.observe_batch,
        cancelled=Cancellations(client, Keys.from_settings(settings).cancel),
    )
    fleet = Fleet.from_settings(settings, client)
    runtime = WorkerRuntime(worker_id, queue, model_backend.name, model_backend.max_batch, fleet, state, settings,
                            model_backend.kind, model_backend.max_context, model_backend.slots,
                            getattr(model_backend, "kv_tokens", 0), getattr(model_backend, "kv_used", lambda: 0),
                            getattr(model_backend, "prefix_cache", lambda: NO_PREFIX_CACHE),
                            getattr(model_backend, "adapters", lambda: NO_ADAPTERS))
    app.conf["llmb_worker"] = runtime
    app.steps["worker"].add(HeartbeatStep)

    # A graceful stop hands back everything this worker holds before it leaves the fleet (gpu_worker.drain).
    @signals.worker_ready.connect
    def _sigterm_once(**_: object) -> None:  # Celery's handlers are installed by now
        hear_sigterm_once()
        settle()  # the model is loaded and the consumer started: out of the garbage collector's full collections
        runtime.ready()  # sent right after the consumer's basic.consume: batches may come

    @signals.worker_shutting_down.connect
    def _begin_drain(**_: object) -> None:
        runner.drain()
        runtime.begin_drain()

    @signals.worker_shutdown.connect
    def _finish_drain(**_: object) -> None:
        try:
            handed = empty_queue(settings.broker.url, queue, runner.give_back, worker_id)
            if handed:
                click.echo(f"gpu-worker: handed back {handed} queued batch(es) before leaving", err=True)
        except Exception as exc:  # the batchers take back what is left when they see this worker gone
            click.echo(f"gpu-worker: could not empty {queue} ({exc}); the batchers will take it back", err=True)
        runtime.leave()

    register_run_batch(app, runner.run)

    # Pool threads: one per device slot, and HOST_THREADS more, so that a batch's results are written while the
    # next one runs (the runner holds the device only for the claim and the run). The event loop stays free to
    # ack at once and to take the next batch as soon as it is due. (The solo pool runs the batch inside the loop;
    # kombu then leaves the ack queued until its next poll times out, measured here as 2 s idle gaps between
    # batches.) The thread pool is Celery's, except that a warm shutdown lets prefetched batches be handed back.
    # The thread taking the device must not wait for the GIL while a host thread serializes the last batch's
    # results: at Python's default 5 ms switch interval each of its Redis round trips before the run waited that
    # long (a batch started 19 ms after the last ended, p50, on a saturated 2-core host).
    sys.setswitchinterval(DEVICE_SWITCH_INTERVAL_S)
    try:
        app.conf.worker_pool = "gpu_worker.drain:DrainingThreadPool"
        app.worker_main(["worker", f"--concurrency={model_backend.slots + HOST_THREADS}", f"--queues={queue}",
                         f"--hostname={worker_id}", f"--loglevel={settings.process.log_level}",
                         f"--prefetch-multiplier={settings.worker.max_outstanding_batches}",
                         "--without-gossip", "--without-mingle", "--task-events"])
    finally:
        ledger.close()
        device_lock.release()  # after leave(): the next worker for this device finds everything handed back
        close = getattr(model_backend, "close", None)
        if close is not None:
            close()
            # transformers' continuous-batching thread is not a daemon and can outlive stop(); the worker's
            # own shutdown is complete at this point, so end the process rather than wait on it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


if __name__ == "__main__":
    main()
