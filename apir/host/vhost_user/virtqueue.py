"""One split virtqueue (virtio 1.x, 2.7): descriptor chains in, used elements out.

Theory of operation: the driver (the guest kernel) puts descriptor chain heads in the avail
ring and bumps avail.idx; the front-end writes 8 bytes to the kick eventfd. The device pops
heads (`pop`), reads the chain's device-readable buffers (the request) and writes its
device-writable ones (the response), then puts (head, bytes written) in the used ring
(`push`) and writes the call eventfd. The ring lives in guest memory, so everything read from
it is hostile: `pop` refuses (`QueueError`) an avail index more than `num` ahead, a head made
available again while it is in flight (popped, not yet pushed: re-posted, it would be queued
again each time behind a long command), a head or next index >= num, a chain longer than
num (a loop), an indirect descriptor (the feature is not offered), a readable descriptor
after a writable one, or buffers past `max_request` bytes. Every byte goes through
`GuestMemory`, which refuses ranges outside guest memory.

The used index is the device's own count (`used_idx`), read from guest memory once when the
ring starts: the guest cannot make the device write used elements anywhere but the ring.
Chains may complete out of order (virtio allows it); `push` is thread-safe, and a chain popped
before the ring was stopped or restarted (`generation` changed) is dropped, not pushed.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

from apir.errors import ApirError
from apir.host.vhost_user.memory import GuestMemory, GuestMemoryError
from apir.host.vhost_user.protocol import close_quietly

__all__ = ["Virtqueue", "Chain", "QueueError", "MAX_QUEUE_SIZE"]

log = logging.getLogger(__name__)

MAX_QUEUE_SIZE = 32768  # virtio's bound on a split ring's size (a power of 2)
VRING_DESC_F_NEXT = 1
VRING_DESC_F_WRITE = 2
VRING_DESC_F_INDIRECT = 4
_DESC = struct.Struct("<QIHH")  # addr, len, flags, next
_U16 = struct.Struct("<H")
_USED_ELEM = struct.Struct("<II")  # id, len
_EVENT = struct.Struct("<Q")


class QueueError(ApirError, ValueError):
    """A ring or descriptor chain the device refuses; `chain`: the chain whose head was
    consumed (to be completed as an error), None when the ring itself is bad."""

    def __init__(self, message: str, chain: Optional["Chain"] = None):
        super().__init__(message)
        self.chain = chain


@dataclass
class Chain:
    """One popped descriptor chain: `head` index, device-readable and device-writable
    (guest address, length) buffers, and the ring `generation` it came from."""

    head: int
    readable: List[Tuple[int, int]] = field(default_factory=list)
    writable: List[Tuple[int, int]] = field(default_factory=list)
    generation: int = 0

    @property
    def readable_size(self) -> int:
        return sum(n for _, n in self.readable)

    @property
    def writable_size(self) -> int:
        return sum(n for _, n in self.writable)


class Virtqueue:
    """Queue `index` of the device, set up by the front-end's SET_VRING_* messages."""

    def __init__(self, index: int, memory: GuestMemory, max_request: int):
        self.index = index
        self.memory = memory
        self.max_request = max_request
        self.num = 0
        self.desc = self.avail = self.used = 0  # guest physical addresses
        self.addresses_set = False
        self.last_avail = 0
        self.used_idx = 0
        self.kick_fd: Optional[int] = None
        self.call_fd: Optional[int] = None
        # Kick descriptors replaced or stopped, closed by the thread that polls them
        # (`close_retired`): closing one under its poll could let the number be reused.
        self.retired_kicks: List[int] = []
        self.started = False
        self.broken = False  # a bad ring: no more processing until it is set up again
        self.base_at_stop: Optional[int] = None  # what the last GET_VRING_BASE answered
        self.generation = 0
        self.in_flight: Set[int] = set()  # heads popped in this generation, not pushed yet
        self.lock = threading.Lock()

    # --- set-up (front-end messages) ---------------------------------------------------------
    def set_num(self, num: int) -> None:
        """SET_VRING_NUM. Raises QueueError unless num is a power of 2 up to MAX_QUEUE_SIZE."""
        if not 0 < num <= MAX_QUEUE_SIZE or num & (num - 1):
            raise QueueError(f"queue {self.index}: size {num} is not a power of 2 up to {MAX_QUEUE_SIZE}")
        with self.lock:
            self.num = num

    def set_base(self, base: int) -> None:
        """SET_VRING_BASE: the next avail index to read."""
        with self.lock:
            self.last_avail = base & 0xFFFF

    def set_addresses(self, desc: int, used: int, avail: int) -> None:
        """SET_VRING_ADDR, already translated to guest addresses."""
        with self.lock:
            self.desc, self.used, self.avail = desc, used, avail
            self.addresses_set = True

    def set_kick(self, fd: Optional[int]) -> None:
        """SET_VRING_KICK: takes `fd` (None: no kicks, the ring is polled); the ring starts
        (its used index is read from memory)."""
        _non_blocking(fd)  # the front-end may read its kick between our poll and read
        with self.lock:
            if self.kick_fd is not None:
                self.retired_kicks.append(self.kick_fd)
            self.kick_fd = fd
            self.generation += 1
            self.in_flight.clear()
            self.broken = False
            self.base_at_stop = None
            self.started = self.addresses_set and self.num > 0
            if self.started:
                try:
                    self.used_idx = _U16.unpack(self.memory.read(self.used + 2, 2))[0]
                except GuestMemoryError as exc:
                    log.error("queue %d: used ring unreadable (%s): not started", self.index, exc)
                    self.started = False

    def set_call(self, fd: Optional[int]) -> None:
        """SET_VRING_CALL: takes `fd`."""
        _non_blocking(fd)  # an eventfd at its maximum count (or a full pipe) must not stall us
        with self.lock:
            close_quietly(self.call_fd)
            self.call_fd = fd

    def drop_kick(self, fd: int) -> None:
        """Stops polling kick descriptor `fd` (it gives no kicks); the ring runs on, served on
        wake-ups, until the next SET_VRING_KICK."""
        with self.lock:
            if self.kick_fd == fd:
                self.retired_kicks.append(fd)
                self.kick_fd = None

    def stop(self) -> int:
        """GET_VRING_BASE: stops the ring; returns the next avail index it would have read."""
        with self.lock:
            self.started = False
            self.generation += 1
            self.in_flight.clear()
            if self.kick_fd is not None:
                self.retired_kicks.append(self.kick_fd)
            self.kick_fd = None
            self.base_at_stop = self.last_avail
            return self.last_avail

    def restarts_fresh(self) -> bool:
        """Whether the ring, stopped after serving chains, is about to start again at avail
        index 0: the driver reset the device (QEMU's virtio reset zeroes its saved index;
        after a pause QEMU gives back what GET_VRING_BASE answered). Only a stop at an exact
        multiple of 65536 chains looks like a pause either way, and is taken as one."""
        with self.lock:
            return bool(self.base_at_stop) and self.last_avail == 0

    def close_retired(self) -> None:
        """Closes the kick descriptors `set_kick` / `stop` replaced (the polling thread)."""
        with self.lock:
            retired, self.retired_kicks = self.retired_kicks, []
        for fd in retired:
            close_quietly(fd)

    def close(self) -> None:
        """Stops the ring and closes its descriptors (once no thread polls them)."""
        with self.lock:
            self.started = False
            self.generation += 1
            for fd in [self.kick_fd, self.call_fd] + self.retired_kicks:
                close_quietly(fd)
            self.kick_fd = self.call_fd = None
            self.retired_kicks = []

    # --- processing --------------------------------------------------------------------------
    def pop(self) -> Optional[Chain]:
        """The next available chain, or None (ring empty, stopped or broken). Raises QueueError
        (and marks the ring broken) for a bad avail index; a bad chain raises QueueError with
        the ring intact, after its head is consumed (the caller completes it as an error)."""
        with self.lock:
            if not self.started or self.broken:
                return None
            num, mem = self.num, self.memory
            try:
                avail_idx = _U16.unpack(mem.read(self.avail + 2, 2))[0]
                pending = (avail_idx - self.last_avail) & 0xFFFF
                if pending == 0:
                    return None
                if pending > num:
                    self.broken = True
                    raise QueueError(f"queue {self.index}: avail index {avail_idx} is {pending} ahead of {num} slots")
                head = _U16.unpack(mem.read(self.avail + 4 + 2 * (self.last_avail % num), 2))[0]
            except GuestMemoryError as exc:
                self.broken = True
                raise QueueError(f"queue {self.index}: avail ring unreadable: {exc}") from None
            if head in self.in_flight:
                self.broken = True
                raise QueueError(f"queue {self.index}: chain {head} made available again while in flight")
            self.in_flight.add(head)
            self.last_avail = (self.last_avail + 1) & 0xFFFF
            chain = Chain(head, generation=self.generation)
            self._walk(chain)
            return chain

    def _walk(self, chain: Chain) -> None:
        num, index = self.num, chain.head
        total = 0
        for _ in range(num):
            if index >= num:
                raise QueueError(f"queue {self.index}: descriptor index {index} >= {num}", chain)
            try:
                addr, length, flags, nxt = _DESC.unpack(self.memory.read(self.desc + 16 * index, 16))
            except GuestMemoryError as exc:
                raise QueueError(f"queue {self.index}: descriptor table unreadable: {exc}", chain) from None
            if flags & VRING_DESC_F_INDIRECT:
                raise QueueError(f"queue {self.index}: indirect descriptor (not negotiated)", chain)
            total += length
            if total > self.max_request:
                raise QueueError(f"queue {self.index}: chain of more than {self.max_request} bytes", chain)
            if flags & VRING_DESC_F_WRITE:
                chain.writable.append((addr, length))
            elif chain.writable:
                raise QueueError(f"queue {self.index}: readable descriptor after a writable one", chain)
            else:
                chain.readable.append((addr, length))
            if not flags & VRING_DESC_F_NEXT:
                return
            index = nxt
        raise QueueError(f"queue {self.index}: descriptor chain longer than the ring (a loop)", chain)

    def read_request(self, chain: Chain, limit: int) -> bytes:
        """The chain's readable bytes, at most `limit` of them. Raises GuestMemoryError."""
        out = bytearray()
        for addr, length in chain.readable:
            n = min(length, limit - len(out))
            if n <= 0:
                break
            pos = len(out)
            out.extend(bytes(n))
            self.memory.read_into(addr, out, pos, n)
        return bytes(out)

    def write_response(self, chain: Chain, data: bytes) -> int:
        """Scatters `data` over the writable buffers; the bytes written (0 when a buffer lies
        outside guest memory or data does not fit: the response is dropped, not cut)."""
        if len(data) > chain.writable_size:
            log.warning("queue %d: response of %d bytes for %d writable", self.index, len(data), chain.writable_size)
            return 0
        pos = 0
        try:
            for addr, length in chain.writable:
                if pos >= len(data):
                    break
                piece = data[pos : pos + length]
                self.memory.write(addr, piece)
                pos += len(piece)
        except GuestMemoryError as exc:
            log.warning("queue %d: response buffer refused: %s", self.index, exc)
            return 0
        return pos

    def push(self, chain: Chain, written: int) -> bool:
        """Puts (head, written) in the used ring and signals the call eventfd. False (nothing
        done) when the ring was stopped or restarted since the chain was popped."""
        with self.lock:
            if chain.generation != self.generation or not self.started:
                log.info("queue %d: chain %d of a stopped ring dropped", self.index, chain.head)
                return False
            self.in_flight.discard(chain.head)
            slot = self.used_idx % self.num
            try:
                self.memory.write(self.used + 4 + 8 * slot, _USED_ELEM.pack(chain.head, written))
                self.used_idx = (self.used_idx + 1) & 0xFFFF
                self.memory.write(self.used + 2, _U16.pack(self.used_idx))
            except GuestMemoryError as exc:
                self.broken = True
                log.error("queue %d: used ring unwritable (%s): queue stopped", self.index, exc)
                return False
            call_fd = self.call_fd
        if call_fd is not None:
            try:
                os.write(call_fd, _EVENT.pack(1))
            except OSError as exc:
                log.warning("queue %d: call eventfd: %s", self.index, exc)
        return True

    def complete(self, chain: Chain, response: bytes) -> bool:
        """write_response + push."""
        return self.push(chain, self.write_response(chain, response))


def _non_blocking(fd: Optional[int]) -> None:
    """Makes the front-end's kick or call descriptor non-blocking: a blocked read or write
    on it would hang the thread serving the ring (QEMU's own event notifiers are
    non-blocking already)."""
    if fd is None:
        return
    try:
        os.set_blocking(fd, False)
    except OSError as exc:
        log.warning("descriptor %d cannot be made non-blocking: %s", fd, exc)
