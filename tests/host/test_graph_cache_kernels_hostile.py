"""The graph cache's kernels (apir.host.graph.cache: the in-place comparisons over int64 words,
record_key_kernel, name_lens_kernel) and its entries keyed by `link_key`, on hostile bytes.
- No byte past a graph is read: graphs ending at a PROT_NONE page (their start at 0, 8, 16 and
  24 mod 32), word and byte runs of every length ending there at every alignment, kernel rows
  and output at a guard; every kernel at every start alignment 0..31 of both sides (an aligned
  vector load would fault), jitted (child process). The guard does fault.
- One flipped bit in each byte of each header word and record, at every alignment 0..7:
  record_match_kernel, records_moved_kernel and ids_moved_kernel answer exactly as the masks
  say, equal to their `.py_func` twins; same_structure equals the parse oracle on every flip.
- name_lens_kernel against a byte scan on hostile names at every row offset.
- graph_compute's link_key entries: same counts and links but other records, and same records
  but other links, live side by side, each served its own entry; hostile rewrites that parse
  to the entry's graph_key are all hits; graphs with no tensors, or tensors and no nodes; a
  refused graph is a miss and leaves no entry; counters and nbytes.
- record_key_kernel's word stores at any alignment and record size 8..41.
Mutants these tests catch: the header loop or records_moved_kernel one word short (the flip
tests), _bytes_diff reading one word past n (the guard test), same_structure without
ids_link_kernel (the link tests).
"""

from __future__ import annotations

import ctypes
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from apir.host.graph import kernels as K
from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.codec.graph import GraphError, parse_graph
from apir.codec.records import rpc_tensor_dtype
from apir.host.graph.cache import _key_mask, graph_key, graph_wire, link_key
from tests.host.cachekit import GraphSession, direct_output, graph_inputs
from tests.host.hostkit import DATA_RES, GgmlScratch, RemoteGraph

ROOT = Path(__file__).resolve().parents[2]


def _kw(g):
    return dict(limits=g.limits, op_count=g.op_count, type_valid=g.valid_types)


def _graph_bytes(n: int, n_nodes: int, seed: int, limits=None) -> bytes:
    """A valid graph of `n` data-less tensors (a DAG over all src slots and view_src), names
    "t<i>" then junk after the NUL, junk in padding and holes, `n_nodes` node ids."""
    rng = np.random.default_rng(seed)
    rpc = rpc_tensor_dtype() if limits is None else rpc_tensor_dtype(limits)
    ids = rng.permutation(np.unique(rng.integers(1, 1 << 37, 3 * n))[:n] * 8).astype(np.uint64)
    raw = np.frombuffer(rng.integers(0, 256, n * rpc.itemsize, dtype=np.uint8).tobytes(), rpc).copy()
    recs = np.zeros(n, rpc)
    recs["padding"] = raw["padding"]
    recs["id"] = ids
    recs["type"] = 0
    recs["ne"], recs["nb"] = [1, 1, 1, 1], [4, 4, 4, 4]
    recs["op"] = rng.integers(0, 5, n)
    recs["op_params"] = raw["op_params"]
    max_src = rpc.fields["src"][0].shape[0]
    for i in range(1, n):
        for s in range(max_src):
            if rng.random() < 0.3:
                recs["src"][i, s] = ids[rng.integers(0, i)]
        if rng.random() < 0.3:
            recs["view_src"][i] = ids[rng.integers(0, i)]
    b = recs.view(np.uint8).reshape(n, -1)
    name_at = rpc.fields["name"][1]
    for i in range(n):
        name = f"t{i}".encode() * (1 + i * 3 % 20)
        name = name[:63]
        b[i, name_at : name_at + len(name)] = list(name)
        b[i, name_at + len(name) + 1 : name_at + 64] = rng.integers(1, 256, 63 - len(name))
    # the holes between fields (12..16, 300..304)
    b[:, 12:16] = rng.integers(0, 256, (n, 4))
    b[:, rpc.itemsize - 4 :] = rng.integers(0, 256, (n, 4))
    nodes = ids[rng.integers(0, n, n_nodes)]
    return struct.pack("<I", n_nodes) + nodes.astype("<u8").tobytes() + struct.pack("<I", n) + recs.tobytes()


KW0 = dict(op_count=100, type_valid=np.ones(40, bool))


def _entry(raw: bytes):
    p = parse_graph(raw, **KW0)
    return p, graph_key(p), graph_wire(p), (p.node_index, p.src_index, p.view_src_index)


