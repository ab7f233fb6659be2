"""What the vhost-user front-ends of one host process hold: bounded per front-end and in all.

Theory of operation: each front-end (one VM) has a `Share`, to which its device and memory
table charge what they hold: descriptors (FDS: a HOST3D blob's memfd, a guest memory region
read through a descriptor, and the copy Python's mmap keeps of a mapped file before 3.13),
HOST3D blob bytes (BLOB_BYTES), memory regions (MEM_REGIONS) and their bytes (MEM_BYTES:
address space, a sparse memfd costs no RAM). A charge must fit the front-end's own limits and,
added to every other front-end's, the process's (`PROCESS`); else nothing is charged and the
caller refuses that one request (a virtio-gpu error response, a failed REPLY_ACK). So a VM
that runs out gets errors, and cannot take what the process needs to serve the others
(descriptors, address space for threads' stacks and ggml's buffers). Charges are taken before
the thing is made, and given back when it is gone. Keys and defaults: apir.host.config
(apir.vhost.*); docs/security.md, section 2.
"""

from __future__ import annotations

import mmap
import resource
import sys
import threading
from typing import Dict, Mapping, Optional

from apir.host.backend.budget import physical_memory
from apir.host.config import (
    CONFIG_KEY_VHOST_MAX_BLOB_BYTES,
    CONFIG_KEY_VHOST_MAX_FDS,
    CONFIG_KEY_VHOST_MAX_MEM_BYTES,
    CONFIG_KEY_VHOST_MAX_MEM_REGIONS,
    CONFIG_KEY_VHOST_PROCESS_MAX_BLOB_BYTES,
    CONFIG_KEY_VHOST_PROCESS_MAX_FDS,
    CONFIG_KEY_VHOST_PROCESS_MAX_MEM_BYTES,
    CONFIG_KEY_VHOST_PROCESS_MAX_MEM_REGIONS,
    DEFAULT_VHOST_MAX_BLOB_BYTES,
    DEFAULT_VHOST_MAX_MEM_BYTES,
    DEFAULT_VHOST_MAX_MEM_REGIONS,
    DEFAULT_VHOST_PROCESS_MAX_MEM_BYTES,
    DEFAULT_VHOST_PROCESS_MAX_MEM_REGIONS,
    config_limit,
)

__all__ = ["FDS", "BLOB_BYTES", "MEM_REGIONS", "MEM_BYTES", "Pool", "Share", "PROCESS", "MMAP_HOLDS_FD", "map_fd"]

FDS, BLOB_BYTES, MEM_REGIONS, MEM_BYTES = "descriptors", "blob bytes", "memory regions", "memory bytes"

# Python's mmap keeps a duplicate of the file's descriptor, unless told not to (3.13's trackfd).
MMAP_HOLDS_FD = sys.version_info < (3, 13)


def map_fd(fd: int, length: int, offset: int = 0) -> mmap.mmap:
    """A shared read-write mapping of `length` bytes at `offset` of `fd`, holding no
    descriptor of its own where Python allows it (see MMAP_HOLDS_FD). Raises as mmap does."""
    extra = {} if MMAP_HOLDS_FD else {"trackfd": False}
    return mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset, **extra)


def _nofile() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def _limits(config: Optional[Mapping[str, str]]) -> "tuple[Dict[str, int], Dict[str, int]]":
    """(per front-end, per process) limits from `config`, defaults filled in."""
    nofile = _nofile()

    def get(key: str, default: int) -> int:
        return int(config_limit(config, key, default))

    own = {
        FDS: get(CONFIG_KEY_VHOST_MAX_FDS, nofile // 4),
        BLOB_BYTES: get(CONFIG_KEY_VHOST_MAX_BLOB_BYTES, DEFAULT_VHOST_MAX_BLOB_BYTES),
        MEM_REGIONS: get(CONFIG_KEY_VHOST_MAX_MEM_REGIONS, DEFAULT_VHOST_MAX_MEM_REGIONS),
        MEM_BYTES: get(CONFIG_KEY_VHOST_MAX_MEM_BYTES, DEFAULT_VHOST_MAX_MEM_BYTES),
    }
    every = {
        FDS: get(CONFIG_KEY_VHOST_PROCESS_MAX_FDS, nofile // 2),
        BLOB_BYTES: get(CONFIG_KEY_VHOST_PROCESS_MAX_BLOB_BYTES, physical_memory() or (1 << 62)),
        MEM_REGIONS: get(CONFIG_KEY_VHOST_PROCESS_MAX_MEM_REGIONS, DEFAULT_VHOST_PROCESS_MAX_MEM_REGIONS),
        MEM_BYTES: get(CONFIG_KEY_VHOST_PROCESS_MAX_MEM_BYTES, DEFAULT_VHOST_PROCESS_MAX_MEM_BYTES),
    }
    return own, every


_KEYS = {
    FDS: (CONFIG_KEY_VHOST_MAX_FDS, CONFIG_KEY_VHOST_PROCESS_MAX_FDS),
    BLOB_BYTES: (CONFIG_KEY_VHOST_MAX_BLOB_BYTES, CONFIG_KEY_VHOST_PROCESS_MAX_BLOB_BYTES),
    MEM_REGIONS: (CONFIG_KEY_VHOST_MAX_MEM_REGIONS, CONFIG_KEY_VHOST_PROCESS_MAX_MEM_REGIONS),
    MEM_BYTES: (CONFIG_KEY_VHOST_MAX_MEM_BYTES, CONFIG_KEY_VHOST_PROCESS_MAX_MEM_BYTES),
}


class Pool:
    """What all front-ends of a process hold (`used`). Thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.used: Dict[str, int] = {FDS: 0, BLOB_BYTES: 0, MEM_REGIONS: 0, MEM_BYTES: 0}


PROCESS = Pool()  # the one pool of this process


class Share:
    """One front-end's holdings (`held`), within its limits (`own`) and the process's
    (`every`, against `pool`)."""

    def __init__(self, config: Optional[Mapping[str, str]] = None, pool: Pool = PROCESS):
        self.own, self.every = _limits(config)
        self.pool = pool
        self.held: Dict[str, int] = {FDS: 0, BLOB_BYTES: 0, MEM_REGIONS: 0, MEM_BYTES: 0}

    def take(self, amounts: Mapping[str, int], credit: Optional[Mapping[str, int]] = None) -> Optional[str]:
        """Charges `amounts` if each fits both bounds; None, or why not (nothing charged).
        `credit`: what the caller holds and is about to give back (a memory table being
        replaced), not counted against the bounds."""
        with self.pool.lock:
            for kind, n in amounts.items():
                n -= (credit or {}).get(kind, 0)
                if self.held[kind] + n > self.own[kind]:
                    return (
                        f"{n} more {kind} over the front-end's limit ({_KEYS[kind][0]}): "
                        f"{self.held[kind]} of {self.own[kind]} held"
                    )
                if self.pool.used[kind] + n > self.every[kind]:
                    return (
                        f"{n} more {kind} over the process's limit ({_KEYS[kind][1]}): "
                        f"{self.pool.used[kind]} of {self.every[kind]} held by all front-ends"
                    )
            for kind, n in amounts.items():  # (the credit is given back by its holder)
                self.held[kind] += n
                self.pool.used[kind] += n
        return None

    def give(self, amounts: Mapping[str, int]) -> None:
        """Refunds what `take` charged."""
        with self.pool.lock:
            for kind, n in amounts.items():
                self.held[kind] -= n
                self.pool.used[kind] -= n
