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

A backend without the proc address (ggml-vulkan, ggml-rpc) is given the graph in ranges of
`chunk_nodes` nodes (`compute_graph`, apir.host.graph.chunks), the flag looked at between
them: the same bound, a range rather than a node late. What this cannot stop (the node or range
running; chunk_nodes 0 on such a backend): docs/security.md.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from typing import Callable, Dict, Optional, Sequence

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
    with; `time_limit_s`: the wall-time bound of one graph (0: none); `chunk_nodes`: nodes per
    range where the backend has no abort callback (0: whole graphs, unbounded). `installed`
    says whether ggml will look at the flag, `chunked` whether `compute_graph` does instead."""

    def __init__(
        self, g, reg: int, backend: int, time_limit_s: float, name: str = "context", chunk_nodes: int = 0
    ) -> None:
        self.g = g
        self.name = name
        self.time_limit_s = time_limit_s
        self.aborted_status = g.statuses["ABORTED"]
        self.success_status = g.statuses["SUCCESS"]
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
        self.chunk_nodes = 0 if self.installed else chunk_nodes
        if self.chunk_nodes:
            log.info(
                "%s: ggml backend %s has no abort callback: graphs computed in ranges of %d nodes, "
                "the time limit and cancellation checked between them",
                name,
                g.ggml_backend_reg_name(reg).decode(),
                self.chunk_nodes,
            )
        elif not self.installed:
            log.warning(
                "%s: ggml backend %s has no abort callback: graphs run to completion (no time limit, no cancellation)",
                name,
                g.ggml_backend_reg_name(reg).decode(),
            )

    @property
    def chunked(self) -> bool:
        """Whether graphs are computed in ranges of nodes (no abort callback)."""
        return self.chunk_nodes > 0

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
        armed = (self.installed or self.chunked) and 0 < self.time_limit_s < math.inf
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

    def compute_graph(self, backend: int, graph: int, chunks: Callable[[int], Sequence[int]]) -> int:
        """ggml_backend_graph_compute of `graph` under `run`: whole, or, where the backend has
        no abort callback, as `chunks(chunk_nodes)` (the graph's nodes as consecutive cgraphs,
        apir.host.graph.chunks) one after the other, the flag looked at before each."""
        if not self.chunked:
            return self.run(self.g.ggml_backend_graph_compute, backend, graph)
        return self.run(self._compute_ranges, backend, chunks(self.chunk_nodes))

    def _compute_ranges(self, backend: int, graphs: Sequence[int]) -> int:
        compute = self.g.ggml_backend_graph_compute
        for graph in graphs:
            if self._flag.load_acquire():
                return self.aborted_status
            status = compute(backend, graph)
            if status != self.success_status:
                return status
        return self.success_status

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
            if self._thread is None:
                # kept only once it runs: a thread that failed to start is tried again next time
                thread = threading.Thread(target=self._run, name="apir-compute-watchdog", daemon=True)
                thread.start()
                self._thread = thread
            self._deadlines[abort] = deadline
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
