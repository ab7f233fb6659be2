"""Whether a thread waiting for another should spin now, or block.

Theory of operation: spinning on a word (apir.codec.atomics) answers at once when the thread it
waits for has a core of its own, where blocking costs a wake-up, long on an idle virtual
machine (the vCPU halted and must be woken). But when the machine has more runnable threads
than cores, a spinner burns the core the other thread needs and is itself preempted: the
scheduler runs a thread woken from a block soon, and one that spun its slice late, so round
trips grow many times over (docs/design.md, Measurements).

`spinning_pays()` tells them apart from the kernel's count of runnable threads
(/proc/loadavg's fourth field, an instantaneous count, ours included), sampled at most every
`SAMPLE_S`: spin while it is at most the cores this process may run on. Where the count is
not available it answers True (the spinners' own bounds still hold).

`free_cores()` is the same count for choosing how many threads may spin together (ggml's
compute workers meet at a spinning barrier after every node; a host context configured with
`apir.host.n_threads=free`, as `apir embed`'s is, sizes each graph with it): the cores other
processes' runnable threads leave, this process's own threads not counted.
"""

from __future__ import annotations

import os
import time

__all__ = ["spinning_pays", "free_cores", "SAMPLE_S"]

SAMPLE_S = 0.05
_LOADAVG = "/proc/loadavg"
_TASKS = "/proc/self/task"

_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_checked_at = -1.0
_pays = True


def runnable_threads() -> int:
    """The machine's runnable threads now (/proc/loadavg), or -1 where not readable."""
    try:
        with open(_LOADAVG, "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return -1


def spinning_pays() -> bool:
    """True while runnable threads <= this process's cores (sampled every SAMPLE_S)."""
    global _checked_at, _pays
    now = time.monotonic()
    if now - _checked_at >= SAMPLE_S:
        _checked_at = now
        running = runnable_threads()
        _pays = running < 0 or running <= _cores
    return _pays


def own_runnable_threads() -> int:
    """This process's runnable threads now (state R in /proc/self/task/*/stat), or -1 where
    not readable."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return -1
    running = 0
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        end = stat.rfind(b")")  # the state follows the command name, which may hold anything
        if end < 0:
            return -1
        running += stat[end + 2 : end + 3] == b"R"
    return running


def free_cores() -> int:
    """This process's cores less the other processes' runnable threads now, at least 1; all
    of them where the counts are not readable. It reads a file per thread of this process:
    ask once per graph, not per node."""
    running, own = runnable_threads(), own_runnable_threads()
    if running < 0 or own < 0:
        return _cores
    return max(1, min(_cores, _cores - (running - own)))
