"""apir.host.graph.cache: a repeated graph reuses its built host graph, and nothing that
differs is ever served from the cache (the graph's bytes, its buffers, the row ids its rules
read)."""


import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.codec.graph import GraphError, parse_graph
from apir.codec.records import rpc_tensor_dtype
from apir.host.graph import cache as graph_cache
from apir.host.graph.cache import GraphCache, GraphCacheEntry, graph_key, graph_wire
from tests.host.cachekit import N_ROWS, GraphSession, direct_output, graph_inputs
from tests.host.hostkit import DATA_RES, Guest, needs_kernels

@pytest.fixture
def session(guest, ggml):
    s = GraphSession(guest, ggml)
    yield s
    s.close()


def test_repeated_graph_is_served_from_the_cache_with_new_inputs(session, ggml):
    session.set_inputs(graph_inputs(1))
    assert session.compute() == (0, 0)
    assert (session.cache.hits, len(session.cache)) == (0, 1)
    for seed, rows in ((2, (0, 9, 9)), (3, (5, 4, 2))):
        data = graph_inputs(seed, rows)
        session.set_inputs(data)
        assert session.compute() == (0, 0)
        assert session.output() == direct_output(ggml, data)
    assert (session.cache.hits, session.cache.misses, len(session.cache)) == (2, 1, 1)


def test_graph_compute_keys_its_entries_by_their_links_and_finds_them_in_place(session, ggml, monkeypatch):
    """graph_compute looks for a graph in place (take_same) before it parses, and that look
    finds every entry of the graph's key, so the entry it builds keeps `link_key` (the counts
    and index arrays), not `graph_key`, and no `take` by key runs; the next compute of the
    graph, under the same or other ids, is served in place. A caller that builds without a
    wire (prepare_graph(..., wire=None)) still keys and looks up by `graph_key`."""
    from apir.host.backend import dispatch_backend
    from apir.host.graph.cache import link_key

    took = []
    real_take = GraphCache.take
    monkeypatch.setattr(GraphCache, "take", lambda self, key, lib: took.append(key) or real_take(self, key, lib))
    session.set_inputs(graph_inputs(1))
    assert session.compute() == (0, 0)
    parsed = parse_graph(session.wire, limits=ggml.limits, op_count=ggml.op_count, type_valid=ggml.valid_types)
    (entry,) = session.cache._entries.values()
    full = graph_key(parsed)
    assert entry.key == link_key(parsed) != full
    assert entry.key == full[:16] + full[len(full) - (len(entry.key) - 16) :]  # the key less its records
    assert entry.wire is not None and entry.wire.compares
    assert [a.tolist() for a in entry.links] == [
        a.tolist() for a in (parsed.node_index, parsed.src_index, parsed.view_src_index)
    ]
    assert (took, session.cache.misses) == ([], 1)
    data = graph_inputs(2)
    session.set_inputs(data)
    assert session.compute() == (0, 0)
    assert (session.cache.hits, took) == (1, [])
    assert session.output() == direct_output(ggml, data)
    lib = session.guest.ctx._library
    built = dispatch_backend.prepare_graph(lib, parsed, session.cache)  # no wire: by graph_key
    try:
        assert took == [full] and built.key == full
    finally:
        built.close()


def test_a_hit_checks_fresh_ids_without_running_the_rules(session, ggml, monkeypatch):
    """On a hit only the row ids are new: they are copied and checked against the bounds the
    rules recorded (`shapes.base.check_row_ids`), and no rule runs again. Where a read has no
    recorded bound, the readers' rules run (and refuse as they do)."""
    import apir.host.graph.cache as gc

    calls = []
    real = gc.check_node
    monkeypatch.setattr(gc, "check_node", lambda *a: calls.append(a) or real(*a))
    session.set_inputs(graph_inputs(1))
    assert session.compute() == (0, 0)
    data = graph_inputs(2, rows=(N_ROWS - 1, 0, 4))
    session.set_inputs(data)
    assert session.compute() == (0, 0)
    assert (session.cache.hits, calls) == (1, [])
    assert session.output() == direct_output(ggml, data)
    (entry,) = session.cache._entries.values()
    for i in entry.id_holders:
        entry.infos[i].id_bounds = None  # as if a rule read ids some other way
    entry.__post_init__()  # (what the entry derives from its infos, derived again)
    assert entry.id_checks is None
    data = graph_inputs(3, rows=(2, 2, 8))
    session.set_inputs(data)
    assert session.compute() == (0, 0)
    assert session.cache.hits == 2 and len(calls) == 1  # the one GET_ROWS reader's rule
    assert session.output() == direct_output(ggml, data)


