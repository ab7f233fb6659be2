"""The host's graph build (apir.host.graph.build) against a hostile guest: the parse it starts
from, the rule groups and the host tensors it writes.
- parse_graph_kernel copies each record from the guest just before checking it: a guest
  thread rewriting its bytes meanwhile (ids, types, ops, names, sources, node ids, counts)
  gets a refusal or a private copy that parses again to the very same indices.
- parse_graph_kernel's guessed indices (`_find_id`) against a reference on random graphs
  with duplicated, high-bit, unknown and late ids, jitted and twin.
- rule_group_kernel with every hash forced to one value (one probe chain: only the exact
  comparisons decide) against `groups_by_definition`, 10 source slots, late sources.
- write_tensors_kernel's structs byte for byte as the ggml_new_tensor_1d path writes them
  (src / view_src compared as tensor indices), records in C order and reversed.
"""

import ctypes
import struct
import time

import numpy as np
import pytest

from apir import accel
from apir.host.graph import kernels as K
from apir.codec import _kernels as CK
from apir.codec.graph import GraphError, parse_graph
from apir.codec.records import rpc_tensor_dtype
from apir.host.graph import build as hg
from apir.host.tensors import Scratch
from tests.host.hostkit import GgmlScratch, RemoteGraph, add_chain
from tests.host.hostilekit import groups_by_definition, racing_guest


def _parse(lib, raw, end=None, kernel=None):
    g = lib.g
    return parse_graph(raw, 0, end, limits=g.limits, op_count=g.op_count, type_valid=lib.checker.valid_types,
                       _kernel=kernel)


