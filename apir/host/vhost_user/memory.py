"""Guest RAM through the vhost-user memory table, with every access bounds-checked.

Theory of operation: the front-end shares the VM's RAM as memfds: SET_MEM_TABLE replaces the
whole table, ADD_MEM_REG / REM_MEM_REG (CONFIGURE_MEM_SLOTS) add and remove one region. Each
region maps guest physical addresses [gpa, gpa + size) to `size` bytes at `mmap_offset` of its
file, and QEMU's own address of it (`uva`, which SET_VRING_ADDR uses). `GuestMemory` maps each
region here and copies bytes in and out: `read(gpa, n)` and `write(gpa, data)` refuse with
`GuestMemoryError` any range that is not wholly inside one region (guest addresses come from
the guest and are hostile; nothing is read outside what the front-end shared). Copies, not
views: a region can be removed while another thread works, and a view would keep a removed
mapping alive or crash on it. One lock serialises table changes with accesses.

The front-end keeps the file, and may truncate it: a mapped page past the new end faults
(SIGBUS), which would take down the host process and every VM it serves. A file sealed
against shrinking (QEMU's memory-backend-memfd, seal=on by default) is mapped; any other
regular file is read and written with pread / pwrite on a descriptor of its own, where a
truncated range is a short read (GuestMemoryError), not a fault. A file that takes no
pwrite (hugetlbfs) must be sealed; anything else (a pipe, a device) is refused.

What the regions hold (their count, bytes of address space, descriptors) is charged to the
front-end's `Share` before a region is made (apir.host.vhost_user.process_limits): a table
past its bounds is refused, however sparse its files.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from apir.errors import ApirError
from apir.host.vhost_user.process_limits import FDS, MEM_BYTES, MEM_REGIONS, MMAP_HOLDS_FD, Share, map_fd
from apir.host.vhost_user.protocol import close_quietly

__all__ = ["GuestMemory", "GuestMemoryError", "Region", "MAX_MEM_SLOTS"]

log = logging.getLogger(__name__)

MAX_MEM_SLOTS = 509  # what GET_MAX_MEM_SLOTS answers (libvhost-user's VHOST_USER_MAX_RAM_SLOTS)
_ADDR_LIMIT = 1 << 64
_PAGE = mmap.PAGESIZE


class GuestMemoryError(ApirError, ValueError):
    """A guest range outside the memory table, or a region the table cannot take."""


@dataclass
class Region:
    """One memory table entry: guest `gpa`, `size` bytes, QEMU's `uva`. Either mapped (`mm`,
    whose byte `delta` is guest byte `gpa`) or, for a file that can shrink under us, reached
    through `fd` (its own descriptor), where guest byte `gpa` is file byte `delta`. `charge`:
    what it holds of `share`, given back by `close`."""

    gpa: int
    size: int
    uva: int
    mm: Optional[mmap.mmap]
    delta: int
    fd: Optional[int] = None
    share: Optional[Share] = None
    charge: Dict[str, int] = field(default_factory=dict)

    def read(self, off: int, n: int) -> bytes:
        """n bytes at offset `off` of the mapping or file. Raises GuestMemoryError."""
        if self.mm is not None:
            return self.mm[off : off + n]
        assert self.fd is not None
        parts, got = [], 0
        while got < n:
            try:
                piece = os.pread(self.fd, n - got, off + got)
            except OSError as exc:
                raise GuestMemoryError(f"guest memory file unreadable: {exc}") from None
            if not piece:
                raise GuestMemoryError(f"guest memory file ends before {off + n:#x} (truncated by the front-end)")
            parts.append(piece)
            got += len(piece)
        return b"".join(parts)

    def write(self, off: int, data: bytes) -> None:
        """Stores `data` at offset `off`. Raises GuestMemoryError."""
        if self.mm is not None:
            self.mm[off : off + len(data)] = data
            return
        assert self.fd is not None
        view, done = memoryview(data), 0
        while done < len(data):
            try:
                done += os.pwrite(self.fd, view[done:], off + done)
            except OSError as exc:
                raise GuestMemoryError(f"guest memory file unwritable: {exc}") from None

    def close(self) -> None:
        close_quietly(self.fd)
        self.fd = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # an export still alive (should not happen: only copies go out)
                log.error("guest memory region gpa=%#x still exported; left to the collector", self.gpa)
        if self.share is not None and self.charge:
            self.share.give(self.charge)
            self.charge = {}


def _shrink_sealed(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:  # not a file that takes seals
        return False


class GuestMemory:
    """The memory table of one front-end, charged to `share` (its bounds). Thread-safe."""

    def __init__(self, share: Optional[Share] = None):
        self.share = share if share is not None else Share()
        self._regions: List[Region] = []
        self._lock = threading.Lock()

    # --- the table --------------------------------------------------------------------------
    def map_region(self, fd: int, gpa: int, size: int, uva: int, mmap_offset: int, replacing: bool = False) -> Region:
        """Maps `size` bytes at `mmap_offset` of `fd` (the caller closes fd), charged to the
        share first; `replacing`: a region of a table that will replace this one (set_table),
        so the bounds do not count what the current table holds. Raises GuestMemoryError for
        an empty or wrapping region, one mmap cannot express or one past the share's bounds,
        OSError or ValueError (past the file's end) when mmap fails."""
        if size <= 0 or gpa + size > _ADDR_LIMIT or uva + size > _ADDR_LIMIT or mmap_offset + size > _ADDR_LIMIT:
            raise GuestMemoryError(f"bad memory region gpa={gpa:#x} size={size:#x} offset={mmap_offset:#x}")
        sealed = _shrink_sealed(fd)
        charge = {MEM_REGIONS: 1, MEM_BYTES: size, FDS: 1 if not sealed or MMAP_HOLDS_FD else 0}
        why = self.share.take(charge, self._held() if replacing else None)
        if why is not None:
            raise GuestMemoryError(f"memory region gpa={gpa:#x} size={size:#x}: {why}")
        try:
            make = self._mapped if sealed else self._file_region
            region = make(fd, gpa, size, uva, mmap_offset)
        except BaseException:
            self.share.give(charge)
            raise
        region.share, region.charge = self.share, charge
        return region

    @staticmethod
    def _mapped(fd: int, gpa: int, size: int, uva: int, mmap_offset: int) -> Region:
        start = mmap_offset - mmap_offset % _PAGE
        delta = mmap_offset - start
        try:
            mm = map_fd(fd, size + delta, start)
        except OverflowError:  # a length over ssize_t or an offset over off_t: refused, not a crash
            raise GuestMemoryError(f"memory region size={size:#x} offset={mmap_offset:#x} cannot be mapped") from None
        return Region(gpa, size, uva, mm, delta)

    @staticmethod
    def _file_region(fd: int, gpa: int, size: int, uva: int, offset: int) -> Region:
        """A region of a file the front-end can truncate: reached with pread / pwrite."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise GuestMemoryError(f"memory region gpa={gpa:#x}: not a regular file, nor sealed against shrinking")
        if offset + size > st.st_size:
            raise GuestMemoryError(f"memory region size={size:#x} offset={offset:#x} past the file's end")
        own = os.dup(fd)
        try:
            os.pwrite(own, b"", offset)  # hugetlbfs takes no write(): it must be sealed (and mapped)
        except OSError as exc:
            os.close(own)
            raise GuestMemoryError(
                f"memory region gpa={gpa:#x}: a file without pwrite ({exc}) must be sealed against shrinking"
            ) from None
        return Region(gpa, size, uva, None, offset, fd=own)

    def set_table(self, regions: List[Region]) -> None:
        """SET_MEM_TABLE: replaces every region. Raises GuestMemoryError (and closes the new
        regions) when they overlap or are too many; the old table stays then."""
        try:
            self._check(regions)
        except GuestMemoryError:
            for r in regions:
                r.close()
            raise
        with self._lock:
            old, self._regions = self._regions, list(regions)
        for r in old:
            r.close()

    def add(self, region: Region) -> None:
        """ADD_MEM_REG. Raises GuestMemoryError (and closes `region`) for an overlap or a full
        table."""
        with self._lock:
            try:
                self._check(self._regions + [region])
            except GuestMemoryError:
                region.close()
                raise
            self._regions.append(region)

    def remove(self, gpa: int, size: int) -> bool:
        """REM_MEM_REG: drops the region at exactly (gpa, size). False when none matches."""
        with self._lock:
            for i, r in enumerate(self._regions):
                if r.gpa == gpa and r.size == size:
                    del self._regions[i]
                    break
            else:
                return False
        r.close()
        return True

    def close(self) -> None:
        """Unmaps every region."""
        with self._lock:
            old, self._regions = self._regions, []
        for r in old:
            r.close()

    def _held(self) -> Dict[str, int]:
        """What the current table's regions hold of the share."""
        held: Dict[str, int] = {}
        with self._lock:
            for r in self._regions:
                for kind, n in r.charge.items():
                    held[kind] = held.get(kind, 0) + n
        return held

    @property
    def max_regions(self) -> int:
        """The regions this front-end may hold (what GET_MAX_MEM_SLOTS answers)."""
        return min(MAX_MEM_SLOTS, self.share.own[MEM_REGIONS])

    def _check(self, regions: List[Region]) -> None:
        ordered = sorted(regions, key=lambda r: r.gpa)
        for a, b in zip(ordered, ordered[1:]):
            if a.gpa + a.size > b.gpa:
                raise GuestMemoryError(f"memory regions at {a.gpa:#x} and {b.gpa:#x} overlap")

    @property
    def region_count(self) -> int:
        return len(self._regions)

    # --- addresses --------------------------------------------------------------------------
    def uva_to_gpa(self, uva: int) -> int:
        """QEMU's address `uva` as a guest physical address. Raises GuestMemoryError."""
        with self._lock:
            for r in self._regions:
                if r.uva <= uva < r.uva + r.size:
                    return r.gpa + (uva - r.uva)
        raise GuestMemoryError(f"front-end address {uva:#x} is outside guest memory")

    def _find(self, gpa: int, n: int) -> Tuple[Region, int]:
        if gpa < 0 or n < 0 or gpa + n > _ADDR_LIMIT:
            raise GuestMemoryError(f"guest range {gpa:#x}+{n:#x} is not an address range")
        for r in self._regions:
            if r.gpa <= gpa and gpa + n <= r.gpa + r.size:
                return r, r.delta + (gpa - r.gpa)
        raise GuestMemoryError(f"guest range {gpa:#x}+{n:#x} is outside guest memory (or spans regions)")

    def contains(self, gpa: int, n: int) -> bool:
        """Whether [gpa, gpa + n) lies inside one region."""
        with self._lock:
            try:
                self._find(gpa, n)
            except GuestMemoryError:
                return False
            return True

    # --- bytes ------------------------------------------------------------------------------
    def read(self, gpa: int, n: int) -> bytes:
        """A copy of guest bytes [gpa, gpa + n). Raises GuestMemoryError."""
        with self._lock:
            r, off = self._find(gpa, n)
            return r.read(off, n)

    def write(self, gpa: int, data: bytes) -> None:
        """Stores `data` at guest address `gpa`. Raises GuestMemoryError (nothing written)."""
        with self._lock:
            r, off = self._find(gpa, len(data))
            r.write(off, data)

    def read_into(self, gpa: int, out: bytearray, pos: int, n: int) -> None:
        """Copies guest bytes [gpa, gpa + n) into out[pos : pos + n]. Raises GuestMemoryError."""
        with self._lock:
            r, off = self._find(gpa, n)
            out[pos : pos + n] = r.read(off, n)