def test_other_guest_ids_same_structure_is_a_hit(session, ggml):
    """Tensor ids only name tensors: the same graph with every id renamed is the same graph."""
    session.set_inputs(graph_inputs(1))
    assert session.compute() == (0, 0)
    n_nodes, recs = session.records()
    shift = np.uint64(1 << 40)
    nodes = np.frombuffer(session.wire, np.uint64, count=n_nodes, offset=4) + shift
    for f in ("id", "src", "view_src"):
        recs[f] = np.where(recs[f] != 0, recs[f] + shift, 0)
    wire = session.wire[:4] + nodes.tobytes() + session.wire[4 + 8 * n_nodes: 8 + 8 * n_nodes] + recs.tobytes()
    assert wire != session.wire
    data = graph_inputs(4)
    session.set_inputs(data)
    assert session.compute(wire) == (0, 0)
    assert session.cache.hits == 1
    assert session.output() == direct_output(ggml, data)


def _renamed(session, shift: int) -> bytes:
    """The session's graph with every tensor id moved by `shift`: the same structure."""
    return _with_ids(session, lambda ids: ids + np.uint64(shift % (1 << 64)))


def _permuted(session, seed: int) -> bytes:
    """The session's graph with its tensor ids given out again in a random order, each
    another random id: the same structure, no constant between old and new ids."""
    n_nodes, recs = session.records()
    new = np.random.default_rng(seed).integers(1, 1 << 63, len(recs), dtype=np.uint64)
    return _with_ids(session, lambda ids: new[np.searchsorted(np.sort(recs["id"]), ids)])


def _with_ids(session, rename) -> bytes:
    """The session's graph with every id (node ids, each record's id, src and view_src) x
    replaced by rename(x), 0 (no tensor) kept."""
    n_nodes, recs = session.records()
    nodes = rename(np.frombuffer(session.wire, np.uint64, count=n_nodes, offset=4).copy())
    for f in ("id", "src", "view_src"):
        recs[f] = np.where(recs[f] != 0, rename(recs[f]), 0)
    return session.wire[:4] + nodes.tobytes() + session.wire[4 + 8 * n_nodes : 8 + 8 * n_nodes] + recs.tobytes()


def test_graphs_under_other_ids_are_served_without_parsing(session, ggml, monkeypatch):
    """A guest that builds its graphs in two contexts in turn sends the same structure under
    two sets of ids (each moved by one constant), and one under ids in another order entirely:
    once the first was parsed, every other is matched in place (`GraphWire.same_structure`)."""
    import apir.host.backend.dispatch_backend as db

    a, b, c = session.wire, _renamed(session, 1 << 40), _permuted(session, seed=3)
    parses = []
    real = db.parse_graph
    monkeypatch.setattr(db, "parse_graph", lambda *a, **k: parses.append(1) or real(*a, **k))
    for k, wire in enumerate([a, b, a, b, a, c, a, b]):
        data = graph_inputs(10 + k)
        session.set_inputs(data)
        assert session.compute(wire) == (0, 0)
        assert session.output() == direct_output(ggml, data)
    assert len(parses) == 1 and session.cache.hits == 7


def test_an_entry_counts_what_it_keeps(session, ggml):
    """An entry's bytes (bounded by the cache's max_bytes): its key, scratch context, the
    records its infos are made from, the copies of the row ids its rules read and the wire
    it keeps for the in-place match."""
    session.set_inputs(graph_inputs(1))
    assert session.compute() == (0, 0)
    (entry,) = session.cache._entries.values()
    n_nodes, recs = session.records()
    assert entry.infos.nbytes == recs.nbytes > 0
    wires = len(entry.wire.data)
    ids = sum(len(entry.infos[i].snapshot) for i in entry.id_holders)
    assert ids == 3 * 4  # (the GET_ROWS ids: 3 I32)
    assert wires > 0 and entry.nbytes == len(entry.key) + entry.scratch.size + recs.nbytes + ids + wires


def test_bytes_after_a_names_nul_are_not_structure(session, ggml):
    """The C guest sends each name's bytes after its NUL uninitialized (llama.cpp's decode
    graphs differ there token after token): such a graph is the same graph, a hit."""
    session.set_inputs(graph_inputs(1))
    assert session.compute() == (0, 0)
    _, recs = session.records()
    names = recs["name"].view(np.uint8).reshape(len(recs), -1)
    end = np.argmax(names == 0, axis=1)
    garbage = np.random.default_rng(0).integers(1, 256, names.shape, dtype=np.uint8)
    after = np.arange(names.shape[1]) > end[:, None]
    names[after] = garbage[after]
    wire = session.wire_with(recs)
    assert wire != session.wire
    data = graph_inputs(6)
    session.set_inputs(data)
    assert session.compute(wire) == (0, 0)
    assert session.cache.hits == 1
    assert session.output() == direct_output(ggml, data)


