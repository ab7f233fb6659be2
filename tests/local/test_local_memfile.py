"""The per-context shared memory file: aligned ranges, reuse, sharing, seals and limits."""

import fcntl
import mmap
import os

import pytest

from apir.host.local.memfile import MemFile, MemFileFull


def test_ranges_are_aligned_shared_and_reused():
    mf = MemFile(limit=1 << 20)
    try:
        a, b = mf.allocate(1), mf.allocate(20000)
        assert (a.offset, a.size, b.offset, b.size) == (0, 16384, 16384, 32768)
        assert mf.file_size == os.fstat(mf.fd).st_size == 49152
        # another mapping of the same fd at b's offset sees the host's writes: what a guest does
        guest = mmap.mmap(mf.fd, b.size, offset=b.offset)
        b.memory[100:104] = b"abcd"
        assert guest[100:104] == b"abcd"
        guest.close()
        a.memory[0:4] = b"xxxx"
        mf.free(a)
        c = mf.allocate(16384)
        assert (c.offset, bytes(c.memory[0:4])) == (0, b"\0\0\0\0")  # reused and zeroed
        assert (mf.blob_count, mf.blob_bytes) == (2, 49152)
    finally:
        mf.close()


def test_freed_neighbours_merge_and_the_limit_holds():
    mf = MemFile(limit=4 * 16384)
    try:
        blobs = [mf.allocate(16384) for _ in range(4)]
        with pytest.raises(MemFileFull):
            mf.allocate(1)
        mf.free(blobs[1])
        mf.free(blobs[2])
        big = mf.allocate(2 * 16384)  # fits only in the merged hole
        assert big.offset == 16384
        with pytest.raises(ValueError):
            mf.allocate(0)
    finally:
        mf.close()


def test_the_guest_cannot_shrink_the_file_under_the_host():
    mf = MemFile()
    try:
        mf.allocate(16384)
        assert fcntl.fcntl(mf.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        with pytest.raises(PermissionError):
            os.ftruncate(mf.fd, 0)
    finally:
        mf.close()
