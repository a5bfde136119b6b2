"""This API process's admission lease, renewed in the background: when it lapses (the process died) the capacity
its callers held is released within seconds instead of at their deadlines (``LLMB_API_LEASE_S``)."""
from __future__ import annotations

import logging
import threading
import time

import redis

from tasks.state.admission import Admission

log = logging.getLogger(__name__)


class Lease:
    """Renews the lease every ``period_s`` from a daemon thread, started by the first :meth:`keep` (lazily: after
    gunicorn forked the process)."""

    def __init__(self, admission: Admission, period_s: float) -> None:
        self.admission = admission
        self.period_s = period_s
        self.started = False

    def keep(self) -> None:
        """Start renewing the lease (once)."""
        if self.started:
            return
        self.started = True
        threading.Thread(target=self._renew_forever, name="admission-lease", daemon=True).start()

    def _renew_forever(self) -> None:
        while True:
            try:
                released = self.admission.renew()
                if released:
                    log.warning("released %d items admitted by API processes that died", released)
            except redis.RedisError as exc:
                log.debug("could not renew the admission lease: %s", exc)
            time.sleep(self.period_s)
