"""Repeated graphs: a context's checked, built host graphs, reused when a graph comes again.

Theory of operation: a guest decoding tokens or embedding batches sends a graph of the same
structure every step, and checking and building it again costs more than computing a small
one. A built graph's `GraphCacheEntry` keeps its host `ggml_context`, keyed by the graph's
structure (`graph_key`: every byte the host reads but the guest's tensor ids, replaced by the
links they make; names up to their first NUL). `take_same` finds an entry before any parse by
comparing the guest's bytes in place with those the host read of the entry's graph: the same
ids (`GraphWire.matches`), or other ids that link the same tensors (`same_structure`); `take`
looks up a parsed graph's key. An entry is served only while every buffer handle it names
still maps to the very `HostBuffer` its checks saw and the row ids its rules read pass again
on fresh copies (against the bounds they recorded, else by running the readers' rules); what
runs is the entry's checked graph, whatever the guest writes meanwhile. Anything else drops
the entry, and the graph is checked in full. The in-place comparisons are Numba kernels, or on
the plain path (apir.accel) numpy over a private copy of the guest's bytes.

Bounds: per context, at most `max_entries` entries and `max_bytes` bytes (keys, wires, host
contexts, records, row-id copies), least recently used evicted first. An entry in use is out of
the cache (`take`, `take_same`) until `put`; `drop_buffer` frees those naming a freed buffer.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from apir import accel
from apir.codec.copy import RawMemory, copy_bytes
from apir.host.graph.build import TensorInfos, fetch_row_ids, point_at_device_copies
from apir.host.graph.chunks import GraphChunks
from apir.host.graph.seams import GraphLibrary, profile_of
from apir.host.graph.shapes import OpEnums, TensorInfo, check_node, node_sources
from apir.host.graph.shapes.base import id_values
from apir.host.tensors import Scratch

if accel.enabled():  # (the plain path imports no Numba)
    from apir.host.graph.kernels import (
        ID_MOVED_MAX,
        MOVED_DIFFERENT,
        MOVED_IDS_DIFFER,
        MOVED_SAME,
        TABLE_KEY,
        ids_link_kernel,
        ids_moved_kernel,
        name_lens_kernel,
        record_key_kernel,
        record_match_kernel,
        records_match_kernel,
        records_moved_kernel,
    )

__all__ = [
    "GraphCache",
    "GraphCacheEntry",
    "GraphWire",
    "graph_key",
    "graph_wire",
    "link_key",
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_MAX_BYTES",
]

DEFAULT_MAX_ENTRIES = 8
DEFAULT_MAX_BYTES = 64 << 20


@functools.lru_cache(maxsize=16)
def _key_mask(rpc: np.dtype, ids: bool = False, counts: bool = False) -> np.ndarray:
    """0xFF for each byte of an apir_rpc_tensor record the host reads, except (unless `ids`)
    the ids (`id`, `src`, `view_src`, which `graph_key` replaces by indices); 0 for those, for
    `padding` (unless `counts`: the guest's use counts, under USE_COUNTS) and for the holes
    between fields, which no check, rule or build step reads (the C guest leaves them
    uninitialized, so keying on them would only make equal graphs differ). Read-only: the one
    array every caller gets."""
    mask = np.zeros(rpc.itemsize, np.uint8)
    fields: Mapping[str, tuple] = rpc.fields or {}
    skip: Tuple[str, ...] = () if ids else ("id", "src", "view_src")
    if not counts:
        skip += ("padding",)
    for name, spec in fields.items():
        if name not in skip:
            mask[spec[1] : spec[1] + spec[0].itemsize] = 0xFF
    mask.flags.writeable = False  # (one array for every caller: lru_cache)
    return mask


def graph_key(parsed, counts: bool = False) -> bytes:
    """The structure of a parsed graph as bytes: its records' bytes with `id`, `src`,
    `view_src`, `padding`, the holes between fields (`_key_mask`) and each name's bytes after
    its first NUL zeroed (`apir.host.graph.kernels.record_key_kernel`), then its node, src and
    view_src index arrays (which say what those ids linked). Two graphs with equal keys differ
    at most in the guest's names for their tensors and in bytes the host never reads.

    A name is read up to its first NUL (build_graph copies it as ggml_set_name would); the C
    guest sends the bytes after it uninitialized, different for every token of a decode. A
    name without a NUL (refused by the checks) is kept whole. `counts`: `padding` kept (the
    host builds with the guest's use counts)."""
    return _key(parsed, records=True, counts=counts)


def link_key(parsed) -> bytes:
    """`graph_key` without the records' bytes: the counts and the node, src and view_src index
    arrays alone. The key of an entry that only `GraphCache.take_same` looks for (its
    `GraphCacheEntry.links`), where a whole key would cost a masked copy of every record that
    nothing compares."""
    return _key(parsed, records=False)


def _key(parsed, records: bool, counts: bool = False) -> bytes:
    t = parsed.tensors
    size = t.dtype.itemsize
    rows = np.ascontiguousarray(t).view(np.uint8).reshape(len(t), size)
    name_at, name_dtype = t.dtype.fields["name"][1], t.dtype.fields["name"][0]
    links = [
        np.ascontiguousarray(a, np.int32).view(np.uint8).reshape(-1)
        for a in (parsed.node_index, parsed.src_index, parsed.view_src_index)
    ]
    at = 16 + (rows.size if records else 0)
    out = np.empty(at + sum(a.size for a in links), np.uint8)
    out[:16].view(np.int64)[:] = (len(t), len(parsed.node_index))
    if records:
        _record_key(rows, _key_mask(t.dtype, counts=counts), name_at, name_dtype.itemsize, out[16:at])
    for a in links:
        out[at : at + a.size] = a
        at += a.size
    return out.tobytes()


@dataclasses.dataclass(frozen=True)
class GraphWire:
    """`graph_wire` of a graph: `data` (read-only uint8), its `head` header bytes then one
    record of `record_size` bytes per tensor; `word_mask` (`_key_mask` with ids, the name left
    out, as int64 words), the name's offset `name_at` and each record's name length
    (`name_lens`, int64) say how `GraphCache.take_same` compares graph bytes with it;
    `link_mask` (the same without the ids), the indices of the int64 words of `id`, `src[]`
    and `view_src` (`id_words`, int64, in that order; `moves`: -1 at those words, 0
    elsewhere) and its least and greatest tensor id (`id_range`) how it compares a graph of
    the same structure under other ids."""

    data: np.ndarray
    head: int
    record_size: int
    word_mask: np.ndarray
    name_at: int
    name_lens: np.ndarray
    link_mask: np.ndarray
    id_words: np.ndarray
    moves: np.ndarray
    id_range: Tuple[int, int]

    @property
    def compares(self) -> bool:
        """Whether `matches` and `same_structure` compare graphs at all: records of whole
        int64 words (apir_rpc_tensor's always are). When they do, `GraphCache.take_same`
        finds this entry for every graph whose `graph_key` equals its own."""
        return self.word_mask.size * 8 == self.record_size and self.link_mask.size * 8 == self.record_size

    def matches(self, memory, size: int) -> bool:
        """Whether the first `size` bytes of `memory` hold this graph: the header, and in
        each record the bytes under `word_mask` and its name up to and including the NUL at
        `name_lens` (`_records_match_plain`, or apir.host.graph.kernels.record_match_kernel after a
        memcmp: a decode step's very graph, whose padding and names' tails are zero as the
        cache keeps them, is equal whole)."""
        first = min(16, len(self.data))  # the node count and first node id: most misses, no kernel call
        if len(self.data) > size or bytes(memory[:first]) != self.data[:first].tobytes():
            return False
        if not self.compares:
            return False  # (records of a size the kernel does not compare: graph_wire)
        if not accel.enabled():
            new = _read_once(memory, len(self.data))
            same_header = new[: self.head].tobytes() == self.data[: self.head].tobytes()
            return same_header and _records_match_plain(self, new, self.word_mask)
        view = np.frombuffer(memory, np.uint8, count=size)  # (held through the call: its address is read)
        old = self.data
        tail = (self.head, self.record_size, self.word_mask, self.name_at, self.name_lens)
        if _memcmp(view.ctypes.data, old.ctypes.data, old.size) == 0:
            return True
        return bool(record_match_kernel(view.ctypes.data, size, old.ctypes.data, old.size, *tail))

    def same_structure(self, memory, size: int, links: Tuple[np.ndarray, np.ndarray, np.ndarray]) -> bool:
        """Whether the first `size` bytes of `memory` hold a graph that parse_graph would
        give this graph's `graph_key`, its ids aside: the same counts, the same records
        (`link_mask`, names up to their NUL), and ids that link the tensors as `links`, this
        graph's (node_index, src_index, view_src_index), say (`_ids_link_plain`: unique,
        non-zero, each reference the id of the tensor its index names). A guest that built
        the same graph in another ggml context sends it so. The kernels first try its ids as
        this graph's moved by one constant (a context at another address:
        `records_moved_kernel`), which settles most graphs in one pass."""
        n_nodes = (self.head - 8) // 8
        if len(self.data) > size or not self.compares or len(links[0]) != n_nodes:
            return False
        if len(self.data) == self.head or bytes(memory[:4]) != self.data[:4].tobytes():
            return False  # (no tensors; n_nodes)
        if bytes(memory[self.head - 4 : self.head]) != self.data[self.head - 4 : self.head].tobytes():
            return False  # (n_tensors)
        if not accel.enabled():
            new = _read_once(memory, len(self.data))
            return _records_match_plain(self, new, self.link_mask) and _ids_link_plain(self, new, links)
        view = np.frombuffer(memory, np.uint8, count=size)  # (held through the call: its address is read)
        old = self.data
        n = (old.size - self.head) // self.record_size
        id_at = self.head + 8 * int(self.id_words[0])
        delta = int(view[id_at : id_at + 8].view("<i8")[0]) - int(old[id_at : id_at + 8].view("<i8")[0])
        low, high = self.id_range
        if abs(delta) < ID_MOVED_MAX and 0 < low and high < ID_MOVED_MAX and low + delta > 0:
            answer = MOVED_IDS_DIFFER
            if ids_moved_kernel(view.ctypes.data + 4, old.ctypes.data + 4, n_nodes, delta):
                moved = (self.word_mask, self.link_mask, self.moves, self.name_at, self.name_lens, delta, 0, n)
                answer = records_moved_kernel(view.ctypes.data, old.ctypes.data, self.head, self.record_size, *moved)
            if answer == MOVED_DIFFERENT:
                return False  # (bytes outside the ids differ: no other ids make it the same)
            if answer == MOVED_SAME:
                return True
        linked = (self.head, self.record_size, self.link_mask, self.name_at, self.name_lens, 0, n)
        if not records_match_kernel(view.ctypes.data, old.ctypes.data, *linked):
            return False
        fields = [8 * int(self.id_words[k]) for k in (0, 1, -1)]  # id, src, view_src
        return bool(ids_link_kernel(view.ctypes.data, self.head, self.record_size, *fields, *links, TABLE_KEY))


def _read_once(memory, n: int) -> np.ndarray:
    """A private copy of the first `n` bytes of `memory`: the guest may write its memory
    meanwhile, and each byte is then read once."""
    return np.frombuffer(memory, np.uint8, count=n).copy()


def _records(wire: GraphWire, data: np.ndarray) -> np.ndarray:
    """The records of graph bytes `data` laid out as `wire`'s, as int64 words (n x words)."""
    return data[wire.head :].view(np.int64).reshape(-1, wire.record_size // 8)


def _records_match_plain(wire: GraphWire, new: np.ndarray, word_mask: np.ndarray) -> bool:
    """Whether the records of graph bytes `new` (as long as `wire.data`) hold `wire`'s under
    `word_mask` (int64 per word of a record), each name up to and including its NUL."""
    old = wire.data
    if ((_records(wire, new) ^ _records(wire, old)) & word_mask).any():
        return False
    n, longest = len(wire.name_lens), int(wire.name_lens.max(initial=0))
    names = [
        a[wire.head :].reshape(n, wire.record_size)[:, wire.name_at : wire.name_at + longest + 1] for a in (new, old)
    ]
    compared = np.arange(longest + 1) <= wire.name_lens[:, None]  # each name's bytes up to its NUL
    return not ((names[0] != names[1]) & compared).any()


def _ids_link_plain(wire: GraphWire, new: np.ndarray, links: Tuple[np.ndarray, np.ndarray, np.ndarray]) -> bool:
    """Whether the ids of graph bytes `new` link its tensors as `links` (node_index,
    src_index, view_src_index; -1 for none) say: every tensor id non-zero and unique, each
    node id the id of the tensor its index names, each src and view_src 0 where the index is
    -1, else the id of that tensor. Exactly then parse_graph finds these index arrays."""
    node_index, src_index, view_src_index = links
    words = _records(wire, new)
    ids = words[:, wire.id_words[0]]
    if (ids == 0).any() or len(np.unique(ids)) != len(ids):
        return False
    node_ids = new[4 : 4 + 8 * len(node_index)].view("<i8")
    if not np.array_equal(node_ids, ids[node_index]):
        return False
    refs = np.concatenate([src_index, view_src_index[:, None]], axis=1)  # src slots, then view_src
    want = np.where(refs < 0, 0, ids[refs])
    return bool(np.array_equal(words[:, wire.id_words[1:]], want))


def _record_key(rows: np.ndarray, mask: np.ndarray, name_at: int, name_len: int, out: np.ndarray) -> None:
    """`out` = the records `rows` (n x record size, uint8) with each byte ANDed with `mask`
    and the bytes of each name after its first NUL zeroed (a name without a NUL kept whole);
    `record_key_kernel` where the kernels run."""
    if accel.enabled():
        record_key_kernel(rows, mask, name_at, name_len, out)
        return
    key = rows & mask
    names = rows[:, name_at : name_at + name_len]
    key[:, name_at : name_at + name_len][np.cumsum(names == 0, axis=1) > 0] = 0
    out[:] = key.reshape(-1)


def _name_lens_plain(names: np.ndarray) -> np.ndarray:
    """Per name (a row of `names`): the bytes before its first NUL, or its length - 1 when it
    has none (compared whole, the NUL's slot included)."""
    nul = names == 0
    return np.where(nul.any(axis=1), nul.argmax(axis=1), names.shape[1] - 1)


# libc's memcmp (the GIL released while it runs, as for any ctypes call)
_memcmp = ctypes.CDLL(None).memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


def graph_wire(parsed, counts: bool = False) -> GraphWire:
    """The bytes of a parsed graph that the host reads, as the guest sent them: its header
    (n_nodes, node ids, n_tensors) and its records with ids kept but `padding`, the holes
    between fields and each name's bytes after its first NUL zeroed. A later graph whose
    bytes match these (`GraphCache.take_same`) is the same graph, ids and all: its key is
    this one's, and parsing it would give the same ParsedGraph. `counts`: `padding` kept and
    compared (the host builds with the guest's use counts)."""
    t = parsed.tensors
    size = t.dtype.itemsize
    n_nodes = len(parsed.node_ids)
    head = 8 + 8 * n_nodes
    out = np.empty(head + len(t) * size, np.uint8)
    out[:4].view("<u4")[0] = n_nodes
    out[4 : 4 + 8 * n_nodes].view("<u8")[:] = parsed.node_ids
    out[head - 4 : head].view("<u4")[0] = len(t)
    rows = np.ascontiguousarray(t).view(np.uint8).reshape(len(t), size)
    name_at, name_len = t.dtype.fields["name"][1], t.dtype.fields["name"][0].itemsize
    mask = _key_mask(t.dtype, ids=True, counts=counts)
    _record_key(rows, mask, name_at, name_len, out[head:])
    # bytes before each name's first NUL (a name without one, which the checks refuse, is
    # compared whole)
    name_lens = np.empty(len(t), np.int64)
    if accel.enabled():
        name_lens_kernel(rows, name_at, name_len, name_lens)
    else:
        name_lens[:] = _name_lens_plain(rows[:, name_at : name_at + name_len])
    outside, links = mask.copy(), _key_mask(t.dtype, counts=counts).copy()  # (the cached masks stay as they are)
    # the name is compared apart, up to its NUL
    outside[name_at : name_at + name_len] = links[name_at : name_at + name_len] = 0
    if size % 8:  # never matched in place (apir_rpc_tensor holds 8-byte fields: its size never is)
        outside = links = np.zeros(0, np.uint8)
    fields = t.dtype.fields
    src_at, max_src = fields["src"][1], fields["src"][0].shape[0]
    id_words = np.array([fields["id"][1], *range(src_at, src_at + 8 * max_src, 8), fields["view_src"][1]]) // 8
    moves = np.zeros(size // 8, np.int64)
    moves[id_words] = -1
    ids = t["id"].view(np.int64)
    id_range = (int(ids.min()), int(ids.max())) if len(ids) else (0, 0)
    out.flags.writeable = False  # (kept as made: a bytes copy would double its memory)
    return GraphWire(
        out,
        head,
        size,
        outside.view(np.int64),
        name_at,
        name_lens,
        links.view(np.int64),
        id_words,
        moves,
        id_range,
    )


def _unread_copy(info: TensorInfo) -> TensorInfo:
    """`info` as before any rule read its data (no snapshot, no readers, not one-thread-only).
    A shallow copy of its fields, as dataclasses.replace makes, without re-running __init__
    (which costs more, for every tensor a re-check touches on every hit)."""
    new = object.__new__(TensorInfo)
    new.__dict__.update(info.__dict__)
    new.snapshot, new.read_by, new.id_bounds, new.one_thread = None, None, None, False
    new.read_computed_by = None
    new.id_reads = None  # (the build bounded these very copies: the same tensors, the same extents)
    return new


@dataclasses.dataclass
class GraphCacheEntry:
    """One built graph. `buffers`: handle -> the HostBuffer the checks saw; `infos`: the
    TensorInfo of every tensor as checked (apir.host.graph.build.TensorInfos: those a rule ran on
    are `infos.made()`); `src_rows`: src indices per tensor (int32[n, max_src]); `host`: host
    tensor addresses by index (int64); `readers`: nodes whose rules read guest memory."""

    key: bytes
    scratch: Scratch
    graph: int
    host: np.ndarray
    buffers: Mapping[int, object]
    infos: TensorInfos
    src_rows: np.ndarray
    readers: List[int]
    nbytes: int = 0
    # `graph_wire` of the graph that built it, for `GraphCache.take_same`
    wire: Optional[GraphWire] = None

    def __post_init__(self) -> None:
        # the tensors whose ids rules read (and copied): the same for every hit
        self.id_holders = [f.index for f in self.infos.made() if f.snapshot is not None]
        # (the records its infos are made from stay alive with it: TensorInfos.nbytes; so do
        # the copies of those ids, as large as the guest's ids tensors, refilled or replaced
        # by copies of the same size on every hit)
        pinned = sum(ctypes.sizeof(self.infos[i].snapshot) for i in self.id_holders)
        self.nbytes = len(self.key) + int(getattr(self.scratch, "size", 0)) + self.infos.nbytes + pinned
        # per such tensor, the bound its ids must stay under, per way of reading them (flat or
        # at ids' nb): the least n_rows its reads recorded; None where a read recorded none
        self.id_checks: Optional[List[tuple]] = []
        for i in self.id_holders:
            info = self.infos[i]
            bounds = info.id_bounds or []
            if len(bounds) != len(info.read_by or ()):
                self.id_checks = None
                break
            least: Dict[bool, int] = {}
            for flat, n_rows in bounds:
                least[flat] = min(n_rows, least.get(flat, n_rows))
            self.id_checks.append((i, sorted(least.items())))
        # the work size ggml plans for this graph, by thread count (apir.host.graph.work_plan)
        self.planned: Dict[int, int] = {}
        # (tensor index, flat) -> (snapshot, its ids as read): a snapshot refilled in place is
        # read through the same view on every hit (`_fresh_snapshots`)
        self._id_views: Dict[tuple, tuple] = {}
        self._chunks: Optional[Tuple[int, GraphChunks]] = None  # (chunk_nodes, its chunks)

    @functools.cached_property
    def links(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(node_index, src_index, view_src_index) of the graph, int32, read-only views of
        the end of its key (`graph_key`, or `link_key` for an entry graph_compute made)."""
        n, n_nodes = (int(v) for v in np.frombuffer(self.key, np.int64, 2))
        max_src = self.src_rows.shape[1]
        end = len(self.key)
        at = end - 4 * (n_nodes + n * max_src + n)
        node_index = np.frombuffer(self.key, np.int32, n_nodes, at)
        src_index = np.frombuffer(self.key, np.int32, n * max_src, at + 4 * n_nodes).reshape(n, max_src)
        return node_index, src_index, np.frombuffer(self.key, np.int32, n, end - 4 * n)

    def remember_wire(self, wire: GraphWire) -> None:
        """Keeps `wire` (`graph_wire` of the graph that built it) for `GraphCache.take_same`
        (its bytes counted in `nbytes`)."""
        self.nbytes += len(wire.data) - (len(self.wire.data) if self.wire is not None else 0)
        self.wire = wire

    def buffers_unchanged(self, lib: GraphLibrary) -> bool:
        """Whether every handle still names the same HostBuffer object."""
        get = lib.buffers.get
        return all(get(h) is buf for h, buf in self.buffers.items())

    def recheck(self, lib: GraphLibrary, enums: OpEnums) -> bool:
        """Copies the row ids every reader read again and checks them (`_fresh_snapshots`;
        where that does not settle it, the readers' rules run again on fresh TensorInfo
        copies), then points the host tensors at the new copies. Raises Refused as the rules
        do. Returns False (the caller rebuilds) if the copies made differ from the entry's,
        which the same structure never gives."""
        if not self.readers:
            return True
        snaps = self._fresh_snapshots(lib)
        if snaps is None:
            fresh = self._rerun_rules(enums, profile_of(lib))
            copied = sorted(i for i, f in fresh.items() if f.snapshot is not None)
            if copied != self.id_holders or any(fresh[i].read_by != self.infos[i].read_by for i in copied):
                return False
            snaps = {i: snap for i in copied if (snap := fresh[i].snapshot) is not None}
        if not profile_of(lib).host_addressable:
            return self._refill_device_copies(lib, snaps)
        data_at = lib.checker.tensor_dtype.fields["data"][1]
        pointers = [ctypes.c_void_p.from_address(int(self.host[i]) + data_at) for i in snaps]
        # the host tensors must read the copies themselves (as build_graph points them)
        olds = [self.infos[i].snapshot for i in snaps]
        if any(old is None or p.value != ctypes.addressof(old) for p, old in zip(pointers, olds)):
            return False
        for p, (i, snap) in zip(pointers, snaps.items()):
            p.value = ctypes.addressof(snap)
            self.infos[i].snapshot = snap
        self.scratch.pinned = list(snaps.values())
        return True

    def _fresh_snapshots(self, lib: GraphLibrary) -> Optional[Dict[int, ctypes.Array]]:
        """Fresh copies of the ids the readers' rules read (tensor index -> copy), each
        checked against the bounds those reads recorded (`shapes.base.check_row_ids`: every
        id in [0, n_rows)), without running the rules: everything else they checked is a
        function of the key and the buffers, which are the entry's. None where this does not
        settle it (an id out of range: the rules then say which; or a read without a
        recorded bound). Reads through the backend are batched (`apir.host.graph.build.fetch_row_ids`:
        one synchronize where the backend has async copies)."""
        if self.id_checks is None:
            return None
        infos = self.infos
        # the copies a host tensor reads in host memory are refilled in place (below); the
        # rest are read anew, those through the backend all at once
        fetched = [i for i, _ in self.id_checks if infos[i].fetch is not None or infos[i].snapshot is None]
        copies = dict(zip(fetched, fetch_row_ids(lib, [infos[i] for i in fetched]))) if fetched else {}
        snaps: Dict[int, ctypes.Array] = {}
        for i, least in self.id_checks:
            info = infos[i]
            snap = copies.get(i)
            if snap is None:
                snap = info.snapshot
                assert snap is not None  # (not fetched: it has one)
                # the copy the host tensor reads, refilled in place: the entry is this thread's
                # alone until `put`, and the graph that read it last has finished
                copy_bytes(snap, RawMemory(info.address, len(snap)))
            for flat, n_rows in least:
                seen = self._id_views.get((i, flat))
                if seen is not None and seen[0] is snap:
                    values = seen[1]
                else:
                    values = id_values(info, snap, flat)
                    self._id_views[(i, flat)] = (snap, values)
                if values.size and (values.min() < 0 or values.max() >= n_rows):
                    return None
            snaps[i] = snap
        return snaps

    def _rerun_rules(self, enums: OpEnums, profile) -> Dict[int, TensorInfo]:
        """The readers' rules (those of the backend `profile`, as the build ran them) run
        again on fresh TensorInfo copies (so row ids are copied and checked anew); raises
        Refused as they do."""
        fresh: Dict[int, TensorInfo] = {}

        def info(i: int) -> TensorInfo:
            if i not in fresh:
                fresh[i] = _unread_copy(self.infos[i])
            return fresh[i]

        for j in self.readers:
            check_node(info(j), node_sources(self.src_rows[j].tolist(), info), enums, profile.rules)
        return fresh

    def _refill_device_copies(self, lib: GraphLibrary, snaps: Dict[int, ctypes.Array]) -> bool:
        """Where kernels read device memory (a profile without `host_addressable`): the
        re-checked ids (`snaps`) copied into the context's device buffer again and the host
        tensors pointed there, as the build did (`apir.host.graph.build.point_at_device_copies`).
        The build's copies cannot be reused: every later graph writes its own ids into that
        same buffer, and one that needs more frees it for a larger one."""
        fresh = []
        for i, snap in snaps.items():
            info = _unread_copy(self.infos[i])
            info.snapshot = snap
            fresh.append((info, int(self.host[i])))
        point_at_device_copies(lib, fresh)
        for i, snap in snaps.items():
            self.infos[i].snapshot = snap
        return True

    def chunks(self, g, chunk_nodes: int) -> List[int]:
        """The graph's nodes as cgraphs of at most `chunk_nodes` nodes, in order
        (apir.host.graph.chunks), made once per entry and size; their memory counts in `nbytes`."""
        made = self._chunks
        if made is None or made[0] != chunk_nodes:
            if made is not None:
                self.nbytes -= made[1].nbytes
                made[1].close()
            made = self._chunks = (chunk_nodes, GraphChunks(g, self.graph, chunk_nodes))
            self.nbytes += made[1].nbytes
        return made[1].graphs

    def close(self) -> None:
        if self._chunks is not None:
            self._chunks[1].close()
            self._chunks = None
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

    def take(self, key: bytes, lib: GraphLibrary) -> Optional[GraphCacheEntry]:
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

    def take_same(self, memory, size: int, lib: GraphLibrary) -> Optional[GraphCacheEntry]:
        """Removes and returns the entry whose graph the `size` bytes of `memory` (the guest's
        shared memory) hold again, and whose buffers are unchanged; or None. The bytes are
        compared where they lie, without parsing them, first as the very bytes of a graph
        served before (`GraphWire.matches`), then as the same graph under other ids
        (`GraphWire.same_structure`). What the host serves is the entry's graph, checked when
        it was built, whatever the guest writes there meanwhile."""
        wired = [(slot, entry, entry.wire) for slot, entry in self._entries.items() if entry.wire is not None]
        for slot, entry, wire in wired:
            if wire.matches(memory, size):
                return self._served(slot, entry, lib)
        for slot, entry, wire in wired:
            if wire.same_structure(memory, size, entry.links):
                return self._served(slot, entry, lib)
        return None

    def _served(self, slot: int, entry: GraphCacheEntry, lib: GraphLibrary) -> Optional[GraphCacheEntry]:
        # `entry` (at `slot`) taken out: returned if its buffers are unchanged, else freed
        del self._entries[slot]
        if entry.buffers_unchanged(lib):
            self.hits += 1
            return entry
        entry.close()
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