def _add(a: np.ndarray, delta: int) -> np.ndarray:
    return (a.astype(np.int64) + delta).astype(a.dtype)


def _moved(raw: bytes, delta: int) -> bytes:
    n_nodes = struct.unpack_from("<I", raw)[0]
    head = 8 + 8 * n_nodes
    nodes = np.frombuffer(raw, "<i8", n_nodes, 4) + delta
    recs = np.frombuffer(raw, rpc_tensor_dtype(), offset=head).copy()
    recs["id"] = _add(recs["id"], delta)
    for f in ("src", "view_src"):
        recs[f] = np.where(recs[f] != 0, _add(recs[f], delta), 0)
    return raw[:4] + nodes.tobytes() + raw[head - 4 : head] + recs.tobytes()


def _compared(wire, raw_len: int) -> np.ndarray:
    """Per byte of a graph of `wire`'s shape: 0 not compared, 1 compared outside ids (or in the
    header), 2 an id word's byte (id, src[], view_src)."""
    out = np.zeros(raw_len, np.int8)
    out[: wire.head] = 1
    rec_mask = (np.frombuffer(_key_mask(rpc_tensor_dtype(), ids=True).tobytes(), np.uint8) != 0).astype(np.int8)
    rec_mask[wire.name_at : wire.name_at + 64] = 0
    for w in wire.id_words:
        rec_mask[8 * w : 8 * w + 8] = 2
    n = (raw_len - wire.head) // wire.record_size
    for r in range(n):
        m = rec_mask.copy()
        m[wire.name_at : wire.name_at + int(wire.name_lens[r]) + 1] = 1
        out[wire.head + r * wire.record_size : wire.head + (r + 1) * wire.record_size] = m
    return out


# --- no read past the bytes, no misaligned vector load (child) ------------------------------------

