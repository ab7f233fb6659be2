"""A context's persistent ggml threadpool, for backends that compute on host threads (ggml CPU).

Theory of operation: a CPU backend without a threadpool makes a disposable one for every
graph (`ggml_graph_compute`: threads created, then joined), and its worker threads then meet
at a barrier after every node cold. llama.cpp attaches a persistent pool instead
(`ggml_threadpool_new` + `ggml_backend_cpu_set_threadpool`), and so does the host (the gain is
in docs/design.md, Measurements): each context whose backend's registry offers those three
functions (ggml CPU does, through `ggml_backend_reg_get_proc_address`) gets its own pool of
the context's thread count, attached once, freed after its backend.

`poll` is ggml's polling level (0-100, `struct ggml_threadpool_params.poll`): how long idle
workers spin for the next graph before they sleep. The default here is 0: between two graphs
the host's dispatcher thread parses and checks the next one, and spinning workers would take
the cores it needs. `struct ggml_threadpool_params`'s layout comes from the build's header (its
leading cpumask is GGML_MAX_N_THREADS long) and is checked once against
`ggml_threadpool_params_init`; a build where any of it is missing gets no pool. The pools of
one process hold at most `max_pool_threads()` worker threads together; a context past that
bound computes with the disposable pool (docs/security.md, section 2, says why).
`threads_fit(n)` asks, before ggml is asked, whether n threads' stacks can be mapped now:
ggml GGML_ASSERTs (aborts the process) when pthread_create fails.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import resource
import threading
from typing import Optional, Type

from apir.host.config import DEFAULT_POLL

__all__ = ["CpuThreadpool", "threads_fit"]

log = logging.getLogger(__name__)

_NEW = b"ggml_threadpool_new"
_FREE = b"ggml_threadpool_free"
_SET = b"ggml_backend_cpu_set_threadpool"
# bytes past the struct that ggml_threadpool_params_init must leave alone: room for a library
# whose GGML_MAX_N_THREADS is larger than its header's (the function writes its own struct)
_GUARD = 1 << 16

# Worker threads all pools of this process hold together. An idle context keeps its pool's
# threads, and ggml_threadpool_new GGML_ASSERTs (aborts the host) when the OS refuses one
# (RLIMIT_NPROC, a cgroup's pids.max): without a bound, a guest opening contexts makes the host
# abort. Past the bound a context gets no pool (ggml's disposable one per graph, as before).
# Default: 16 threads per core, and at most half of RLIMIT_NPROC where that is finite;
# environment APIR_HOST_MAX_POOL_THREADS overrides.
ENV_MAX_POOL_THREADS = "APIR_HOST_MAX_POOL_THREADS"
_pooled_lock = threading.Lock()
_pooled = 0  # worker threads (n_threads - 1 per pool) of the pools now alive


def max_pool_threads() -> int:
    """The bound on worker threads all pools of this process hold together (see above)."""
    value = os.environ.get(ENV_MAX_POOL_THREADS)
    if value is not None:
        try:
            return max(0, int(value))
        except ValueError:
            log.error("%s=%r is not a number", ENV_MAX_POOL_THREADS, value)
    limit = 16 * (os.cpu_count() or 1)
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, soft // 2)
    return limit


def _thread_stack_size() -> int:
    """The stack glibc maps for a thread made without attributes, as ggml makes them."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return 8 << 20 if soft == resource.RLIM_INFINITY or soft <= 0 else soft


def threads_fit(n: int) -> bool:
    """Whether `n` more threads' stacks can be mapped now (address space, RLIMIT_AS, commit
    limit): a mapping of that size is made and dropped. ggml_threadpool_new and a graph's
    disposable pool GGML_ASSERT that each pthread_create succeeds."""
    if n <= 0:
        return True
    try:
        probe = mmap.mmap(
            -1,
            n * _thread_stack_size(),
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
    except (OSError, ValueError, OverflowError):
        return False
    probe.close()
    return True


def pooled_threads() -> int:
    """Worker threads the pools of this process hold now."""
    return _pooled


def _params_type(max_n_threads: int) -> Type[ctypes.Structure]:
    """`struct ggml_threadpool_params` (ggml.h) of a build whose GGML_MAX_N_THREADS is given."""

    class ThreadpoolParams(ctypes.Structure):
        _fields_ = [
            ("cpumask", ctypes.c_bool * max_n_threads),
            ("n_threads", ctypes.c_int),
            ("prio", ctypes.c_int),  # enum ggml_sched_priority
            ("poll", ctypes.c_uint32),
            ("strict_cpu", ctypes.c_bool),
            ("paused", ctypes.c_bool),
        ]

    return ThreadpoolParams


def _params(g, n_threads: int, poll: int):
    """The params ggml_threadpool_params_init gives for `n_threads`, with `poll`; None when
    the build lacks the function or the layout does not match the header's."""
    if not g.header.max_n_threads or not g.has("ggml_threadpool_params_init"):
        return None
    ptype = _params_type(g.header.max_n_threads)
    size = ctypes.sizeof(ptype)
    room = ctypes.create_string_buffer(size + _GUARD)
    ctypes.memset(room, 0xA5, size + _GUARD)
    g.ggml_threadpool_params_init(ctypes.addressof(room), n_threads)
    params = ptype.from_buffer_copy(room)
    if params.n_threads != n_threads or room.raw[size:] != b"\xa5" * _GUARD:
        log.warning("struct ggml_threadpool_params is not laid out as ggml.h says: no threadpool")
        return None
    params.poll = poll
    return params


class CpuThreadpool:
    """A ggml threadpool of `n_threads` attached to `backend` (of registry `reg`), or nothing
    (`attach` returns None) where the registry does not offer threadpools. `close()` frees it;
    call it after ggml_backend_free(backend), which does not."""

    def __init__(self, free, pool: int, workers: int = 0) -> None:
        self._free = free
        self.pool = pool
        self._workers = workers  # counted in _pooled until close

    @classmethod
    def attach(cls, g, reg: int, backend: int, n_threads: int, poll: int = DEFAULT_POLL) -> Optional["CpuThreadpool"]:
        addr = {name: g.ggml_backend_reg_get_proc_address(reg, name) for name in (_NEW, _FREE, _SET)}
        if not all(addr.values()):
            return None
        params = _params(g, n_threads, poll)
        if params is None:
            return None
        new = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(addr[_NEW])
        free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(addr[_FREE])
        set_pool = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(addr[_SET])
        global _pooled
        workers = max(0, n_threads - 1)  # the calling thread is worker 0
        with _pooled_lock:
            if _pooled + workers > max_pool_threads():
                log.warning("threadpool of %d threads past the host's pooled-thread bound: none", n_threads)
                return None
            _pooled += workers
        pool = new(ctypes.byref(params))
        if not pool:
            with _pooled_lock:
                _pooled -= workers
            log.warning("ggml_threadpool_new(%d threads) failed: no threadpool", n_threads)
            return None
        set_pool(backend, pool)
        return cls(free, pool, workers)

    def close(self) -> None:
        global _pooled
        if self.pool:
            self._free(self.pool)
            self.pool = 0
            with _pooled_lock:
                _pooled -= self._workers
            self._workers = 0