def _unread_bytes(g, wire):
    """Byte offsets in `wire` that no host check reads: each record's `padding`, the holes
    between its fields and its name's bytes after the first NUL (the C guest leaves all three
    uninitialized)."""
    n_nodes = int.from_bytes(wire[:4], "little")
    rpc = rpc_tensor_dtype(g.limits)
    read = set()
    for name in rpc.names:
        if name != "padding":
            ftype, off = rpc.fields[name][:2]
            read |= set(range(off, off + ftype.itemsize))
    unread = [b for b in range(rpc.itemsize) if b not in read]
    at = 8 + 8 * n_nodes
    name_at, name_size = rpc.fields["name"][1], rpc.fields["name"][0].itemsize
    out = set()
    for i in range((len(wire) - at) // rpc.itemsize):
        rec = at + rpc.itemsize * i
        out |= {rec + b for b in unread}
        name = wire[rec + name_at : rec + name_at + name_size]
        out |= {rec + name_at + b for b in range(name.index(0) + 1, name_size)}  # after the NUL
    return out


def test_every_byte_of_the_graph_is_in_the_key_or_refused(session, ggml):
    """Flipping any single byte the host reads (counts, node ids, every field of every record,
    ids and links included) either makes the graph invalid or changes its key: every tensor
    here is linked from a node, so a flipped id leaves a link unresolved."""
    kw = dict(limits=ggml.limits, op_count=ggml.op_count, type_valid=ggml.valid_types)
    key = graph_key(parse_graph(session.wire, **kw))
    unread = _unread_bytes(ggml, session.wire)
    assert 0 < len(unread) < len(session.wire) // 3
    same = []
    for p in range(len(session.wire)):
        for flip in (0x01, 0x80):
            wire = bytearray(session.wire)
            wire[p] ^= flip
            try:
                parsed = parse_graph(bytes(wire), **kw)
            except GraphError:
                continue
            if graph_key(parsed) == key:
                same.append(p)
    assert sorted(set(same)) == sorted(unread)


def test_every_byte_the_host_reads_is_in_the_wire_match(session, ggml, host_path):
    """`GraphWire.matches` (the same graph sent again, compared without parsing): flipping
    any byte the host reads, ids included, is a mismatch; flipping an unread byte is not.
    On the accelerated and the plain path."""
    kw = dict(limits=ggml.limits, op_count=ggml.op_count, type_valid=ggml.valid_types)
    wire = graph_wire(parse_graph(session.wire, **kw))
    assert wire.matches(session.wire, len(session.wire))
    assert wire.matches(session.wire + b"\xff" * 8, len(session.wire) + 8)  # trailing bytes: ignored, as parse does
    assert not wire.matches(session.wire, len(session.wire) - 1)
    unread = _unread_bytes(ggml, session.wire)
    same = []
    for p in range(len(session.wire)):
        for flip in (0x01, 0x80):
            flipped = bytearray(session.wire)
            flipped[p] ^= flip
            if wire.matches(flipped, len(flipped)):
                same.append(p)
    assert sorted(set(same)) == sorted(unread)


@pytest.mark.parametrize("ids", ["moved", "permuted", "high"])
def test_same_structure_is_exactly_an_equal_key(session, ggml, ids, host_path):
    """`GraphWire.same_structure` accepts a graph exactly when parsing it gives the cached
    graph's key: for the graph under other ids (moved by one constant, given out in another
    order, or moved past 2**62, where only the full check of links applies), and for each of
    those with any one byte flipped (ids and links included), the two always agree. On the
    accelerated and the plain path."""
    kw = dict(limits=ggml.limits, op_count=ggml.op_count, type_valid=ggml.valid_types)
    parsed = parse_graph(session.wire, **kw)
    key, wire = graph_key(parsed), graph_wire(parsed)
    links = (parsed.node_index, parsed.src_index, parsed.view_src_index)
    other = {"moved": _renamed(session, 1 << 40), "permuted": _permuted(session, seed=5),
             "high": _renamed(session, (1 << 62) + 12345)}[ids]
    assert other != session.wire and wire.same_structure(other, len(other), links)
    assert wire.same_structure(session.wire, len(session.wire), links)  # (other ids: the same ones)
    assert not wire.same_structure(other, len(other) - 1, links)
    agreed = 0
    for p in range(len(other)):
        for flip in (0x01, 0x80):
            flipped = bytearray(other)
            flipped[p] ^= flip
            try:
                same = graph_key(parse_graph(bytes(flipped), **kw)) == key
            except GraphError:
                same = False
            assert wire.same_structure(flipped, len(flipped), links) is same, (p, flip)
            agreed += same
    assert agreed > 0  # (the unread bytes, and ids no tensor links)


@needs_kernels
def test_same_structure_tries_moved_ids_before_the_full_check(session, ggml, monkeypatch):
    """Ids moved by one constant (a ggml context at another address) are matched without the
    full check of links and its hash set (`ids_link_kernel`); ids in another order need it,
    and a graph that differs outside its ids gets no full check."""
    kw = dict(limits=ggml.limits, op_count=ggml.op_count, type_valid=ggml.valid_types)
    parsed = parse_graph(session.wire, **kw)
    wire = graph_wire(parsed)
    links = (parsed.node_index, parsed.src_index, parsed.view_src_index)
    calls = []
    real = graph_cache.ids_link_kernel
    monkeypatch.setattr(graph_cache, "ids_link_kernel", lambda *a: calls.append(1) or real(*a))
    moved = _renamed(session, -(1 << 20))
    assert wire.same_structure(moved, len(moved), links) and calls == []
    permuted = _permuted(session, seed=7)
    assert wire.same_structure(permuted, len(permuted), links) and calls == [1]
    # moved ids, a byte outside the ids of the last record changed: no other ids could make
    # it the same graph, so no full check; one id not moved: the full check says no
    rpc = rpc_tensor_dtype(ggml.limits)
    n_nodes = int.from_bytes(moved[:4], "little")
    last = 8 + 8 * n_nodes + (len(parsed.tensors) - 1) * rpc.itemsize
    for at, want_calls in ((last + rpc.fields["op_params"][1], [1]), (last + rpc.fields["id"][1] + 5, [1, 1])):
        other = bytearray(moved)
        other[at] ^= 1
        assert not wire.same_structure(other, len(other), links) and calls == want_calls


def test_structure_kernels_vs_python(session, ggml):
    """The kernels of `GraphWire.same_structure` and their Python twins give the same answer
    on the graph under other ids with bytes flipped here and there (ids and links included)."""
    from apir.host.graph import kernels as K

    kw = dict(limits=ggml.limits, op_count=ggml.op_count, type_valid=ggml.valid_types)
    parsed = parse_graph(session.wire, **kw)
    w = graph_wire(parsed)
    links = (parsed.node_index, parsed.src_index, parsed.view_src_index)
    n, n_nodes = len(parsed.tensors), len(parsed.node_ids)
    fields = [8 * int(w.id_words[k]) for k in (0, 1, -1)]
    old = np.frombuffer(w.data, np.uint8)
    rng = np.random.default_rng(11)
    answers = set()
    for base, delta in ((_renamed(session, 1 << 40), 1 << 40), (_permuted(session, seed=2), 1 << 40)):
        for p in [None, *rng.integers(0, len(base), 60)]:
            new = np.frombuffer(base, np.uint8).copy()
            if p is not None:
                new[p] ^= 1 << int(rng.integers(0, 8))
            a, b = new.ctypes.data, old.ctypes.data
            for kernel, args in (
                (K.records_moved_kernel, (a, b, w.head, w.record_size, w.word_mask, w.link_mask, w.moves, w.name_at, w.name_lens, delta, 0, n)),
                (K.ids_moved_kernel, (a + 4, b + 4, n_nodes, delta)),
                (K.ids_link_kernel, (a, w.head, w.record_size, *fields, *links, K.TABLE_KEY)),
            ):
                want = int(kernel(*args))
                assert int(kernel.py_func(*args)) == want, (kernel, p)
                answers.add((kernel.__name__, want))
    moved = {("records_moved_kernel", K.MOVED_SAME), ("records_moved_kernel", K.MOVED_DIFFERENT)}
    assert moved <= answers and {("ids_link_kernel", 0), ("ids_link_kernel", 1)} <= answers


def test_same_structure_refuses_ids_a_parse_refuses(session, ggml):
    """Ids that link every tensor as before but that parse_graph refuses are no match:
    tensor 0 renamed (with every link to it) to tensor 1's id, or to 0; every id moved by
    one constant that takes the least of them to 0."""
    kw = dict(limits=ggml.limits, op_count=ggml.op_count, type_valid=ggml.valid_types)
    parsed = parse_graph(session.wire, **kw)
    wire = graph_wire(parsed)
    links = (parsed.node_index, parsed.src_index, parsed.view_src_index)
    ids = session.records()[1]["id"]

    def tensor_0_as(bad):
        return lambda x: np.where(x == ids[0], np.uint64(bad), x)

    for rename in (tensor_0_as(ids[1]), tensor_0_as(0), lambda x: x - ids.min()):
        bad = _with_ids(session, rename)
        with pytest.raises(GraphError, match="id"):
            parse_graph(bad, **kw)
        assert not wire.same_structure(bad, len(bad), links)


def test_the_same_graph_again_is_served_without_parsing(session, ggml, monkeypatch):
    """A graph sent again byte for byte (a decode step's) is matched where it lies and
    served from the cache without a parse."""
    import apir.host.backend.dispatch_backend as db

    session.set_inputs(graph_inputs(1))
    assert session.compute() == (0, 0)
    parses = []
    real = db.parse_graph
    monkeypatch.setattr(db, "parse_graph", lambda *a, **k: parses.append(1) or real(*a, **k))
    data = graph_inputs(2, rows=(3, 3, 0))
    session.set_inputs(data)
    assert session.compute() == (0, 0)
    assert (session.cache.hits, parses) == (1, [])
    assert session.output() == direct_output(ggml, data)


@pytest.mark.parametrize(
    "field",
    ["op_params", "buffer", "data", "ne", "nb", "src", "view_src", "view_offs", "flags", "name", "type", "op",
     "node"],
)
def test_changed_field_is_never_served_from_the_cache(session, ggml, field):
    """One field of one tensor changed: the graph is checked and built in full (refused or
    computed as ggml would), never taken from the cache."""
    session.set_inputs(graph_inputs(1))
    assert session.compute() == (0, 0)
    n_nodes, recs = session.records()
    get_rows = int(np.flatnonzero(recs["op"] == ggml.ops["GET_ROWS"])[0])
    soft_max = int(np.flatnonzero(recs["op"] == ggml.ops["SOFT_MAX"])[0])
    view = int(np.flatnonzero(recs["view_src"] != 0)[0])
    wire = None
    if field == "op_params":
        recs["op_params"][soft_max, 0] = np.float32(0.25).view(np.uint32)  # another scale
    elif field == "buffer":
        recs["buffer"][0] = session.guest.alloc(1 << 16)  # a live buffer, but not the one checked
    elif field == "data":
        recs["data"][get_rows] += 4
    elif field == "ne":
        recs["ne"][view, 0] -= 1
    elif field == "nb":
        recs["nb"][view, 1] -= 4
    elif field == "src":
        recs["src"][get_rows, 1] = recs["id"][get_rows - 1] if recs["src"][get_rows, 1] != recs["id"][get_rows - 1] \
            else recs["id"][0]
    elif field == "view_src":
        recs["view_src"][view] = recs["id"][0]
    elif field == "view_offs":
        recs["view_offs"][view] += 4
    elif field == "flags":
        recs["flags"][soft_max] ^= ggml.tensor_flags["OUTPUT"]
    elif field == "name":
        recs["name"][0] = b"renamed"
    elif field == "type":
        recs["type"][view] = ggml.types["F16"]
    elif field == "op":
        recs["op"][soft_max] = ggml.ops["SCALE"]
    elif field == "node":
        nodes = np.frombuffer(session.wire, np.uint64, count=n_nodes, offset=4).copy()
        nodes[-1] = nodes[0]  # a node listed twice: refused
        wire = session.wire[:4] + nodes.tobytes() + session.wire[4 + 8 * n_nodes:]
    if wire is None:
        wire = session.wire_with(recs)
    assert wire != session.wire
    hits = session.cache.hits
    session.compute(wire)
    assert session.cache.hits == hits
    # and the original graph is still served, with the right result
    data = graph_inputs(5)
    session.set_inputs(data)
    assert session.compute() == (0, 0)
    assert session.output() == direct_output(ggml, data)


def test_row_ids_are_checked_again_on_every_hit(session, ggml):
    """GET_ROWS reads its row ids before compute: a cached graph re-reads and re-checks them,
    so ids made out of range after the first compute are refused, not served."""
    session.set_inputs(graph_inputs(1))
    assert session.compute() == (0, 0)
    session.set_inputs(graph_inputs(1, rows=(0, N_ROWS, 1)))
    rc, _ = session.compute()
    assert rc != 0
    assert session.cache.hits == 1  # found, re-checked, refused
    assert len(session.cache) == 0  # and dropped
    data = graph_inputs(2, rows=(N_ROWS - 1, 0, 2))
    session.set_inputs(data)
    assert session.compute() == (0, 0)
    assert session.output() == direct_output(ggml, data)


def test_row_ids_the_kernel_reads_are_the_new_copy(session, ggml):
    """After a hit the kernel reads the ids copied (and checked) for this compute."""
    for seed, rows in ((1, (1, 2, 3)), (2, (9, 8, 7)), (3, (0, 0, 0))):
        data = graph_inputs(seed, rows)
        session.set_inputs(data)
        assert session.compute() == (0, 0)
        assert session.output() == direct_output(ggml, data)
    assert session.cache.hits == 2


def test_freed_buffer_drops_its_graphs(session, ggml):
    session.set_inputs(graph_inputs(1))
    assert session.compute() == (0, 0)
    assert len(session.cache) == 1
    assert session.guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(session.remote.handle))[0] == 0
    assert len(session.cache) == 0
    rc, _ = session.compute()
    assert rc != 0  # the graph's buffer is gone