_GUARD_CHILD = textwrap.dedent(
    """
    import ctypes, mmap, struct, sys
    sys.path.insert(0, sys.argv[1])
    import numba
    import numpy as np
    from apir import accel
    from apir.host.graph import kernels as K
    from tests.host.test_graph_cache_kernels_hostile import _graph_bytes, _entry, _moved, KW0

    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    def guarded(pages):
        mm = mmap.mmap(-1, (pages + 1) * page)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        assert libc.mprotect(base + pages * page, page, 0) == 0
        return mm, base, pages * page  # (the guard's offset)

    @numba.njit(nogil=True)
    def bytes_diff(a, b, n):
        return K._bytes_diff(a, b, n)

    @numba.njit(nogil=True)
    def sum_words(a, n):
        t = 0
        for k in range(n):
            t += K.load_i64_at(a, k)
        return t

    new, nbase, nguard = guarded(40)
    old, obase, oguard = guarded(40)
    done = 0
    for n_nodes in (0, 1, 2, 3):
        for n in (1, 5, 30):
            raw = _graph_bytes(n, n_nodes, seed=7 * n + n_nodes)
            p, key, wire, links = _entry(raw)
            at = nguard - len(raw)
            assert (nbase + at) % 32 == (-len(raw)) % 32
            # the whole graph at the guard, through GraphWire (memcmp path, masked path, moved, linked)
            variants = [(raw, True, True), (raw[:-1] + bytes([raw[-1] ^ 1]), True, True),
                        (_moved(raw, 8), False, True), (_moved(raw, -8), False, True)]
            last = len(raw) - wire.record_size + 24  # ne[0] of the last record: differs
            variants.append((raw[:last] + bytes([raw[last] ^ 0x40]) + raw[last + 1 :], False, False))
            enabled = accel.enabled
            for plain in (False, True):  # (the accelerated path, then the plain one)
                accel.enabled = (lambda: False) if plain else enabled
                for bytes_, m_want, s_want in variants:
                    new[at:nguard] = bytes_
                    view = memoryview(new)[at:nguard]
                    assert wire.matches(view, len(raw)) is m_want, (n, n_nodes)
                    assert wire.same_structure(view, len(raw), links) is s_want, (n, n_nodes)
                    assert wire.matches(view[:-8], len(raw) - 8) is False
                    assert wire.same_structure(view[:-1], len(raw) - 1, links) is False
                    view.release()
                    done += 1
            accel.enabled = enabled
            # the kernels, both sides at their guards
            old[oguard - len(raw) : oguard] = wire.data
            a, b = nbase + at, obase + oguard - len(raw)
            new[at:nguard] = wire.data
            t = (wire.head, wire.record_size, wire.word_mask, wire.name_at, wire.name_lens)
            assert K.record_match_kernel(a, len(raw), b, len(raw), *t)
            assert K.records_match_kernel(a, b, wire.head, wire.record_size, wire.link_mask, wire.name_at,
                                          wire.name_lens, 0, n)
            assert K.records_moved_kernel(a, b, wire.head, wire.record_size, wire.word_mask, wire.link_mask,
                                          wire.moves, wire.name_at, wire.name_lens, 0, 0, n) == K.MOVED_SAME
            assert K.ids_moved_kernel(a + 4, b + 4, n_nodes, 0)
            done += 1

    # word runs and byte runs ending at the guard at every alignment, both sides
    rng = np.random.default_rng(1)
    fill = rng.integers(0, 256, page, dtype=np.uint8).tobytes()
    new[nguard - page : nguard] = fill
    old[oguard - page : oguard] = fill
    for k in range(0, 12):
        for s in range(8):
            ln = 8 * k + s  # ends at the guard; starts at alignment -s mod 8
            a, b = nbase + nguard - ln, obase + oguard - ln
            assert K.ids_moved_kernel(a, b, k, 0) and K.ids_moved_kernel(a + s, b + s, k, 0)
            assert sum_words(a + s, k) == sum_words(b + s, k)
            assert bytes_diff(a, b, ln) == 0
            done += 1

    # every start alignment 0..31 of either side, away from the guards (a misaligned aligned load faults)
    raw = _graph_bytes(9, 3, seed=99)
    p, key, wire, links = _entry(raw)
    n = 9
    for sa in range(32):
        for sb in (0, 1, 3, 8, 13, 16, 24, 31):
            new[sa : sa + len(raw)] = raw
            old[sb : sb + len(raw)] = wire.data
            a, b = nbase + sa, obase + sb
            t = (wire.head, wire.record_size, wire.word_mask, wire.name_at, wire.name_lens)
            assert K.record_match_kernel(a, len(raw), b, len(raw), *t)
            assert K.records_moved_kernel(a, b, wire.head, wire.record_size, wire.word_mask, wire.link_mask,
                                          wire.moves, wire.name_at, wire.name_lens, 0, 0, n) == K.MOVED_SAME
            assert K.ids_moved_kernel(a + 4, b + 4, 3, 0)
            assert bytes_diff(a, b, len(raw)) != 0  # (junk after names, padding)
            view = memoryview(new)[sa : sa + len(raw)]
            assert wire.matches(view, len(raw)) and wire.same_structure(view, len(raw), links)
            view.release()
            done += 1

    # record_key_kernel's stores and name_lens_kernel: rows and output ending at a guard, any offset
    size = 304
    for s in range(8):
        for k in (1, 3):
            rows = np.frombuffer(new, np.uint8, k * size, nguard - k * size - s).reshape(k, size)
            rows[:] = np.frombuffer(fill[: k * size], np.uint8).reshape(k, size)
            rows[:, 232 + 5] = 0
            out = np.frombuffer(old, np.uint8, k * size, oguard - k * size - s)
            mask = np.full(size, 0xFF, np.uint8)
            assert K.record_key_kernel(rows, mask, 232, 64, out) == 0
            want = rows.copy()
            want[:, 232 + 6 : 296] = 0
            assert np.array_equal(out.reshape(k, size), want)
            lens = np.zeros(k, np.int64)
            assert K.name_lens_kernel(rows, 232, 64, lens) == 0 and lens.tolist() == [5] * k
            if s == 0:  # rows ending exactly at the guard, names last (a 296-byte row)
                r2 = np.frombuffer(new, np.uint8, k * 296, nguard - k * 296).reshape(k, 296)
                r2[:, 232:] = 0x80
                assert K.name_lens_kernel(r2, 232, 64, lens) == 0 and lens.tolist() == [63] * k
                o2 = np.frombuffer(old, np.uint8, k * 296, oguard - k * 296)
                assert K.record_key_kernel(r2, np.full(296, 0xFF, np.uint8), 232, 64, o2) == 0
                assert np.array_equal(o2.reshape(k, 296), r2)
            done += 1
    print("OK", done, flush=True)
    if len(sys.argv) > 2:
        ctypes.string_at(nbase + nguard, 1)
    """
)


