"""What the protocol fuzzers share (socket framing, vhost-user, multi-guest): the target
interface, the oracle's process checks, reproducer files, and descriptors to pass.

A protocol fuzzer is a `Target`: it starts a host in this process once (`__init__`), turns
`numpy.random.default_rng([seed, i])` into input i's steps (`generate`: plain JSON, so that
the steps are the reproducer), runs them as one or more hostile peers (`run`), and then checks
that a fresh well-behaved peer is served and that what the hostile ones held is gone
(`check`). `Watch` adds what the process itself shows: internal exceptions (an ERROR logged
with a traceback anywhere under `apir`, an exception escaping a thread) and descriptors or
threads left behind once the peers are gone.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

__all__ = ["Outcome", "Target", "Watch", "Recording", "make_fds", "FD_KINDS", "settle", "INTERESTING_U64"]

FORMAT = "apir-protocol-fuzz/1"

# Sizes and counts at the edges of what hosts bound or wrap: 0, 1, page and blob sizes around
# their boundaries, the 32-bit and 64-bit limits.
INTERESTING_U64 = [
    0,
    1,
    7,
    8,
    15,
    16,
    4095,
    4096,
    4097,
    16383,
    16384,
    16385,
    65535,
    65536,
    65552,
    1 << 20,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 4096,
    (1 << 64) - 1,
]


@dataclass
class Outcome:
    """What one input's hostile peers saw: requests left unanswered, results computed, and
    oracle failures ("KIND detail": wrong-result, cross-guest, ...)."""

    no_reply: int = 0
    computed: int = 0
    broken: List[str] = field(default_factory=list)


class Target:
    """One protocol fuzzer's host and peers (see the module docstring)."""

    name = "?"

    def generate(self, rng) -> Tuple[str, List[dict]]:  # (case name, steps)
        raise NotImplementedError

    def run(self, steps: List[dict]) -> Outcome:
        raise NotImplementedError

    def check(self) -> Tuple[bool, List[str]]:  # (a fresh peer was served, oracle failures)
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.count = 0
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.count += 1
            exc = record.exc_info[1]
            tb = record.exc_info[2]
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            where = f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}" if tb else "?"
            self.last = f"{type(exc).__name__} at {where}: {exc}"[:300]


class Watch:
    """Counts the process's internal exceptions and measures its descriptors and threads."""

    def __init__(self):
        self.errors = _Errors()
        log = logging.getLogger("apir")
        log.addHandler(self.errors)
        log.setLevel(logging.ERROR)  # refusals by the thousand are expected: not printed
        log.propagate = False
        self._hook = threading.excepthook
        threading.excepthook = self._thread_died
        self.baseline = (0, 0)

    def _thread_died(self, args) -> None:
        self.errors.count += 1
        self.errors.last = (
            f"thread {args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}"
        )
        self._hook(args)

    @staticmethod
    def usage() -> Tuple[int, int]:
        """(open descriptors, live threads) of this process."""
        return len(os.listdir("/proc/self/fd")), threading.active_count()

    def set_baseline(self) -> None:
        self.baseline = self.usage()

    def leaks(self, wait_s: float = 5.0) -> List[str]:
        """Descriptors or threads above the baseline, once given `wait_s` to go (a peer's
        connection thread ends a moment after the peer)."""
        # the peers' own objects (a fake QEMU's mappings of blobs, held by a dropped guest's
        # client in a reference cycle) go with the garbage, not at once
        gc.collect()
        ok = settle(lambda: all(n <= b for n, b in zip(self.usage(), self.baseline)), wait_s)
        if ok:
            return []
        (fds, threads), (fd0, th0) = self.usage(), self.baseline
        out = []
        if fds > fd0:
            out.append(f"fd-leak {fds - fd0} descriptors over the baseline {fd0}: {_fd_kinds()}")
        if threads > th0:
            names = sorted(t.name for t in threading.enumerate())
            out.append(f"thread-leak {threads - th0} threads over the baseline {th0}: {names}")
        return out


def _fd_kinds() -> str:
    kinds: Dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}").split(":")[0].split(" ")[0]
        except OSError:
            continue
        kinds[target] = kinds.get(target, 0) + 1
    return ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda x: -x[1])[:6])


def settle(predicate: Callable[[], bool], wait_s: float, step_s: float = 0.01) -> bool:
    """Whether `predicate` holds within `wait_s` (polled)."""
    end = time.monotonic() + wait_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(step_s)


@dataclass
class Recording:
    """A reproducer: which fuzzer, its host configuration, the steps, and where it came from."""

    fuzzer: str
    config: Dict[str, str]
    case: str
    steps: List[dict]
    meta: Dict[str, object] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "fuzzer": self.fuzzer,
                "config": self.config,
                "case": self.case,
                "meta": self.meta,
                "steps": self.steps,
            },
            indent=None,
        )

    @classmethod
    def from_json(cls, text: str) -> "Recording":
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"not a protocol fuzzer's reproducer (format {d.get('format')!r})")
        return cls(d["fuzzer"], d["config"], d["case"], d["steps"], d.get("meta", {}))


# Descriptors a hostile peer passes with SCM_RIGHTS where none (or another kind) is expected.
FD_KINDS = ["memfd", "memfd0", "eventfd", "pipe", "socket", "devnull", "dir"]


def make_fds(kinds: List[str]) -> List[int]:
    """Fresh descriptors of `kinds` (the caller closes them once sent)."""
    out: List[int] = []
    for kind in kinds:
        if kind in ("memfd", "memfd0"):
            fd = os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            if kind == "memfd":
                os.ftruncate(fd, 1 << 20)
            out.append(fd)
        elif kind == "eventfd":
            out.append(os.eventfd(0, os.EFD_CLOEXEC))
        elif kind == "pipe":
            r, w = os.pipe()
            os.close(w)
            out.append(r)
        elif kind == "socket":
            a, b = socket.socketpair()
            out.append(a.detach())
            b.close()
        elif kind == "dir":
            out.append(os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        else:
            out.append(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
    return out


def close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