def test_cache_is_per_context(ggml):
    a, b = Guest(), Guest()
    try:
        sa, sb = GraphSession(a, ggml), GraphSession(b, ggml)
        for s in (sa, sb):
            s.set_inputs(graph_inputs(1))
            assert s.compute() == (0, 0)
            assert (s.cache.hits, s.cache.misses) == (0, 1)
        assert sa.cache is not sb.cache
        sa.close()
        sb.close()
    finally:
        a.close()
        b.close()


class _Buffers(dict):
    pass


class _Lib:
    def __init__(self, buffers):
        self.buffers = buffers


class _Scratch:
    def __init__(self, size=100):
        self.size, self.closed, self.pinned = size, False, []

    def close(self):
        self.closed = True


class _NoInfos(list):
    """An entry's infos when no rule ran (apir.host.graph.build.TensorInfos)."""

    nbytes = 0

    def made(self):
        return []


def _entry(key, buffers, size=100):
    return GraphCacheEntry(key, _Scratch(size), 0, [], buffers, _NoInfos(), np.zeros((0, 1), np.int32), [])


def test_take_needs_equal_key_and_the_same_buffer_objects():
    buf = object()
    cache = GraphCache()
    cache.put(_entry(b"k" * 10, {5: buf}))
    assert cache.take(b"k" * 9 + b"j", _Lib({5: buf})) is None
    assert cache.take(b"k" * 10, _Lib({5: object()})) is None  # same handle, another buffer
    assert len(cache) == 0  # that entry was freed
    e = _entry(b"k" * 10, {5: buf})
    cache.put(e)
    assert cache.take(b"k" * 10, _Lib({5: buf})) is e
    assert len(cache) == 0  # taken out while in use