def _child(*extra):
    return subprocess.run([sys.executable, "-c", _GUARD_CHILD, str(ROOT), *extra], capture_output=True, text=True,
                          timeout=300, cwd=str(ROOT))


def test_vectorized_kernels_read_nothing_past_the_bytes_at_any_alignment():
    """Graphs, cached bytes, word and byte runs, rows and outputs ending at PROT_NONE pages, at
    every alignment, and every start alignment 0..31 of both sides: jitted kernels and GraphWire
    answer right without a fault; the guard does fault on the next byte."""
    res = _child()
    assert res.returncode == 0 and res.stdout.strip() == "OK 500", (res.returncode, res.stdout, res.stderr[-3000:])
    probe = _child("probe")
    assert probe.returncode < 0 and probe.stdout.strip() == "OK 500", (probe.returncode, probe.stdout)


# --- one flipped bit, everywhere ------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_every_flipped_byte_is_noticed_exactly_where_the_masks_say(seed):
    """Each byte of a graph flipped (one bit, rotating), the graph at alignment 0..7:
    record_match_kernel is False exactly on compared bytes (header; masked record bytes; a name
    up to and including its NUL), records_moved_kernel (ids moved by a delta) says MOVED_SAME /
    MOVED_IDS_DIFFER / MOVED_DIFFERENT as the byte is unread / an id word's / other compared,
    ids_moved_kernel notices every node id byte; the twins agree (alignments 0 and 5)."""
    raw = _graph_bytes(6, 4, seed)
    p, key, wire, links = _entry(raw)
    delta = 8 * 1234567
    moved = _moved(raw, delta)
    n = 6
    kinds = _compared(wire, len(raw))
    assert (kinds == 2).sum() == 6 * 8 * 12 and (kinds == 0).sum() > 6 * 40  # (ids; holes, padding, name tails)
    old = np.frombuffer(wire.data, np.uint8)
    buf = np.zeros(len(raw) + 64, np.uint8)
    t = (wire.head, wire.record_size, wire.word_mask, wire.name_at, wire.name_lens)
    mv = (wire.head, wire.record_size, wire.word_mask, wire.link_mask, wire.moves, wire.name_at, wire.name_lens)
    for s in range(8):
        twin = s in (0, 5)
        for base, is_moved in ((raw, False), (moved, True)):
            for i in range(len(raw)):
                flipped = bytearray(base)
                flipped[i] ^= 1 << (i % 8)
                buf[s : s + len(raw)] = np.frombuffer(bytes(flipped), np.uint8)
                a, b = buf.ctypes.data + s, old.ctypes.data
                kind = int(kinds[i])
                if not is_moved:
                    got = K.record_match_kernel(a, len(raw), b, len(raw), *t)
                    assert got == (kind == 0), (s, i, kind)
                    if twin:
                        assert K.record_match_kernel.py_func(a, len(raw), b, len(raw), *t) == got
                    continue
                if i < wire.head:
                    ids_ok = K.ids_moved_kernel(a + 4, b + 4, 4, delta)
                    assert ids_ok == (not 4 <= i < wire.head - 4), (s, i)
                    if twin:
                        assert K.ids_moved_kernel.py_func(a + 4, b + 4, 4, delta) == ids_ok
                    continue
                got = K.records_moved_kernel(a, b, *mv, delta, 0, n)
                want = (K.MOVED_SAME, K.MOVED_DIFFERENT, K.MOVED_IDS_DIFFER)[kind]
                assert got == want, (s, i, kind, got)
                if twin:
                    assert K.records_moved_kernel.py_func(a, b, *mv, delta, 0, n) == got


def _parses_to(buf: bytes, key: bytes) -> bool:
    try:
        return graph_key(parse_graph(buf, **KW0)) == key
    except GraphError:
        return False


