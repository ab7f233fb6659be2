"""A thread per virtio-gpu context: its commands run in order, off the queue thread.

Theory of operation: a graph compute can take minutes; running it where the control queue is
read would stall every other context and the device's own commands. Each context gets a
`ContextWorker`: jobs (callables) run one after another on its thread, in the order they were
posted, so a context's SUBMIT_3D, resource attach and detach keep their order. A job that
raises is logged (a host bug), and the worker goes on. `stop` lets the posted jobs finish and
ends the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

__all__ = ["ContextWorker"]

log = logging.getLogger(__name__)

Job = Callable[[], None]


class ContextWorker:
    def __init__(self, name: str):
        self.name = name
        self._jobs: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, job: Job) -> None:
        with self._lock:
            self._pending += 1
        self._jobs.put(job)

    @property
    def pending(self) -> int:
        """Jobs posted and not finished."""
        with self._lock:
            return self._pending

    def stop(self) -> None:
        """Ends the thread after the jobs posted so far."""
        self._jobs.put(None)

    def join(self, timeout: Optional[float] = None) -> bool:
        """Waits for the thread (after `stop`); False when it is still running."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - a host bug must not end the context's thread
                log.exception("%s: job failed", self.name)
            finally:
                with self._lock:
                    self._pending -= 1