def test_cache_is_bounded():
    cache = GraphCache(max_entries=3, max_bytes=1000)
    entries = [_entry(bytes([i]) * 10, {}) for i in range(5)]
    for e in entries:
        cache.put(e)
    assert len(cache) == 3
    assert [e.scratch.closed for e in entries] == [True, True, False, False, False]
    big = _entry(b"x" * 10, {}, size=2000)
    cache.put(big)
    assert big.scratch.closed and len(cache) == 3
    cache.put(_entry(b"y" * 10, {}, size=700))  # 700 + 2 * 110 + 110 > 1000: two evicted
    assert cache.nbytes <= 1000
    cache.clear()
    assert len(cache) == 0 and all(e.scratch.closed for e in entries)


def _ids_read_three_ways(g, ctx):
    """One I32 ids vector of 6, its view v of 3 (made strided, nb[0] = 8, by the test) read at
    its nb by GET_ROWS of a 10-row and of a 4-row table, and packed (its first 3 elements) by
    GET_ROWS_BACK into 5 rows: bound 4 at nb, bound 5 packed."""
    f32 = g.types["F32"]
    big, small = g.ggml_new_tensor_2d(ctx, f32, 4, 10), g.ggml_new_tensor_2d(ctx, f32, 4, 4)
    grad, shape = g.ggml_new_tensor_2d(ctx, f32, 4, 3), g.ggml_new_tensor_2d(ctx, f32, 4, 5)
    ids = g.ggml_new_tensor_1d(ctx, g.types["I32"], 6)
    v = g.ggml_view_1d(ctx, ids, 3, 0)
    rows = g.ggml_add(ctx, g.ggml_get_rows(ctx, big, v), g.ggml_get_rows(ctx, small, v))
    out = g.ggml_concat(ctx, rows, g.ggml_get_rows_back(ctx, grad, v, shape), 1)
    return out, [big, small, grad, shape, ids]