def test_same_structure_is_the_parse_on_every_flipped_byte():
    """Every byte of the graph, of it moved by a delta and of it under permuted ids flipped:
    GraphWire.same_structure accepts exactly the bytes parse_graph gives the entry's graph_key
    (what a lookup by graph_key would find); matches never accepts what same_structure
    refuses."""
    raw = _graph_bytes(5, 3, 11)
    p, key, wire, links = _entry(raw)
    ids = np.frombuffer(raw, rpc_tensor_dtype(), offset=wire.head)["id"].astype(np.int64)
    perm = dict(zip(ids.tolist(), (ids[::-1] * 3 + 16).tolist()))  # not one constant: the linked path
    n_nodes = 3
    nodes = np.array([perm[int(x)] for x in np.frombuffer(raw, "<i8", n_nodes, 4)], "<i8")
    recs = np.frombuffer(raw, rpc_tensor_dtype(), offset=wire.head).copy()
    for f in ("id", "src", "view_src"):
        recs[f] = np.vectorize(lambda x: perm.get(int(x), 0))(recs[f])
    renamed = raw[:4] + nodes.tobytes() + raw[wire.head - 4 : wire.head] + recs.tobytes()
    counts = {True: 0, False: 0}
    for base in (raw, _moved(raw, 40), renamed):
        assert _parses_to(base, key) and wire.same_structure(base, len(base), links)
        for i in range(len(raw)):
            flipped = bytearray(base)
            flipped[i] ^= 1 << (i % 8)
            want = _parses_to(bytes(flipped), key)
            got = wire.same_structure(bytes(flipped), len(flipped), links)
            assert got == want, (i, got, want)
            assert not wire.matches(bytes(flipped), len(flipped)) or got
            counts[got] += 1
    assert counts[True] > 300 and counts[False] > 1500


def test_name_lens_kernel_is_a_byte_scan_at_every_row_offset():
    """name_lens_kernel (jitted and twin) = the index of the first NUL in the name, 63 without
    one, for names of hostile bytes with a NUL at each position, rows at offsets 0..7."""
    hostile = np.array([0x01, 0x7F, 0x80, 0x81, 0xFE, 0xFF], np.uint8)
    rng = np.random.default_rng(3)
    names = rng.choice(hostile, (65 * 3, 64)).astype(np.uint8)
    for r in range(64 * 3):
        names[r, r % 64] = 0
        if r // 64 == 2:
            names[r, r % 64 + 1 :] = 0x01  # (0x01 after the NUL: the borrow case)
    size = 80
    want = [int(np.argmax(row == 0)) if (row == 0).any() else 63 for row in names]
    for s in range(8):
        buf = np.zeros(len(names) * size + 8, np.uint8)
        rows = np.frombuffer(buf.data, np.uint8, len(names) * size, s).reshape(len(names), size)
        rows[:, 8:72] = names
        for fn in (K.name_lens_kernel, K.name_lens_kernel.py_func):
            lens = np.full(len(names), -9, np.int64)
            assert fn(rows, 8, 64, lens) == 0
            assert lens.tolist() == want


# --- graph_compute's link_key entries --------------------------------------------------------------


@pytest.fixture
def session(guest, ggml):
    s = GraphSession(guest, ggml)
    yield s
    s.close()


def _check_nbytes(cache):
    for e in cache._entries.values():
        pinned = sum(ctypes.sizeof(e.infos[i].snapshot) for i in e.id_holders)
        assert e.nbytes == len(e.key) + int(e.scratch.size) + e.infos.nbytes + pinned + len(e.wire.data)
    assert cache.nbytes == sum(e.nbytes for e in cache._entries.values())


def test_same_links_other_records_each_served_its_own_entry(session, ggml):
    """The graph and the graph with soft_max's scale changed (same counts, same links, same
    link_key): two entries; each, sent again, is served its own (ggml's answer for the graph,
    the changed graph's first answer for it), never the other's."""
    data = graph_inputs(5)
    session.set_inputs(data)
    n_nodes, recs = session.records()
    (soft,) = [i for i in range(len(recs)) if recs["op_params"][i].view(np.float32)[0] == np.float32(0.5)]
    other = recs.copy()
    assert other["op_params"][soft].view(np.float32)[0] == np.float32(0.5)
    other["op_params"][soft].view(np.float32)[0] = np.float32(3.0)
    wire2 = session.wire_with(other)
    p1 = parse_graph(session.wire, **_kw(ggml))
    p2 = parse_graph(wire2, **_kw(ggml))
    assert link_key(p1) == link_key(p2) and graph_key(p1) != graph_key(p2)
    want1 = direct_output(ggml, data)
    assert session.compute() == (0, 0) and session.output() == want1
    assert session.compute(wire2) == (0, 0)
    want2 = session.output()
    assert want2 != want1
    cache = session.cache
    assert (len(cache), cache.hits, cache.misses) == (2, 0, 2)
    assert [e.key for e in cache._entries.values()] == [link_key(p1)] * 2
    for round_ in range(3):
        for w, want in ((session.wire, want1), (wire2, want2), (wire2, want2), (session.wire, want1),
                        (_moved_g(ggml, wire2, 8 * (round_ + 1)), want2),
                        (_moved_g(ggml, session.wire, -8 * (round_ + 1)), want1)):
            session.guest.data[: 1 << 16] = b"\0" * (1 << 16)
            assert session.compute(w) == (0, 0)
            assert session.output() == want
    assert (len(cache), cache.hits, cache.misses) == (2, 18, 2)
    _check_nbytes(cache)


