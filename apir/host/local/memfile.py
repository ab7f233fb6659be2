"""One context's shared memory file: every blob of the context is a range of it.

Theory of operation: a kernel render node hands the guest one fd and, per blob, an mmap offset
(DRM_IOCTL_VIRTGPU_MAP). The local transport does the same with a memfd: the host creates it once
per context, passes it to the guest, and places each blob at a 16 KiB aligned offset, growing the
file with ftruncate when no freed range fits. The host maps each blob on its own (one mmap per
blob, handed to the HostContext as the resource's memory, holding no descriptor of its own:
apir.local.shm); the guest maps the same range with ``mmap(fd, size, offset)``. A freed blob's
pages are returned to the system (MADV_REMOVE) and its range is reused.

Its size is charged, as it grows, to the share of the peer it serves (apir.host.local.peers:
bounded per peer and in all), and given back when it is closed.

The file is sealed against shrinking (F_SEAL_SHRINK): the guest holds the fd, and a guest that
truncated it would make the host's mappings fault (SIGBUS) instead of failing cleanly.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Optional, Protocol

from apir.codec.virtgpu import BLOB_ALIGNMENT
from apir.errors import ApirError
from apir.local.shm import map_shared

__all__ = ["MemFile", "MemFileFull", "HostBlob"]

log = logging.getLogger(__name__)


class MemFileFull(ApirError):
    """The context's blobs would exceed the file's size limit (the guest gets ENOMEM)."""


@dataclass
class HostBlob:
    """A blob as the host holds it: its range in the file and the host's mapping of it."""

    offset: int
    size: int
    memory: mmap.mmap


class Share(Protocol):
    """What a file's growth is charged to: `take` gives None or why not (nothing charged)."""

    def take(self, nbytes: int) -> Optional[str]: ...

    def give(self, nbytes: int) -> None: ...


def align_up(value: int, alignment: int = BLOB_ALIGNMENT) -> int:
    return (value + alignment - 1) // alignment * alignment


class MemFile:
    """A sealed memfd holding the blobs of one context.

    `limit` bounds the file size in bytes (the sum of live blob ranges plus holes); `share`,
    if given, is charged the file's size too. Thread-safe: one lock around the range
    bookkeeping.
    """

    def __init__(self, name: str = "apir-context", limit: int = 1 << 36, share: Optional[Share] = None):
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        except BaseException:
            os.close(self.fd)
            raise
        self.limit = limit
        self.share = share
        self.file_size = 0
        self._free: list[tuple[int, int]] = []  # (offset, size), sorted, coalesced
        self._live: dict[int, HostBlob] = {}  # offset -> blob
        self._lock = threading.Lock()

    # --- bookkeeping -----------------------------------------------------------------------
    @property
    def blob_count(self) -> int:
        return len(self._live)

    @property
    def blob_bytes(self) -> int:
        with self._lock:
            return sum(b.size for b in self._live.values())

    def _take_range(self, size: int) -> int:
        for i, (off, free_size) in enumerate(self._free):
            if free_size >= size:
                if free_size == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free_size - size)
                return off
        # No hole fits: append at the end; a trailing hole is absorbed into the new range
        # (taken off the free list only once the file has grown).
        tail = bool(self._free) and self._free[-1][0] + self._free[-1][1] == self.file_size
        off = self._free[-1][0] if tail else self.file_size
        if off + size > self.limit:
            raise MemFileFull(f"{size} more bytes would exceed the context's {self.limit}-byte limit")
        grow = off + size - self.file_size
        why = self.share.take(grow) if self.share is not None else None
        if why is not None:
            raise MemFileFull(f"{size} more bytes refused: {why}")
        try:
            os.ftruncate(self.fd, off + size)  # the seal forbids shrinking, not growing
        except BaseException:
            if self.share is not None:
                self.share.give(grow)
            raise
        self.file_size = off + size
        if tail:
            self._free.pop()
        return off

    def _give_range(self, off: int, size: int) -> None:
        free = self._free
        free.append((off, size))
        free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self._free = merged

    # --- blobs -----------------------------------------------------------------------------
    def allocate(self, size: int) -> HostBlob:
        """A new zero-filled blob of `size` bytes rounded up to BLOB_ALIGNMENT.

        Raises ValueError for size <= 0, MemFileFull past the limit, OSError if mmap fails.
        """
        if size <= 0:
            raise ValueError(f"blob size must be positive, got {size}")
        size = align_up(size)
        with self._lock:
            off = self._take_range(size)
            try:
                memory = map_shared(self.fd, size, off)  # no descriptor per blob
            except BaseException:
                self._give_range(off, size)
                raise
            blob = HostBlob(off, size, memory)
            self._live[off] = blob
            return blob

    def free(self, blob: HostBlob) -> None:
        """Release the blob's pages and make its range reusable. Idempotent."""
        with self._lock:
            if self._live.pop(blob.offset, None) is not blob:
                return
            # Drop the pages now so a reused range reads back as zeros, like a fresh blob.
            try:
                blob.memory.madvise(mmap.MADV_REMOVE)
            except (OSError, ValueError):
                log.debug("MADV_REMOVE failed on blob at offset %d", blob.offset, exc_info=True)
            try:
                blob.memory.close()
            except BufferError:
                # Someone still exports a view of it; the mapping goes when they drop it.
                log.warning("blob at offset %d still referenced; unmapped later", blob.offset)
            self._give_range(blob.offset, blob.size)

    def close(self) -> None:
        """Free every blob and close the fd (the guest's own fd and mappings stay valid)."""
        for blob in list(self._live.values()):
            self.free(blob)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            if self.share is not None:
                self.share.give(self.file_size)