def test_a_hit_checks_each_way_ids_are_read_against_its_least_bound(guest, ggml):
    """An ids view read by three rules, two ways: on each hit the fresh ids are checked at the
    view's nb against the least bound read that way (4, not 10) and packed against the packed
    read's (5); ids neither way reads may be anything. Out of range either way: refused (the
    kernels would GGML_ASSERT, or write past the result), and the next good ids computed."""
    from tests.host.shapekit import Case, Remote

    first = {4: lambda n, rng: np.arange(n, dtype=np.int32) % 3}
    r = Remote(guest, ggml, Case("GET_ROWS", _ids_read_three_ways, data=first))
    cache = guest.ctx._library.graph_cache
    try:
        recs = r.recs.copy()
        recs["nb"][int(np.nonzero(recs["view_src"] == r.inputs[4])[0][0])][0] = 8  # v: ids 0, 2, 4
        assert r.compute(recs)[0] == 0
        big, small = (
            np.frombuffer(guest.get_tensor(r.remote.handle, r.remote.rpc(t), 4 * 4 * n)[1], np.float32).reshape(n, 4)
            for t, n in ((r.inputs[0], 10), (r.inputs[1], 4))
        )
        hits, misses, served = cache.hits, cache.misses, True
        # (ids, computed): at nb elements 0, 2, 4 (< 4), packed 0, 1, 2 (< 5); 3 and 5 unread
        good = ([0, 4, 2, 99, 3, -1], True), ([3, 4, 0, 2**31 - 1, 1, -2**31], True)
        bad = ([0, 5, 2, 3, 3, 0], False), ([0, 1, 2, 3, 4, 0], False), ([-1, 1, 2, 3, 3, 0], False)
        for ids, ok in (good[0], *[step for b in bad for step in (b, good[1])]):  # each bad one a hit
            assert guest.set_tensor(r.remote.handle, r.remote.rpc(r.inputs[4]), np.array(ids, np.int32).tobytes()) == 0
            rc, dec = r.compute(recs)
            assert (rc == 0) is ok, ids
            # a hit (the last graph's bytes again), or a miss after a refusal dropped the entry
            hits, misses = (hits + 1, misses) if served else (hits, misses + 1)
            assert (cache.hits, cache.misses) == (hits, misses), ids
            served = ok
            if ok:
                assert dec.i32() == 0
                got = np.frombuffer(r.result(), np.float32).reshape(8, 4)
                assert (got[:3] == big[ids[0:6:2]] + small[ids[0:6:2]]).all(), ids
    finally:
        r.close()