def _sub_graph(g, ctx):
    f32 = g.types["F32"]
    x = g.ggml_new_tensor_1d(ctx, f32, 4)
    y = g.ggml_new_tensor_1d(ctx, f32, 4)
    for i, t in enumerate((x, y)):
        g.ggml_set_name(t, f"in{i}".encode())
        g.ggml_set_input(t)
    d = g.ggml_sub(ctx, x, y)
    g.ggml_set_output(d)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, d)
    return graph, [x, y], d


def test_same_records_other_links_each_served_its_own_entry(guest, ggml):
    """x - y, and the same bytes with the sub's two src ids swapped (y - x: records equal
    under link_mask, other links): two entries; each sent again (also under ids moved by a
    delta) is served its own, with its own answer."""
    s = GgmlScratch(ggml)
    graph, (x, y), d = _sub_graph(ggml, s.ctx)
    remote = RemoteGraph(guest, ggml, s.ctx, graph)
    try:
        xs, ys = np.arange(4, dtype=np.float32), np.array([10, 20, 30, 40], np.float32)
        for t, v in ((x, xs), (y, ys)):
            assert guest.set_tensor(remote.handle, remote.rpc(t), v.tobytes()) == 0
        wire = remote.wire
        n_nodes = struct.unpack_from("<I", wire)[0]
        head = 8 + 8 * n_nodes
        recs = np.frombuffer(wire, rpc_tensor_dtype(ggml.limits), offset=head).copy()
        (k,) = np.flatnonzero(recs["src"][:, 1] != 0)
        swapped = recs.copy()
        swapped["src"][k, 0], swapped["src"][k, 1] = recs["src"][k, 1], recs["src"][k, 0]
        wire2 = wire[:head] + swapped.tobytes()
        p1, p2 = parse_graph(wire, **_kw(ggml)), parse_graph(wire2, **_kw(ggml))
        assert link_key(p1) != link_key(p2)
        cache = guest.ctx._library.graph_cache

        def run(w):
            guest.data[: len(w)] = w
            rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(w))))
            assert rc == 0 and dec.i32() == 0
            rc, out = guest.get_tensor(remote.handle, remote.rpc(d), 16)
            assert rc == 0
            return np.frombuffer(out, np.float32).tolist()

        assert run(wire) == (xs - ys).tolist()
        assert run(wire2) == (ys - xs).tolist()
        assert (len(cache), cache.hits, cache.misses) == (2, 0, 2)
        for w, want in ((wire, xs - ys), (wire2, ys - xs), (_moved_g(ggml, wire2, 4096), ys - xs),
                        (_moved_g(ggml, wire, -8), xs - ys), (wire, xs - ys)):
            assert run(w) == want.tolist()
        assert (len(cache), cache.hits, cache.misses) == (2, 5, 2)
        _check_nbytes(cache)
    finally:
        remote.close()
        s.close()


def _moved_g(g, raw: bytes, delta: int) -> bytes:
    n_nodes = struct.unpack_from("<I", raw)[0]
    head = 8 + 8 * n_nodes
    nodes = np.frombuffer(raw, "<i8", n_nodes, 4) + delta
    recs = np.frombuffer(raw, rpc_tensor_dtype(g.limits), offset=head).copy()
    recs["id"] = _add(recs["id"], delta)
    for f in ("src", "view_src"):
        recs[f] = np.where(recs[f] != 0, _add(recs[f], delta), 0)
    return raw[:4] + nodes.tobytes() + raw[head - 4 : head] + recs.tobytes()


