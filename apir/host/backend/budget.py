"""Bounds on the ggml buffers guests make the host hold: per context and per host process.

Theory of operation: every ggml buffer a context holds, whether buffer_type_alloc_buffer made
it or device_buffer_from_ptr wrapped a blob in it, is charged when it is made and refunded when
it is freed (free_buffer, a removed blob, the context's close). The charge is the buffer's size
but at least `MIN_BUFFER_CHARGE` bytes (and at least the buffer type's alignment): a size-0
buffer still costs the host a ggml buffer, a handle and a table entry. A charge must fit all
bounds below, or the buffer is not made (the guest gets a null handle, as from a failed
ggml allocation):

    apir.host.buffer_budget       bytes one context may hold; default half the device's total
                                  memory
    apir.host.peer_memory_limit   bytes all contexts of one peer (apir.host.peer: a VM, a
                                  socket host's client) may hold together; default half the
                                  device's total memory, so a guest's second context shares
                                  its first one's half and the others keep a quarter at least
    apir.host.memory_limit        bytes all contexts of this host process may hold together;
                                  default three quarters of the device's total memory
    apir.host.max_buffers         buffers one context may hold at once; default 4096

A context whose configuration names no peer is a peer of its own (its budget bounds it).

The device's total memory is `ggml_backend_dev_memory`'s, or the machine's physical memory when
the device reports none. A value that is not a non-negative integer is logged and taken as 0, so
a mistyped limit refuses every buffer rather than lifting the bound. Blob (shared-memory) bytes
are bounded by the transport, not here. docs/security.md (section 2) has the rest.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from apir.host.config import (
    CONFIG_KEY_BUFFER_BUDGET,
    CONFIG_KEY_MAX_BUFFERS,
    CONFIG_KEY_MEMORY_LIMIT,
    CONFIG_KEY_PEER,
    CONFIG_KEY_PEER_MEMORY_LIMIT,
    DEFAULT_MAX_BUFFERS,
)

__all__ = [
    "BufferLimits",
    "BufferBudget",
    "HostMemory",
    "HOST_MEMORY",
    "MIN_BUFFER_CHARGE",
    "physical_memory",
]

log = logging.getLogger("apir.host")

MIN_BUFFER_CHARGE = 4096  # bytes: what a buffer costs at least (a page)
# Defaults as fractions of the device's total memory: one context may not take it all, and
# all contexts together leave the host room of its own.
_CONTEXT_SHARE = (1, 2)
_PEER_SHARE = (1, 2)
_HOST_SHARE = (3, 4)


def physical_memory() -> int:
    """Bytes of physical memory of this machine (0 when the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


class HostMemory:
    """Bytes of ggml buffers held by every context of this process (`used`) and by each
    peer's contexts (`by_peer`). Thread-safe: contexts run on threads of their own."""

    def __init__(self):
        self._lock = threading.Lock()
        self.used = 0
        self.by_peer: Dict[str, int] = {}

    def take(self, nbytes: int, limit: int, peer: Optional[str] = None, peer_limit: int = 0) -> Optional[str]:
        """Adds `nbytes` if the process's total stays within `limit` and, for a `peer`, that
        peer's within `peer_limit`; None, or why not (nothing added)."""
        with self._lock:
            held = self.by_peer.get(peer, 0) if peer is not None else 0
            if peer is not None and held + nbytes > peer_limit:
                return (
                    f"{nbytes} more bytes over the peer's limit ({CONFIG_KEY_PEER_MEMORY_LIMIT}): "
                    f"{held} of {peer_limit} held by its contexts"
                )
            if self.used + nbytes > limit:
                return (
                    f"{nbytes} more bytes over the host's limit ({CONFIG_KEY_MEMORY_LIMIT}): "
                    f"{self.used} of {limit} held by all contexts"
                )
            self.used += nbytes
            if peer is not None:
                self.by_peer[peer] = held + nbytes
            return None

    def give(self, nbytes: int, peer: Optional[str] = None) -> None:
        with self._lock:
            self.used -= nbytes
            if peer is not None:
                left = self.by_peer.get(peer, 0) - nbytes
                if left > 0:
                    self.by_peer[peer] = left
                else:
                    self.by_peer.pop(peer, None)


HOST_MEMORY = HostMemory()  # the one pool of this process


@dataclass(frozen=True)
class BufferLimits:
    """`context_bytes`, `host_bytes`, `peer_bytes`: byte bounds; `max_buffers`: buffers per
    context; `peer`: the context's peer (None: a peer of its own, bounded as a context)."""

    context_bytes: int
    host_bytes: int
    max_buffers: int
    peer: Optional[str] = None
    peer_bytes: int = 0

    @classmethod
    def from_config(
        cls, get_config: Callable[[str], Optional[str]], device_total: int, ctx_id: int = 0
    ) -> "BufferLimits":
        """The limits a context's configuration sets (`get_config`: HostContext.get_config),
        defaults from the device's total memory in bytes (see the module docstring)."""
        total = device_total or physical_memory() or (1 << 64)

        def read(key: str, default: int) -> int:
            value = get_config(key)
            if value is None:
                return default
            try:
                number = int(value, 10)
            except ValueError:
                number = -1
            if number < 0:
                log.error("ctx %d: %s=%r is not a non-negative integer: taken as 0", ctx_id, key, value)
                return 0
            return number

        return cls(
            read(CONFIG_KEY_BUFFER_BUDGET, total * _CONTEXT_SHARE[0] // _CONTEXT_SHARE[1]),
            read(CONFIG_KEY_MEMORY_LIMIT, total * _HOST_SHARE[0] // _HOST_SHARE[1]),
            read(CONFIG_KEY_MAX_BUFFERS, DEFAULT_MAX_BUFFERS),
            get_config(CONFIG_KEY_PEER) or None,
            read(CONFIG_KEY_PEER_MEMORY_LIMIT, total * _PEER_SHARE[0] // _PEER_SHARE[1]),
        )


def buffer_charge(size: int, alignment: int = 1) -> int:
    """What a buffer of `size` bytes costs: its size, at least MIN_BUFFER_CHARGE and at least
    the buffer type's alignment."""
    return max(size, alignment, MIN_BUFFER_CHARGE)


class BufferBudget:
    """One context's held buffers and bytes, within its `limits` and the process's `host` pool.
    Not thread-safe on its own: a context runs one command at a time."""

    def __init__(self, limits: BufferLimits, host: HostMemory = HOST_MEMORY):
        self.limits = limits
        self.host = host
        self.bytes = 0
        self.buffers = 0

    def take(self, charge: int) -> Optional[str]:
        """Counts one more buffer costing `charge` bytes; None, or why it does not fit (then
        nothing is counted)."""
        lim = self.limits
        if self.buffers >= lim.max_buffers:
            return f"{self.buffers} buffers held, the context's limit ({CONFIG_KEY_MAX_BUFFERS}) is {lim.max_buffers}"
        if self.bytes + charge > lim.context_bytes:
            return (
                f"{charge} more bytes over the context's budget ({CONFIG_KEY_BUFFER_BUDGET}): "
                f"{self.bytes} of {lim.context_bytes} held"
            )
        why = self.host.take(charge, lim.host_bytes, lim.peer, lim.peer_bytes)
        if why is not None:
            return why
        self.bytes += charge
        self.buffers += 1
        return None

    def grow(self, extra: int) -> Optional[str]:
        """Adds `extra` bytes to a buffer already counted (ggml made it larger than asked)."""
        lim = self.limits
        if self.bytes + extra > lim.context_bytes:
            return f"{extra} more bytes over the context's budget ({CONFIG_KEY_BUFFER_BUDGET})"
        why = self.host.take(extra, lim.host_bytes, lim.peer, lim.peer_bytes)
        if why is not None:
            return why
        self.bytes += extra
        return None

    def give(self, charge: int) -> None:
        """Refunds one buffer that cost `charge` bytes."""
        self.bytes -= charge
        self.buffers -= 1
        self.host.give(charge, self.limits.peer)