def _get_rows_at(offset):
    """GET_ROWS of a 4-row table at 3 of 6 I32 ids, from element `offset`."""

    def build(g, ctx):
        table, ids = g.ggml_new_tensor_2d(ctx, g.types["F32"], 4, 4), g.ggml_new_tensor_1d(ctx, g.types["I32"], 6)
        y = g.ggml_get_rows(ctx, table, g.ggml_view_1d(ctx, ids, 3, 4 * offset))
        g.ggml_set_output(y)
        graph = g.ggml_new_graph(ctx)
        g.ggml_build_forward_expand(graph, y)
        return graph, [table, ids], y

    return build


def test_graph_bytes_rewritten_during_the_match_serve_only_checked_graphs(guest, ggml):
    """Two cached graphs, A (ids 0..2 of its buffer) and B (ids 3..5 of its own), and a second
    thread rewriting the graph bytes from one to the other, in two parts at a random cut (the
    bytes are a mix of both meanwhile), while they are matched where they lie (the match runs
    without the GIL): whatever the host reads, it serves a checked graph or refuses. B's ids
    are made out of range after it was cached, so B never computes (its result keeps its
    sentinel), and A then computes to ggml CPU's bytes."""
    import threading

    from tests.host.hostkit import RepeatedGraph

    a, b = RepeatedGraph(guest, ggml, _get_rows_at(0)), RepeatedGraph(guest, ggml, _get_rows_at(3))
    cache = guest.ctx._library.graph_cache
    table = np.arange(16, dtype=np.float32).tobytes()
    try:
        assert a.compute([table, np.array([1, 2, 3, 9, 9, 9], np.int32).tobytes()])[:2] == (0, 0)
        assert b.compute([table, np.array([9, 9, 9, 3, 2, 1], np.int32).tobytes()])[:2] == (0, 0)
        assert guest.set_tensor(b.remote.handle, b.remote.rpc(b.inputs[1]), np.full(6, 4, np.int32).tobytes()) == 0
        sentinel = np.full(12, -7, np.float32).tobytes()
        assert guest.set_tensor(b.remote.handle, b.remote.rpc(b.y), sentinel) == 0
        wires = [np.frombuffer(w, np.uint8) for w in (a.remote.wire, b.remote.wire)]
        assert len(wires[0]) == len(wires[1])
        n = len(wires[0])
        memory = np.frombuffer(guest.data, np.uint8, count=n)
        stop = threading.Event()

        def rewrite():
            rng = np.random.default_rng(5)
            while not stop.is_set():
                wire, cut = wires[rng.integers(0, 2)], int(rng.integers(0, n))
                memory[cut:] = wire[cut:]  # (the other graph's bytes before `cut` for a while)
                memory[:cut] = wire[:cut]

        writer = threading.Thread(target=rewrite)
        writer.start()
        try:
            send = (Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(n)))
            rcs = []
            # at least 300 sends, and on until 3 were hits (a loaded machine interleaves the
            # writer more often, and fewer sends find a whole graph): the hits are the point
            while len(rcs) < 300 or (cache.hits <= 2 and len(rcs) < 5000):
                rcs.append(guest.forward(*send)[0])
        finally:
            stop.set()
            writer.join()
        assert set(rcs) <= {0, 1} and cache.hits > 2, (set(rcs), cache.hits)
        assert guest.get_tensor(b.remote.handle, b.remote.rpc(b.y), len(sentinel))[1] == sentinel
        ids = np.array([3, 0, 1, 9, 9, 9], np.int32)
        rc, status, out = a.compute([table, ids.tobytes()])
        assert (rc, status) == (0, 0)
        assert out == np.arange(16, dtype=np.float32).reshape(4, 4)[ids[:3]].tobytes()
    finally:
        a.close()
        b.close()