def test_parse_under_a_racing_guest_checks_what_it_keeps(guest, ggml):
    lib, g = guest.ctx._library, ggml
    s = GgmlScratch(g, 256)
    remote = RemoteGraph(guest, g, s.ctx, add_chain(g, s.ctx, 150))
    wire = remote.wire
    rpc = rpc_tensor_dtype(g.limits)
    n_nodes = struct.unpack_from("<I", wire, 0)[0]
    head = 8 + 8 * n_nodes
    recs = np.frombuffer(wire, rpc, offset=head)
    k = len(recs) // 2

    def at(name, sub=0):
        return head + k * rpc.itemsize + rpc.fields[name][1] + sub

    def u64(v):
        return [(int(v) >> (8 * b)) & 255 for b in range(8)]

    own, before, src0 = int(recs["id"][k]), int(recs["id"][k - 1]), int(recs["src"][k, 0])
    cases = {
        "type": [(at("type"), 0, 4)],
        "op": [(at("op"), wire[at("op")], 250)],
        "dup id": [(at("id", b), u64(own)[b], u64(before)[b]) for b in range(8)],
        "src to self": [(at("src", b), u64(src0)[b], u64(own)[b]) for b in range(8)],
        "src unknown": [(at("src"), src0 & 255, (src0 & 255) ^ 0x33)],
        "name": [(at("name", c), 0, 65) for c in range(rpc.fields["name"][0].itemsize)],
        "node": [(4 + 8 * (n_nodes // 2), wire[4 + 8 * (n_nodes // 2)], wire[4 + 8 * (n_nodes // 2)] ^ 0x11)],
        "n_tensors": [(head - 4, wire[head - 4], wire[head - 4] ^ 1)],
    }
    try:
        for name, spec in cases.items():
            seen = {"kept": 0, "refused": 0}
            with racing_guest(wire, spec) as mem:
                start = time.monotonic()  # (a loaded machine may not run the flipper at once)
                while time.monotonic() < start + 0.7 or (
                    not (seen["kept"] and seen["refused"]) and time.monotonic() < start + 8
                ):
                    try:
                        p = _parse(lib, mem)
                    except GraphError:
                        seen["refused"] += 1
                        continue
                    seen["kept"] += 1
                    copy = struct.pack("<I", p.n_nodes) + p.node_ids.astype("<u8").tobytes()
                    copy += struct.pack("<I", p.n_tensors) + p.tensors.tobytes()
                    q = _parse(lib, copy)  # what was kept passes the checks, to the same links
                    for f in ("node_index", "src_index", "view_src_index", "order"):
                        assert np.array_equal(getattr(p, f), getattr(q, f)), (name, f)
            assert seen["refused"] and seen["kept"], (name, seen)
    finally:
        remote.close()
        s.close()


def _reference(nodes, recs, max_src):
    """None when the graph is valid, else why not (parse_graph's checks but type/op/name)."""
    ids = [int(v) for v in recs["id"]]
    if 0 in ids or len(set(ids)) != len(ids):
        return "ids"
    pos = {t: k for k, t in enumerate(ids)}
    deps = []
    for k in range(len(recs)):
        row = [int(v) for v in recs["src"][k]] + [int(recs["view_src"][k])]
        if any(v and v not in pos for v in row):
            return "unknown"
        deps.append([pos[v] for v in row if v])
    if any(int(v) not in pos for v in nodes):
        return "node"
    state = [0] * len(recs)
    for root in range(len(recs)):
        stack = [(root, iter(deps[root]))] if not state[root] else []
        state[root] = state[root] or 1
        while stack:
            t, it = stack[-1]
            d = next(it, None)
            if d is None:
                state[t] = 2
                stack.pop()
            elif state[d] == 1:
                return "cycle"
            elif state[d] == 0:
                state[d] = 1
                stack.append((d, iter(deps[d])))
    return None


@pytest.mark.parametrize("twin", [False, True])
def test_parse_guessed_ids_match_a_reference(guest, twin):
    lib = guest.ctx._library
    rpc = rpc_tensor_dtype(lib.g.limits)
    S = lib.g.limits.max_src
    kernel = CK.parse_graph_kernel.py_func if twin else None
    rng = np.random.default_rng(29)
    seen = {"valid": 0, "invalid": 0}
    for _ in range(150 if twin else 1500):
        n = int(rng.integers(0, 30))
        clean = rng.random() < 0.7
        pool = rng.integers(1, 1 << 63, size=40, dtype=np.int64)
        ids = pool[rng.integers(0, 40, size=n)] if rng.random() < 0.05 else rng.permutation(pool)[:n]
        if rng.random() < 0.5:
            ids = ids | np.int64(-(1 << 63))  # ids at or past 2**63
        recs = np.zeros(n, rpc)
        recs["id"] = ids.view(np.uint64)
        recs["name"] = b"\0"
        idl = recs["id"].tolist()
        for k in range(n):
            for s in range(S):
                r = rng.random()
                if r < 0.3 and k:
                    recs["src"][k, s] = idl[k - 1]  # the guess
                elif r < 0.45 and k:
                    recs["src"][k, s] = idl[int(rng.integers(k))]
                elif r < 0.452 and not clean:
                    recs["src"][k, s] = idl[int(rng.integers(n))]  # later: the search orders them
                elif r < 0.462 and not clean:
                    recs["src"][k, s] = int(rng.integers(1, 1 << 62))
            if rng.random() < 0.2 and k:
                recs["view_src"][k] = idl[int(rng.integers(k))]
        nodes = []
        for _ in range(int(rng.integers(0, n + 2))):
            r = rng.random()
            if r < 0.5 and n:
                after = idl.index(nodes[-1]) + 1 if nodes and nodes[-1] in idl else 0
                nodes.append(idl[min(n - 1, after)])  # the guess
            elif r < 0.995 and n:
                nodes.append(idl[int(rng.integers(n))])
            elif not clean:
                nodes.append(int(rng.integers(0, 1 << 62)))
        raw = struct.pack("<I", len(nodes)) + np.array(nodes, np.uint64).tobytes() + struct.pack("<I", n)
        raw += recs.tobytes()
        want = _reference(nodes, recs, S)
        try:
            p = _parse(lib, raw, kernel=kernel)
        except GraphError as exc:
            assert want is not None, exc
            seen["invalid"] += 1
            continue
        assert want is None, want
        seen["valid"] += 1
        pos = {t: k for k, t in enumerate(idl)}
        assert [idl[k] for k in p.node_index] == nodes
        want_src = [[pos[int(v)] if v else -1 for v in row] for row in recs["src"]]
        assert p.src_index.tolist() == want_src
        assert p.view_src_index.tolist() == [pos[int(v)] if v else -1 for v in recs["view_src"]]
    assert seen["valid"] > 10 and seen["invalid"] > 10, seen


def test_group_kernel_decides_by_exact_comparison_when_every_hash_collides(monkeypatch):
    monkeypatch.setattr(K, "_nh", lambda x, seeds, k: 0)
    monkeypatch.setattr(K, "_mix", lambda h, x, key: 0)
    rng = np.random.default_rng(31)
    mask = np.array([-1, 0, 0x0000FFFF00000000, -1, 0xFF], np.int64)
    keep = np.flatnonzero(mask)
    for trial in range(300):
        n, slots = int(rng.integers(1, 40)), int(rng.choice([1, 3, 10]))
        variants = rng.integers(-2, 2, size=(int(rng.integers(1, 4)), 5))
        words = variants[rng.integers(len(variants), size=n)].astype(np.int64)
        words[:, 1] = rng.integers(1 << 62, size=n)
        words[:, 4] ^= rng.integers(0, 1 << 40, size=n) & ~0xFF  # unmasked bits of a masked word
        src = np.full((n, slots), -1, np.int32)
        for i in range(n):
            for k in range(slots):
                r = rng.random()
                if r < 0.1:
                    src[i, k] = i
                elif r < 0.5:
                    src[i, k] = int(rng.integers(n))  # later sources too
                elif r < 0.7 and k:
                    src[i, k] = src[i, int(rng.integers(k))]
        got = np.full(n, -7, np.int32)
        groups = K.rule_group_kernel.py_func(words, keep, mask[keep], src, got, 1)
        want = groups_by_definition(words, mask, src)
        assert np.array_equal(got, want), (trial, got, want)
        assert groups == len(np.unique(want))


@pytest.mark.parametrize("order", ["c", "reversed"])
def test_written_tensors_are_the_ones_ggml_new_tensor_made(guest, ggml, order, monkeypatch):
    lib, g = guest.ctx._library, ggml
    s = GgmlScratch(g, 64)
    f32 = g.types["F32"]
    a, b = (g.ggml_new_tensor_2d(s.ctx, f32, 8, 4) for _ in range(2))
    g.ggml_set_name(a, b"x" * 63)
    g.ggml_set_name(b, b"")
    c = g.ggml_add(s.ctx, g.ggml_view_2d(s.ctx, a, 4, 2, 32, 16), g.ggml_view_2d(s.ctx, b, 4, 2, 32, 16))
    d = g.ggml_scale(s.ctx, c, 2.5)
    g.ggml_set_output(d)
    graph = g.ggml_new_graph(s.ctx)
    for t in (d, g.ggml_mul_mat(s.ctx, a, b)):
        g.ggml_build_forward_expand(graph, t)
    remote = RemoteGraph(guest, g, s.ctx, graph)
    wire = remote.wire
    if order == "reversed":  # every source after its users: the sources-first order differs
        head = 8 + 8 * struct.unpack_from("<I", wire, 0)[0]
        wire = wire[:head] + np.frombuffer(wire, rpc_tensor_dtype(g.limits), offset=head)[::-1].tobytes()
    dt = lib.checker.tensor_dtype
    pointers = {dt.fields[f][1] + 8 * k for f in ("src", "view_src") for k in range(dt.fields[f][0].itemsize // 8)}
    made = []
    try:
        for kernel in (True, False):
            if not kernel:
                monkeypatch.setattr(hg, "_kernel_layout", lambda *a: None)
            p = _parse(lib, wire)
            scratch = Scratch(g, len(p.tensors), len(p.node_index))
            built = hg.build_graph_parts(lib, p, scratch, lib.op_enums)
            index = {int(h): i for i, h in enumerate(built.host)}
            structs = []
            for h in built.host.tolist():
                raw = bytearray(ctypes.string_at(h, dt.itemsize))
                values = [int.from_bytes(raw[o : o + 8], "little") for o in sorted(pointers)]
                links = [-1 if v == 0 else index[v] for v in values]  # (KeyError: a stray pointer)
                for o in pointers:
                    raw[o : o + 8] = bytes(8)
                structs.append((bytes(raw), links))
            made.append((scratch, structs))
        assert made[0][1] == made[1][1]
    finally:
        for scratch, _ in made:
            scratch.close()
        remote.close()
        s.close()


# --- the plain path's work under many row-id readers ------------------------------------------


def _python_lines(fn, *args):
    """(fn(*args), the lines of Python it ran in apir's modules): work counted, not timed."""
    import sys
    from pathlib import Path

    import apir

    root = str(Path(apir.__file__).parent)
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    def calls(frame, event, arg):
        return tracer if frame.f_code.co_filename.startswith(root) else None

    previous = sys.gettrace()  # (a debugger's or coverage's, put back after)
    sys.settrace(calls)
    try:
        result = fn(*args)
    finally:
        sys.settrace(previous)
    return result, count


@pytest.mark.parametrize("overwrite", [False, True])
def test_plain_first_writes_with_many_readers_is_not_quadratic(ggml, overwrite):
    """A guest's graph of many GET_ROWS nodes with their own ids tensors: the plain path's
    search for writes over row ids grows as n log n with n (comparing every ids tensor with
    every write grows as n squared: 16 times the lines for 4 times the readers), and finds
    what its definition finds, as the kernels do."""
    g = ggml
    get_rows, none = g.ops["GET_ROWS"], g.ops["NONE"]

    def case(n):
        ops = np.full(2 * n, none, np.int64)
        ops[n:] = get_rows
        src = np.full((2 * n, g.limits.max_src), -1, np.int32)
        src[n:, 0] = 2 * n - 1  # (a table: any tensor)
        src[n:, 1] = np.arange(n)
        offsets = np.arange(2 * n, dtype=np.int64) * 64  # ids, then results, 64 bytes apart
        extents = np.full(2 * n, 64, np.int64)
        want = np.full(n, -1, np.int64)
        if overwrite:  # every 7th node writes over the ids of the reader 3 places on
            for p in range(0, n - 3, 7):
                offsets[n + p], extents[n + p] = offsets[p + 3] + 8, 16
            want[3 : n : 7][: len(range(0, n - 3, 7))] = np.arange(0, n - 3, 7)
        recs = hg._Records([], [], np.zeros(2 * n, np.int64), offsets, extents, ops)
        args = (g, np.arange(n, 2 * n, dtype=np.int64), ops, src, np.zeros(2 * n, np.int64), recs)
        return args + (np.arange(n, dtype=np.int64),), want

    lines = []
    for n in (500, 2000):
        args, want = case(n)
        got, count = _python_lines(hg._first_writes_plain, *args)
        assert np.array_equal(got, want)
        if accel.enabled():  # (the kernels' answer on the same graph)
            assert np.array_equal(hg._first_writes(*args), want)
        lines.append(count)
    assert lines[1] < 6 * lines[0], lines


@pytest.mark.skipif(not accel.enabled(), reason="the host's kernels are off (APIR_ACCEL=0 or no Numba)")
@pytest.mark.parametrize("direct_pairs", [0, 1 << 30], ids=["sweep", "pairs"])
def test_plain_first_writes_match_the_kernels(ggml, direct_pairs, monkeypatch):
    """_first_writes_plain and _first_writes on the same random graphs: nodes of ops that
    write (ADD, GET_ROWS), that write nothing (VIEW, RESHAPE) and that update their sources
    in place (OPT_STEP_*), sources anywhere, tensors in three memories at short offsets,
    empty ranges among them."""
    g = ggml
    monkeypatch.setattr(hg, "_DIRECT_PAIRS", direct_pairs)
    steps = [o for o in ("OPT_STEP_ADAMW", "OPT_STEP_SGD") if o in g.ops]
    names = ["ADD", "GET_ROWS", "VIEW", "RESHAPE", "NONE"] + steps
    op_set = np.array([g.ops[o] for o in names], np.int32)
    rng = np.random.default_rng(41)
    for trial in range(300):
        n = int(rng.integers(1, 60))
        ops = rng.choice(op_set, n).astype(np.int64)
        src = rng.integers(-1, n, (n, g.limits.max_src)).astype(np.int32)
        src[rng.random((n, g.limits.max_src)) < 0.6] = -1
        nodes = rng.permutation(n)[: int(rng.integers(0, n + 1))].astype(np.int64)
        offsets = rng.integers(0, 64, n).astype(np.int64)
        extents = (rng.integers(0, 12, n) * (rng.random(n) < 0.85)).astype(np.int64)
        recs = hg._Records([], [], np.zeros(n, np.int64), offsets, extents, ops)
        buf = rng.integers(0, 3, n).astype(np.int64)
        q_t = np.sort(rng.permutation(n)[: int(rng.integers(1, n + 1))]).astype(np.int64)
        args = (g, nodes, ops, src, buf, recs, q_t)
        assert np.array_equal(hg._first_writes_plain(*args), hg._first_writes(*args)), trial
