"""Repeated graphs: a context's checked, built host graphs, reused when a graph comes again.

Theory of operation: a guest decoding tokens, or embedding batch after batch, sends a graph
of the same structure for every step; parsing, checking and building it again costs far more
than computing a small one. After a graph passed every check and was built (`apir.host.graph`),
its `GraphCacheEntry` keeps the host `ggml_context` it lives in, keyed by the graph's
structure (`graph_key`): every byte of the validated private copy that the host reads, except
the guest's tensor ids, which only link tensors and are replaced by the links they make (node,
src and view_src indices). A name is read up to its first NUL only. A later graph is served from the cache only when

- its key is byte-for-byte equal to the entry's (the whole key is compared, no hash decides),
- every buffer handle it names still maps to the very `HostBuffer` object the checks saw
  (identity: a freed and reallocated buffer never matches; the entry holds the object so its
  identity cannot be reused), and
- the rules that read guest memory before compute (row ids, `shapes.base.row_ids`: the only
  way a rule reads tensor data) pass again on fresh copies of that memory; the host tensors are
  pointed at the new copies (where kernels read device memory: the new copies are uploaded
  into the context's device buffer for row ids again, as the build does, since any later
  graph overwrites or replaces that buffer).

Everything else the checks used is a function of those bytes and those buffers, or is checked
again on every compute anyway (the work-size bound, which depends on the thread count). A key
that differs anywhere, a buffer that changed, or a refusal in the re-check drops the entry;
the graph then goes through the full checks as if never seen.

Bounds: per context (`PythonBackendLibrary.graph_cache`), at most `max_entries` entries and
`max_bytes` bytes of keys plus host contexts, least recently used evicted first. An entry in
use is taken out of the cache (`take`) and put back after the compute (`put`), so two threads
never share one. `drop_buffer` frees the entries naming a buffer being freed; `clear` all.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional

import numpy as np

from apir.ggml.layout import tensor_record
from apir.host.graph import point_at_device_copies
from apir.host.profiles import CPU
from apir.host.shapes import OpEnums, TensorInfo, check_node
from apir.host.tensors import Scratch

__all__ = ["GraphCache", "GraphCacheEntry", "graph_key", "DEFAULT_MAX_ENTRIES", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_ENTRIES = 8
DEFAULT_MAX_BYTES = 64 << 20


@functools.lru_cache(maxsize=8)
def _key_mask(rpc: np.dtype) -> np.ndarray:
    """1 for each byte of an apir_rpc_tensor record the host reads, except the ids (`id`,
    `src`, `view_src`, which `graph_key` replaces by indices); 0 for those, for `padding` and
    for the holes between fields, which no check, rule or build step reads (the C guest
    leaves them uninitialized, so keying on them would only make equal graphs differ)."""
    mask = np.zeros(rpc.itemsize, np.uint8)
    fields: Mapping[str, tuple] = rpc.fields or {}
    for name, spec in fields.items():
        if name not in ("id", "src", "view_src", "padding"):
            mask[spec[1] : spec[1] + spec[0].itemsize] = 1
    return mask


def graph_key(parsed) -> bytes:
    """The structure of a parsed graph as bytes: its records' bytes with `id`, `src`,
    `view_src`, `padding`, the holes between fields (`_key_mask`) and each name's bytes after
    its first NUL zeroed, then its node, src and
    view_src index arrays (which say what those ids linked). Two graphs with equal keys differ
    at most in the guest's names for their tensors and in bytes the host never reads."""
    t = parsed.tensors
    rows = np.ascontiguousarray(t).view(np.uint8).reshape(len(t), t.dtype.itemsize) * _key_mask(t.dtype)
    # a name is read up to its first NUL (build_graph copies it as ggml_set_name would); the C
    # guest sends the bytes after it uninitialized, different for every token of a decode. A
    # name without a NUL (refused by the checks) is kept whole.
    at = t.dtype.fields["name"][1]
    names = rows[:, at : at + t.dtype.fields["name"][0].itemsize]
    nul = names == 0
    first = nul.argmax(axis=1)
    after = np.arange(names.shape[1]) > first[:, None]
    after &= nul[np.arange(len(names)), first][:, None]
    names[after] = 0
    return b"".join(
        (
            np.int64(len(t)).tobytes(),
            np.int64(len(parsed.node_index)).tobytes(),
            rows.tobytes(),
            np.ascontiguousarray(parsed.node_index, np.int32).tobytes(),
            np.ascontiguousarray(parsed.src_index, np.int32).tobytes(),
            np.ascontiguousarray(parsed.view_src_index, np.int32).tobytes(),
        )
    )


def _unread_copy(info: TensorInfo) -> TensorInfo:
    """`info` as before any rule read its data (no snapshot, no readers, not one-thread-only).
    A shallow copy of its fields, as dataclasses.replace makes, without re-running __init__
    (4x the time, for every tensor a re-check touches on every hit)."""
    new = object.__new__(TensorInfo)
    new.__dict__.update(info.__dict__)
    new.snapshot, new.read_by, new.one_thread = None, None, False
    return new