def test_every_rewrite_with_the_entrys_graph_key_is_a_hit(session, ggml):
    """The take(graph_key) safety net is gone, so take_same must find every graph that parses
    to the entry's graph_key: ids moved up and down, ids permuted (the linked path), junk after
    every name's NUL, in padding and in the holes, trailing bytes after the graph, all at once.
    Each is a hit on the one entry with ggml's answer; none builds a duplicate."""
    data = graph_inputs(9)
    session.set_inputs(data)
    want = direct_output(ggml, data)
    assert session.compute() == (0, 0)
    p0 = parse_graph(session.wire, **_kw(ggml))
    key0 = graph_key(p0)
    n_nodes, recs = session.records()
    head = 8 + 8 * n_nodes
    rng = np.random.default_rng(4)
    rpc = rpc_tensor_dtype(ggml.limits)
    name_at = rpc.fields["name"][1]

    def junk(r):
        r = r.copy()
        b = r.view(np.uint8).reshape(len(r), -1)
        for i in range(len(r)):
            nul = int(np.argmax(b[i, name_at : name_at + 64] == 0))
            b[i, name_at + nul + 1 : name_at + 64] = rng.integers(0, 256, 63 - nul)
        b[:, 12:16] = rng.integers(0, 256, (len(r), 4))
        b[:, rpc.itemsize - 8 :] = rng.integers(0, 256, (len(r), 8))  # padding and the hole after it
        return r

    def renamed(raw, f):
        nodes = np.array([f(int(v)) for v in np.frombuffer(raw, "<i8", n_nodes, 4)], "<i8")
        r = np.frombuffer(raw, rpc, offset=head).copy()
        for fld in ("id", "src", "view_src"):
            r[fld] = np.vectorize(lambda v: f(int(v)) if v else 0, otypes=[np.int64])(r[fld])
        return raw[:4] + nodes.tobytes() + raw[head - 4 : head] + r.tobytes()

    ids = sorted(int(v) for v in recs["id"])
    perm = dict(zip(ids, ids[::-1]))
    variants = [
        _moved_g(ggml, session.wire, 64),
        _moved_g(ggml, session.wire, -16),
        renamed(session.wire, lambda v: perm[v]),
        renamed(session.wire, lambda v: v * 2 + 1),
        session.wire_with(junk(recs)),
        session.wire + bytes(range(200)),
        renamed(session.wire_with(junk(recs)), lambda v: perm[v] + 24) + b"\xff" * 9,
    ]
    cache = session.cache
    for i, w in enumerate(variants):
        assert graph_key(parse_graph(w, **_kw(ggml))) == key0
        assert session.compute(w) == (0, 0), i
        assert session.output() == want
        assert (len(cache), cache.hits, cache.misses) == (1, i + 1, 1), i
    _check_nbytes(cache)


def test_graphs_without_tensors_or_nodes(session, ggml, host_path):
    """A graph with no tensors (8 bytes; with trailing bytes), and the session's tensors with no
    node: each built once, then hits; one node more is another entry; counts add up. On the
    accelerated and the plain path."""
    cache = session.cache
    empty = struct.pack("<II", 0, 0)
    _, recs = session.records()
    no_nodes = struct.pack("<I", 0) + struct.pack("<I", len(recs)) + recs.tobytes()
    one_node = struct.pack("<IQI", 1, int(recs["id"][-1]), len(recs)) + recs.tobytes()
    plan = [(empty, 1, 0), (empty, 1, 1), (empty + b"\x01" * 16, 1, 2), (no_nodes, 2, 2), (no_nodes, 2, 3),
            (_moved_g(ggml, no_nodes, 8), 2, 4), (one_node, 3, 4), (one_node, 3, 5), (empty, 3, 6)]
    for i, (w, entries, hits) in enumerate(plan):
        assert session.compute(w) == (0, 0), i
        assert (len(cache), cache.hits) == (entries, hits), i
    assert cache.misses == 3
    keys = [e.key for e in cache._entries.values()]  # (least recently used first: empty last)
    n = len(recs)
    assert [np.frombuffer(k[:16], np.int64).tolist() for k in keys] == [[n, 0], [n, 1], [0, 0]]
    assert [len(k) for k in keys] == [16 + 4 * 11 * n, 16 + 4 * (1 + 11 * n), 16]
    _check_nbytes(cache)


