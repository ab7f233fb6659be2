"""Shared-memory resources (blobs) of one context, with their real sizes.

Theory of operation: virglrenderer maps each blob of a context and keeps res_id -> (fd,
mapping, size). Here a resource is any writable buffer the caller hands over (an mmap in
production, a bytearray in tests). The host keeps a byte view of it, its length, and its
address for ggml calls; the ctypes anchor that yields the address also pins the buffer, so
it cannot be unmapped or resized under a ggml buffer that wraps it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from apir.codec.atomics import Word
from apir.codec.wire import Encoder

if TYPE_CHECKING:
    from typing_extensions import Buffer  # any bytes-like object (collections.abc.Buffer in 3.12)

__all__ = ["Resource", "NOTIFICATION_SIZE"]

NOTIFICATION_SIZE = 4  # the u32 reply notification word at byte 0 of a reply resource


@dataclass(eq=False)
class Resource:
    """One blob: `memory` (writable byte view), `size` in bytes, `address` of byte 0."""

    res_id: int
    memory: memoryview
    size: int
    address: int
    _anchor: object
    _word: Optional[Word] = field(default=None, repr=False)
    _encoder: Optional[Encoder] = field(default=None, repr=False)

    @classmethod
    def wrap(cls, res_id: int, buffer: Buffer) -> "Resource":
        """Raises TypeError / ValueError for a read-only, empty or non-contiguous buffer."""
        view = memoryview(buffer)
        if view.readonly:
            raise ValueError(f"resource {res_id}: buffer is read-only")
        if not view.c_contiguous:
            raise ValueError(f"resource {res_id}: buffer is not contiguous")
        view = view.cast("B") if (view.format != "B" or view.ndim != 1) else view
        if len(view) == 0:
            raise ValueError(f"resource {res_id}: empty buffer")
        anchor = (ctypes.c_char * len(view)).from_buffer(view)
        return cls(res_id, view, len(view), ctypes.addressof(anchor), anchor)

    def notification_word(self) -> Word:
        """The u32 at byte 0 (the reply notification word), checked on first use and kept.
        Raises ValueError when the resource is shorter than 4 bytes or misaligned."""
        word = self._word
        if word is None:
            word = self._word = Word(self.memory, 0)
        return word

    def reply_encoder(self) -> Encoder:
        """An Encoder over this resource as a reply: from byte NOTIFICATION_SIZE (after the
        notification word) to its end, reset; made on first use and kept, so a command does
        not pay for a new one (the caller holds its context's lock, the only user)."""
        enc = self._encoder
        if enc is None:
            enc = self._encoder = Encoder(self.memory, NOTIFICATION_SIZE, self.size)
        else:
            enc.reset()
        return enc

    def release(self) -> None:
        """Drops the pin; the memory must not be used through this object afterwards."""
        self._anchor = None
        self._word = None  # its numpy view is an export of `memory`
        self._encoder = None  # (so is its view)
        self.memory.release()