def _get_rows_of_many_ids(n_ids):
    """GET_ROWS of a one-row table at `n_ids` I32 ids (all 0): an entry pins a copy of them."""

    def build(g, ctx):
        table, ids = g.ggml_new_tensor_2d(ctx, g.types["F32"], 1, 1), g.ggml_new_tensor_1d(ctx, g.types["I32"], n_ids)
        y = g.ggml_get_rows(ctx, table, ids)
        g.ggml_set_output(y)
        graph = g.ggml_new_graph(ctx)
        g.ggml_build_forward_expand(graph, y)
        return graph, [table, ids], y

    return build


def test_the_row_id_copies_an_entry_pins_count_against_max_bytes(guest, ggml):
    """The checked copies of the row ids (TensorInfo.snapshot: as large as the guest's ids
    tensor) live as long as the entry: its bytes count them, so a cache whose max_bytes
    they exceed does not keep the graph (8 such entries would otherwise pin 8 ids tensors'
    worth of host memory past the bound)."""
    from tests.host.hostkit import RepeatedGraph

    n_ids = 1 << 18  # 1 MiB of ids
    rg = RepeatedGraph(guest, ggml, _get_rows_of_many_ids(n_ids))
    cache = guest.ctx._library.graph_cache
    try:
        ids = np.zeros(n_ids, np.int32).tobytes()
        assert rg.compute([np.float32(2.5).tobytes(), ids])[:2] == (0, 0)
        (entry,) = cache._entries.values()
        pinned = sum(len(entry.infos[i].snapshot) for i in entry.id_holders)
        assert pinned == 4 * n_ids
        assert entry.nbytes >= pinned + len(entry.key)
        cache.clear()
        cache.max_bytes = 4 * n_ids  # room for everything but the ids' copy
        rc, status, out = rg.compute([np.float32(1.5).tobytes(), ids])
        assert (rc, status, out) == (0, 0, np.full(n_ids, 1.5, np.float32).tobytes())
        assert len(cache) == 0 and cache.nbytes == 0
    finally:
        rg.close()


def test_row_ids_are_checked_again_on_a_hit_under_other_ids(session, ggml, monkeypatch):
    """An entry matched in place under other ids (`GraphWire.same_structure`) re-checks its row
    ids as a hit with the same bytes does: an id out of range is refused without a parse and
    the entry is dropped; the graph is then parsed and refused in full; with ids in range
    again it is built anew."""
    import apir.host.backend.dispatch_backend as db

    a, b = session.wire, _renamed(session, 1 << 40)
    parses = []
    real = db.parse_graph
    monkeypatch.setattr(db, "parse_graph", lambda *args, **k: parses.append(1) or real(*args, **k))
    session.set_inputs(graph_inputs(1))
    assert session.compute(a) == (0, 0)
    (entry,) = session.cache._entries.values()
    assert entry.wire.matches(a, len(a)) and not entry.wire.matches(b, len(b))
    assert entry.wire.same_structure(b, len(b), entry.links)
    session.set_inputs(graph_inputs(2, rows=(0, N_ROWS, 1)))
    assert session.compute(b)[0] != 0
    assert (len(parses), len(session.cache)) == (1, 0)  # matched in place, refused, dropped
    assert session.compute(b)[0] != 0
    assert (len(parses), len(session.cache)) == (2, 0)
    data = graph_inputs(3, rows=(N_ROWS - 1, 0, 2))
    session.set_inputs(data)
    assert session.compute(b) == (0, 0)
    assert session.output() == direct_output(ggml, data)
    assert len(parses) == 3 and len(session.cache) == 1
