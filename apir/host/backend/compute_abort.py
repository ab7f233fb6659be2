"""Stopping a graph compute: a time limit per graph, and cancellation when its guest goes away.

Theory of operation: ggml backends that can stop a compute offer
`ggml_backend_set_abort_callback(backend, callback, data)` through their registry's proc address
(the CPU backend's is `ggml_backend_cpu_set_abort_callback`). ggml calls `callback(data)` from
its compute thread after each node and, when it returns true, stops the graph there: the compute
returns GGML_STATUS_ABORTED (read from the loaded ggml, `Ggml.statuses`). The callback installed
here is compiled code (`apir.codec.atomics.nonzero_u32_callback`) that reads one u32, the
context's abort flag, without the GIL, so checking it never waits on Python.

Python sets the flag (a release store) from any thread:
- the time limit: `run` arms a deadline `apir.host.graph_time_limit_s` ahead (apir.host.config;
  default 300 s, 0 none); one watchdog thread per process sets the flag of a compute that
  reaches its deadline, and `run` disarms it when the compute ends;
- `cancel(reason)`: the context is being destroyed or its guest disconnected (HostContext.close,
  the socket host noticing a hang-up). It is final: the compute in flight stops after its
  current node, and every later `run` returns GGML_STATUS_ABORTED without computing.

What this cannot stop (the node running; a backend without the proc address): docs/security.md.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from typing import Callable, Dict, Optional

import numpy as np

from apir.codec.atomics import Word, nonzero_u32_callback

__all__ = ["ComputeAbort", "SET_ABORT_CALLBACK"]

log = logging.getLogger(__name__)

# the proc address ggml's registries answer for it (ggml-backend.h ggml_backend_set_abort_callback_t)
SET_ABORT_CALLBACK = b"ggml_backend_set_abort_callback"
_SET_ABORT_CALLBACK_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class ComputeAbort:
    """One context's abort flag, installed as `backend`'s abort callback when `reg` offers one.

    `g`: the loaded Ggml; `reg`, `backend`: the ggml registry and backend the context computes
    with; `time_limit_s`: the wall-time bound of one graph (0: none). `installed` says whether
    ggml will look at the flag."""

    def __init__(self, g, reg: int, backend: int, time_limit_s: float, name: str = "context") -> None:
        self.name = name
        self.time_limit_s = time_limit_s
        self.aborted_status = g.statuses["ABORTED"]
        self._flag_memory = np.zeros(1, dtype=np.uint32)  # ggml reads it through `data`
        self._flag = Word(self._flag_memory.view(np.uint8), 0)
        self._cancelled: Optional[str] = None  # why, once cancel() was called
        self._timed_out = False
        self.installed = False
        fn_ptr = g.ggml_backend_reg_get_proc_address(reg, SET_ABORT_CALLBACK)
        if fn_ptr:
            set_abort = _SET_ABORT_CALLBACK_T(fn_ptr)
            set_abort(backend, nonzero_u32_callback(), self._flag_memory.ctypes.data)
            self.installed = True
        else:
            log.warning(
                "%s: ggml backend %s has no abort callback: graphs run to completion (no time limit, no cancellation)",
                name,
                g.ggml_backend_reg_name(reg).decode(),
            )

    @property
    def cancelled(self) -> Optional[str]:
        """Why `cancel` was called, or None."""
        return self._cancelled

    def run(self, compute: Callable[..., int], *args) -> int:
        """`compute(*args)` (a ggml graph compute returning its `enum ggml_status`) under the
        time limit and cancellation; its status (GGML_STATUS_ABORTED when stopped), or
        GGML_STATUS_ABORTED without computing once cancelled."""
        if self._cancelled is not None:
            log.warning("%s: graph not computed: %s", self.name, self._cancelled)
            return self.aborted_status
        self._timed_out = False
        self._flag.store_release(0)
        if self._cancelled is not None:  # a cancel() between the check and the store
            self._flag.store_release(1)
        armed = self.installed and 0 < self.time_limit_s < math.inf
        if armed:
            _WATCHDOG.arm(self, time.monotonic() + self.time_limit_s)
        try:
            status = compute(*args)
        finally:
            if armed:
                _WATCHDOG.disarm(self)
        if status == self.aborted_status:
            why = self._cancelled or (
                f"over its time limit ({self.time_limit_s:g} s)" if self._timed_out else "aborted by ggml"
            )
            log.warning("%s: graph compute stopped: %s", self.name, why)
        return status

    def cancel(self, reason: str) -> None:
        """Stops the compute in flight (after its current node) and every later one. Any
        thread; idempotent (the first reason is kept)."""
        if self._cancelled is None:
            self._cancelled = reason
        self._flag.store_release(1)

    def _expire(self) -> None:
        """The watchdog: this compute reached its deadline."""
        self._timed_out = True
        self._flag.store_release(1)


class _Watchdog:
    """One thread per process that sets the flag of each compute reaching its deadline.

    It sleeps until the earliest deadline it knows of; `arm` wakes it only for a deadline
    earlier than that, so back-to-back computes under one limit cost two lock round trips each
    and no thread wake-up. A disarmed deadline is dropped; the thread, waking for it, finds
    nothing due and sleeps again."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._deadlines: Dict[ComputeAbort, float] = {}
        self._wake_at = math.inf  # when the thread wakes next (inf: when notified)
        self._thread: Optional[threading.Thread] = None

    def arm(self, abort: ComputeAbort, deadline: float) -> None:
        with self._cond:
            self._deadlines[abort] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="apir-compute-watchdog", daemon=True)
                self._thread.start()
            if deadline < self._wake_at:
                self._wake_at = deadline
                self._cond.notify()

    def disarm(self, abort: ComputeAbort) -> None:
        with self._cond:
            self._deadlines.pop(abort, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for abort, deadline in list(self._deadlines.items()):
                    if deadline <= now:
                        del self._deadlines[abort]
                        abort._expire()
                self._wake_at = min(self._deadlines.values(), default=math.inf)
                self._cond.wait(None if self._wake_at == math.inf else self._wake_at - now)


_WATCHDOG = _Watchdog()