@dataclasses.dataclass
class GraphCacheEntry:
    """One built graph. `buffers`: handle -> the HostBuffer the checks saw; `infos`: the
    TensorInfo of every tensor as checked; `src_rows`: src indices per tensor; `host`: host
    tensor addresses by index; `readers`: nodes whose rules read guest memory."""

    key: bytes
    scratch: Scratch
    graph: int
    host: List[int]
    buffers: Dict[int, object]
    infos: List[TensorInfo]
    src_rows: List[List[int]]
    readers: List[int]
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.nbytes = len(self.key) + int(getattr(self.scratch, "size", 0))

    def buffers_unchanged(self, lib) -> bool:
        """Whether every handle still names the same HostBuffer object."""
        get = lib.buffers.get
        return all(get(h) is buf for h, buf in self.buffers.items())

    def recheck(self, lib, enums: OpEnums) -> bool:
        """Runs the rules of `readers` again on fresh TensorInfo copies (so row ids are copied
        and checked anew) and points the host tensors at the new copies. Raises Refused as the
        rules do. Returns False (the caller rebuilds) if the copies made differ from the
        entry's, which the same structure never gives."""
        if not self.readers:
            return True
        fresh: Dict[int, TensorInfo] = {}

        def info(i: int) -> TensorInfo:
            if i not in fresh:
                fresh[i] = _unread_copy(self.infos[i])
            return fresh[i]

        for j in self.readers:
            row = self.src_rows[j]
            k = len(row)
            while k and row[k - 1] < 0:
                k -= 1
            check_node(info(j), [info(s) if s >= 0 else None for s in row[:k]], enums)
        copied = sorted(i for i, f in fresh.items() if f.snapshot is not None)
        before = sorted(i for i, f in enumerate(self.infos) if f.snapshot is not None)
        if copied != before or any(fresh[i].read_by != self.infos[i].read_by for i in copied):
            return False
        if not (getattr(lib, "profile", None) or CPU).host_addressable:
            return self._refill_device_copies(lib, fresh, copied)
        dtype = lib.checker.tensor_dtype
        # the host tensors must read the copies themselves (as build_graph points them)
        for i in copied:
            old = self.infos[i].snapshot
            if old is None or int(tensor_record(self.host[i], dtype)["data"]) != ctypes.addressof(old):
                return False
        pinned = []
        for i in copied:
            snap = fresh[i].snapshot
            assert snap is not None
            tensor_record(self.host[i], dtype)["data"] = ctypes.addressof(snap)
            self.infos[i].snapshot = snap
            pinned.append(snap)
        self.scratch.pinned = pinned
        return True

    def _refill_device_copies(self, lib, fresh: Dict[int, TensorInfo], copied: List[int]) -> bool:
        """Where kernels read device memory (a profile without `host_addressable`): the
        re-checked ids copied into the context's device buffer again and the host tensors
        pointed there, as the build did (`apir.host.graph.point_at_device_copies`). The
        build's copies cannot be reused: every later graph writes its own ids into that same
        buffer, and one that needs more frees it for a larger one. False (the caller
        rebuilds) on a library without such a kept buffer."""
        if getattr(lib, "ids_buffer", None) is None:
            return False
        point_at_device_copies(lib, self.scratch, [(fresh[i], self.host[i]) for i in copied])
        for i in copied:
            self.infos[i].snapshot = fresh[i].snapshot
        return True

    def close(self) -> None:
        self.scratch.close()


class GraphCache:
    """A context's built graphs (see the module docstring). Not thread-safe by itself: an
    entry is used by one thread at a time because `take` removes it."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: "OrderedDict[int, GraphCacheEntry]" = OrderedDict()
        self._next = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def take(self, key: bytes, lib) -> Optional[GraphCacheEntry]:
        """Removes and returns the entry whose key equals `key` and whose buffers are
        unchanged, or None (an equal-keyed entry with changed buffers is freed)."""
        for slot, entry in self._entries.items():
            if len(entry.key) == len(key) and entry.key == key:
                del self._entries[slot]
                if entry.buffers_unchanged(lib):
                    self.hits += 1
                    return entry
                entry.close()
                break
        self.misses += 1
        return None

    def put(self, entry: GraphCacheEntry) -> None:
        """Adds `entry` as the most recently used; evicts the least recently used beyond the
        bounds. An entry larger than `max_bytes` on its own is freed at once."""
        if entry.nbytes > self.max_bytes or self.max_entries <= 0:
            entry.close()
            return
        self._next += 1
        self._entries[self._next] = entry
        total = self.nbytes
        while len(self._entries) > self.max_entries or total > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            total -= old.nbytes
            old.close()

    def drop_buffer(self, buf) -> None:
        """Frees the entries that name HostBuffer `buf` (being freed)."""
        for slot in [s for s, e in self._entries.items() if any(b is buf for b in e.buffers.values())]:
            self._entries.pop(slot).close()

    def clear(self) -> None:
        while self._entries:
            self._entries.popitem()[1].close()
