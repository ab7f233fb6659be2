"""`ExecRing`: the local transport's exec ring, one page of shared memory for EXECBUFFERs.

Theory of operation: a socket message each way costs a small call two wake-ups and a handful
of system calls, more than the rest of the call. The exec ring carries the command through the
context's shared memory file instead, one command at a time, with notification suppression as
in a virtqueue (docs/local-transport.md, "The exec ring"):

- the guest writes the request payload and the command, stores the command's sequence number
  in `posted` (release), then reads `polling` after a full fence and KICKs on the socket if 0;
- the host, while it polls (`polling` 1), spins on `posted` without a system call, copies the
  command out (the guest could change the page under it), runs it as an EXECBUFFER message's,
  and stores the errno in `err` and then the sequence number in `done` (release);
- before it blocks, the host stores `polling` 0 and reads `posted` after a full fence: one of
  the two fenced store-then-load pairs sees the other side's store, so no command is missed.

The layout is apir.local.wire's RING_*; the host (apir.host.local.server) and `LocalDevice`
(apir.guest.local) each use this class on their own mapping. The guest trusts nothing here
beyond its own words; the host reads each guest word once and bounds the command by
MAX_RING_COMMAND.
"""

from __future__ import annotations

import numpy as np

from apir.codec.atomics import Word, as_word_array
from apir.local.wire import (
    MAX_RING_COMMAND,
    REQUEST,
    RING_COMMAND,
    RING_DONE,
    RING_ERR,
    RING_HEADER,
    RING_POLLING,
    RING_POSTED,
    RING_SIZE,
    Op,
)

__all__ = ["ExecRing"]

_HEADER = REQUEST[Op.EXECBUFFER]  # flags, size, ring_idx, pad


class ExecRing:
    """The exec ring in `memory` (a writable buffer of at least RING_SIZE bytes, 4-byte
    aligned: a mapping of the ring's page). Holds numpy views of `memory`: an mmap cannot be
    closed while this object lives. ValueError for a short or read-only buffer."""

    def __init__(self, memory):
        arr = as_word_array(memory)
        if arr.size < RING_SIZE:
            raise ValueError(f"an exec ring needs {RING_SIZE} bytes, got {arr.size}")
        self.array: np.ndarray = arr
        self.view: memoryview = arr.data  # slices of it copy bytes in and out quickest
        self.posted = Word(arr, RING_POSTED)
        self.done = Word(arr, RING_DONE)
        self.err = Word(arr, RING_ERR)
        self.polling = Word(arr, RING_POLLING)

    # --- the guest's side --------------------------------------------------------------------
    def post(self, flags: int, ring_idx: int, command, seq: int) -> bool:
        """Writes the command (at most MAX_RING_COMMAND bytes) and its EXECBUFFER header, then
        publishes `seq` (1 .. 2**32-1) in `posted`; whether the host is polling (False: the
        caller must KICK). ValueError for a command too long or a `seq` of 0."""
        size = len(command)
        if size > MAX_RING_COMMAND:
            raise ValueError(f"a command of {size} bytes does not fit the exec ring ({MAX_RING_COMMAND})")
        if not 0 < seq <= 0xFFFFFFFF:
            raise ValueError(f"exec ring sequence numbers are 1 .. 2**32-1, got {seq}")
        view = self.view
        view[RING_COMMAND : RING_COMMAND + size] = command
        _HEADER.pack_into(view, RING_HEADER, flags, size, ring_idx, 0)
        return self.posted.store_then_load(seq, self.polling) != 0

    # --- the host's side ---------------------------------------------------------------------
    def take(self) -> tuple[int, int, int, bytes]:
        """The posted command as the host runs it: (flags, ring_idx, size, command bytes), all
        copied out of the page once; `size` is the guest's word, the command is empty when that
        exceeds MAX_RING_COMMAND (the caller refuses it)."""
        view = self.view
        flags, size, ring_idx, _pad = _HEADER.unpack_from(view, RING_HEADER)
        command = bytes(view[RING_COMMAND : RING_COMMAND + size]) if size <= MAX_RING_COMMAND else b""
        return flags, ring_idx, size, command

    def finish(self, seq: int, err: int) -> None:
        """Publishes command `seq` as run: `err` (0 or an errno), then `done` (release)."""
        self.err.store_release_both(err, self.done, seq)
