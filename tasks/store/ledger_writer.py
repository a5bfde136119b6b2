"""The ledger's background writer: it keeps the database off the hot path.

Processes hand it one event per batch (:meth:`LedgerWriter.record` never blocks and never raises), and a thread
writes what has queued up in one transaction (:class:`tasks.store.ledger.Ledger`). When the database is down,
events wait in a bounded buffer and are retried; beyond the bound they are dropped, counted and logged. A write
the database refuses for what it holds is written again event by event, then row by row, so that only the
refused rows are lost.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.config import Settings
from tasks.store.ledger import Ledger, LedgerEvent, first_line, refused_by_database

log = logging.getLogger("llmb.ledger")


class _Closed(Exception):
    """The writer is closing and the database is still unreachable: stop retrying."""


@dataclass
class LedgerWriter:
    """Background writer: ``record`` never blocks and never raises.

    What has queued up is written together (up to ``max_group`` events in one transaction). A write that
    fails because of its contents (:func:`refused_by_database`) is written again event by event, and a
    refused event row by row: only the refused rows are dropped, logged and counted (``on_drop``); the
    writer goes on. Any other failure (the database is unreachable) is retried every ``retry_s`` seconds
    while new events wait in the buffer.
    """

    ledger: Ledger
    max_buffer: int = 10_000
    on_drop: Callable[[int], object] = lambda n: None
    retry_s: float = 2.0
    max_group: int = 100
    _queue: queue.Queue[LedgerEvent | None] = field(init=False)
    _thread: threading.Thread = field(init=False)
    _closing: threading.Event = field(init=False, default_factory=threading.Event)
    dropped: int = field(default=0, init=False)  # records lost for any reason (buffer full, refused)
    refused: int = field(default=0, init=False)  # of which the database refused

    @classmethod
    def from_settings(cls, settings: Settings, on_drop: Callable[[int], object] = lambda n: None) -> LedgerWriter:
        return cls(Ledger.from_settings(settings), max_buffer=settings.stores.ledger_buffer, on_drop=on_drop)

    def __post_init__(self) -> None:
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()

    def record(self, ev: LedgerEvent) -> None:
        # the bound counts what waits and what the writer holds (a group being written): both are not yet written
        if self._queue.unfinished_tasks >= self.max_buffer:
            self._drop(1)
            log.warning("ledger buffer full: dropped %d record(s) (%d in all)", 1, self.dropped)
            return
        self._queue.put_nowait(ev)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything recorded so far is written (tests, shutdown). False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is buffered (for up to ``timeout_s``), then stop; with the database still away, what is
        left is dropped and counted rather than retried for ever."""
        self.flush(timeout_s)
        self._closing.set()
        self._queue.put_nowait(None)

    def _drop(self, n: int) -> None:
        self.dropped += n
        with contextlib.suppress(Exception):  # counting is best effort
            self.on_drop(n)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            group: list[LedgerEvent] = []
            stop = first is None
            if first is not None:
                group.append(first)
            while not stop and len(group) < self.max_group:
                try:
                    ev = self._queue.get_nowait()
                except queue.Empty:
                    break
                if ev is None:
                    stop = True
                else:
                    group.append(ev)
            try:
                if group:
                    self._write(group)
            except _Closed:
                log.warning("ledger closing with the database unreachable: dropped %d record(s)", len(group))
                self._drop(len(group))
            except Exception:  # never let the writer thread die
                log.exception("ledger records could not be written; dropped %d", len(group))
                self._drop(len(group))
            finally:
                for _ in range(len(group) + stop):
                    self._queue.task_done()
            if stop:
                return

    def _write(self, group: list[LedgerEvent]) -> None:
        if self._persist(functools.partial(self.ledger.write_many, group)) is None:
            return
        if len(group) == 1:
            self._write_each(group[0])
            return
        for ev in group:  # which of them? each alone, then the refused ones row by row
            if self._persist(functools.partial(self.ledger.write, ev)) is not None:
                self._write_each(ev)

    def _write_each(self, ev: LedgerEvent) -> None:
        refused: list[str] = []

        def rows() -> None:
            refused[:] = self.ledger.write_each(ev)

        error = self._persist(rows)
        if error is not None:  # not a row: the event itself cannot be turned into rows
            refused = [f"{type(ev).__name__}: {type(error).__name__}: {first_line(error)}"]
        for line in refused:
            log.error("a ledger record could not be stored; dropped it and wrote the rest: %s", line)
        if refused:
            self.refused += len(refused)
            self._drop(len(refused))

    def _persist(self, write: Callable[[], object]) -> BaseException | None:
        """Run ``write`` until it succeeds (None) or fails because of what it writes (that error)."""
        while True:
            try:
                write()
                return None
            except Exception as exc:
                if refused_by_database(exc):
                    return exc
                if self._closing.is_set():
                    raise _Closed() from exc
                log.warning("ledger write failed (%s: %s); retrying in %g s with %d record(s) waiting",
                            type(exc).__name__, first_line(exc), self.retry_s, self._queue.unfinished_tasks)
                time.sleep(self.retry_s)