def test_record_key_kernel_stores_at_any_alignment_and_record_size():
    """record_key_kernel (store_i64_at, then a byte tail) against a NumPy reference, jitted and
    twin: record sizes 8..41 (whole words and not), rows and output at offsets 0..7, random
    masks, a name anywhere in the record with its NUL at each position or none; the byte after
    the output is never written."""
    rng = np.random.default_rng(8)
    for size in list(range(8, 42)):
        n = 3
        name_len = min(size, 1 + size // 3)
        name_at = int(rng.integers(0, size - name_len + 1))
        for s in range(8):
            src = np.zeros(n * size + 16, np.uint8)
            rows = np.frombuffer(src.data, np.uint8, n * size, s).reshape(n, size)
            rows[:] = rng.choice(np.array([1, 0x7F, 0x80, 0xFF, 0], np.uint8), (n, size))
            rows[:, name_at : name_at + name_len] = rng.choice(np.array([1, 0x80, 0xFF], np.uint8), (n, name_len))
            rows[0, name_at + (s % name_len)] = 0
            rows[1, name_at + name_len - 1] = 0
            mask = np.where(rng.random(size) < 0.7, 0xFF, 0).astype(np.uint8)
            want = rows & mask
            for r in range(n):
                nm = rows[r, name_at : name_at + name_len]
                if (nm == 0).any():
                    want[r, name_at + int(np.argmax(nm == 0)) + 1 : name_at + name_len] = 0
            for fn in (K.record_key_kernel, K.record_key_kernel.py_func):
                dst = np.full(n * size + 16, 0xA5, np.uint8)
                out = np.frombuffer(dst.data, np.uint8, n * size, (s * 3) % 8)
                assert fn(rows, mask, name_at, name_len, out) == 0
                assert np.array_equal(out.reshape(n, size), want), (size, s)
                assert (dst[: (s * 3) % 8] == 0xA5).all() and (dst[(s * 3) % 8 + n * size :] == 0xA5).all()


def test_a_large_graph_split_with_the_helper_is_the_parse_on_flips(monkeypatch):
    """A 2,100-record graph (compared in two halves, the second on the build helper), moved by
    a delta and under other ids: a bit flipped in id words, masked bytes, names and unread bytes
    of records around the split (2,048 / 2 = 1,050), the first and the last: same_structure
    equals the parse oracle on each; `matches` only the same graph."""
    raw = _graph_bytes(2100, 700, 5)
    p, key, wire, links = _entry(raw)
    head, size = wire.head, wire.record_size
    rng = np.random.default_rng(2)
    kinds = _compared(wire, len(raw))
    answers = {True: 0, False: 0}
    for base in (raw, _moved(raw, -8)):
        assert wire.same_structure(base, len(base), links)
        for r in (0, 1049, 1050, 1051, 2099):
            for off in list(rng.integers(0, size, 6)) + [0, 128, 208, wire.name_at, wire.name_at + 1, size - 1]:
                i = head + r * size + int(off)
                flipped = bytearray(base)
                flipped[i] ^= 1 << (i % 8)
                want = _parses_to(bytes(flipped), key)
                got = wire.same_structure(bytes(flipped), len(flipped), links)
                assert got == want, (r, off, kinds[i])
                if kinds[i] != 2:  # (an id flipped may still link: a tensor nothing names)
                    assert want == (kinds[i] == 0), (r, off)
                answers[got] += 1
                if base is raw:
                    assert wire.matches(bytes(flipped), len(flipped)) == (kinds[i] == 0)
    assert answers[True] > 10 and answers[False] > 40


def test_a_refused_graph_counts_a_miss_and_leaves_no_entry(session, ggml):
    """A graph that parses but fails the checks (an output's ne[0] wrong), sent twice between
    computes of the good graph: refused both times (no entry made, each a miss), the good
    graph's entry still served in place."""
    data = graph_inputs(3)
    session.set_inputs(data)
    want = direct_output(ggml, data)
    n_nodes, recs = session.records()
    bad = recs.copy()
    bad["ne"][-1][0] += 1
    wire_bad = session.wire_with(bad)
    parse_graph(wire_bad, **_kw(ggml))  # (parses)
    cache = session.cache
    plan = [(session.wire, True, 1, 0, 1), (wire_bad, False, 1, 0, 2), (session.wire, True, 1, 1, 2),
            (wire_bad, False, 1, 1, 3), (_moved_g(ggml, wire_bad, 8), False, 1, 1, 4), (session.wire, True, 1, 2, 4)]
    for i, (w, ok, entries, hits, misses) in enumerate(plan):
        rc, status = session.compute(w)
        assert (rc == 0) == ok and (status == 0 if ok else status is None), (i, rc, status)
        if ok:
            assert session.output() == want
        assert (len(cache), cache.hits, cache.misses) == (entries, hits, misses), i
    _check_nbytes(cache)
