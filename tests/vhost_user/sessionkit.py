"""Helpers of tests/vhost_user/test_session_hostile.py: a device in a process of its own (a fault
there must not take pytest down), a HostContext stand-in that computes until released, extra
guest memory regions, and a wait on the used ring that never reads the call eventfd."""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from typing import List

from apir.host.vhost_user import protocol as vu

from .frontend import FakeFrontend

_SERVER = """
import sys, time
from apir.host.vhost_user import VhostUserServer

class Stub:
    def add_resource(self, res_id, memory): pass
    def remove_resource(self, res_id): pass
    def submit(self, command): pass
    def close(self): pass

servers = [VhostUserServer(p, shm_size=64 << 20, context_factory=lambda *a: Stub()).start() for p in sys.argv[1:]]
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def spawn_device(paths: List[str]) -> subprocess.Popen:
    """A device process serving one socket per path (stub contexts), once it listens."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, *paths], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.strip() == "ready", line
    return proc


def region(gpa: int, size: int, uva: int, offset: int = 0) -> bytes:
    """ADD_MEM_REG / REM_MEM_REG payload."""
    return struct.pack("<Q", 0) + vu.MEMORY_REGION.pack(gpa, size, uva, offset)


def table(*regions) -> bytes:
    """SET_MEM_TABLE payload of (gpa, size, uva, offset) regions."""
    return struct.pack("<II", len(regions), 0) + b"".join(vu.MEMORY_REGION.pack(*r) for r in regions)


def wait_used_polled(fe: FakeFrontend, head: int, timeout: float = 10.0) -> int:
    """Bytes written for chain `head`, watching the used ring only (the call eventfd is left
    alone). Raises TimeoutError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fe.reap(0)
        if head in fe.done[0]:
            return fe.done[0].pop(head)
        time.sleep(0.01)
    raise TimeoutError(f"chain {head} not used within {timeout} s")
