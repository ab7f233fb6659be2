"""One helper thread beside a large graph's first build, on a host with a CPU to spare.

Theory of operation: the first build of a 10,000-node graph (apir.host.graph.build) is about half
Numba kernels that release the GIL (the record checks, writing the host tensors) and half
work the caller's thread must do in order (grouping the tensors for the shape rules, then the
rules themselves, in Python). The two halves read the same parsed records and write nothing
the other reads, so the kernels' half runs on a second CPU while the caller does its own
(`apir.host.graph.build.build_graph_parts`); the same-bytes match of a large cached graph is split
the same way (`apir.host.graph.cache.GraphWire.matches`). On bench_codec's graph the build
took 2.2-2.8 ms with the helper against 2.9-3.0 ms on one thread: on this 2-core VM each
thread runs slower while the other runs.

The helper is one thread for the whole process (a `ThreadPoolExecutor` of one worker, made
and its thread started when first asked for), asleep on its queue while no build needs it:
an idle host burns no CPU. A process allowed on one CPU only (`os.sched_getaffinity`) gets
no helper, and its callers run the same functions themselves, in the same order. A forked
child makes its own (a parent's worker thread does not exist in the child).

Errors: none of its own; a job's exception is raised by its Future's `result()`.
"""

from __future__ import annotations

import os
import threading
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

__all__ = ["beside", "helper_cpus", "wait_done"]

_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None

# False: every build runs on its caller's thread only (benchmarks/bench_codec.py measures both)
enabled = True


def helper_cpus() -> int:
    """The CPUs this process may run on (`sched_getaffinity`; `os.cpu_count()` where the
    platform has no affinity call)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


def beside(fn: Callable, *args) -> Optional[Future]:
    """`fn(*args)` queued on the helper thread (its Future), or None where the process has
    one CPU, `enabled` is False, or the interpreter is shutting down: the caller then runs
    `fn` itself. A job must not wait on another job: there is one worker, and jobs run one
    at a time in the order they were queued."""
    global _pool
    if not enabled or helper_cpus() < 2:
        return None
    with _lock:
        if _pool is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="apir-build-helper")
            try:
                # Its thread started now, on a job of its own: ThreadPoolExecutor starts it
                # in the first submit, after queueing that job, and a thread that fails to
                # start would leave a caller's job queued, to run in some later build.
                pool.submit(int).result()
            except RuntimeError:  # (the process is out of threads, or shutting down)
                pool.shutdown(wait=False)
                return None
            _pool = pool
        pool = _pool
    try:
        return pool.submit(fn, *args)
    except RuntimeError:  # (submit after the interpreter's shutdown began: nothing queued)
        return None


def wait_done(job: Future) -> None:
    """Returns once `job` is done, whatever interrupts the wait (a signal handler's
    KeyboardInterrupt or SystemExit): the first such exception is raised then. A caller
    whose job writes memory it is about to free must not leave before the job does."""
    stopped: Optional[BaseException] = None
    while not job.done():
        try:
            futures.wait([job])
        except BaseException as exc:
            stopped = stopped or exc
    if stopped is not None:
        raise stopped


def _forget_in_child() -> None:
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
