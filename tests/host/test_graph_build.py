"""apir.host.graph.build's fast paths against its per-tensor ones.

The record checks run on whole arrays (`_check_records`) and fall back to the per-tensor
checks (`_check_records_one_by_one`) on any doubt; the host tensors are written in bulk
through one numpy view. Here both are compared with the one-by-one way on a real graph and
on thousands of lying variants of it: the array checks may only accept what the per-tensor
checks accept, with the same buffers, offsets and extents, and must leave every refusal to
them; the bulk-written tensors must equal, byte for byte, the ones `host_from_rpc` builds.
"""

import ctypes
import dataclasses

import numpy as np
import pytest

from apir import accel
from apir.codec.graph import parse_graph
from apir.ggml.cgraph import _use_count, source_uses
from apir.ggml.layout import tensor_record
from apir.host.graph import build as hg
from apir.host.errors import Refused
from apir.host.graph.chunks import GraphChunks
from apir.host.graph.shapes.base import IdReads
from apir.host.tensors import Scratch
from tests.host.hostilekit import host_tensors
from tests.host.hostkit import GgmlScratch, RemoteGraph, add_chain, needs_kernels


def _graph(g, ctx):
    """Matmul, get_rows, views (transpose, permute, view_2d, reshape), soft_max, norm."""
    f32, f16, i32 = g.types["F32"], g.types["F16"], g.types["I32"]
    w = g.ggml_new_tensor_2d(ctx, f16, 32, 24)
    x = g.ggml_new_tensor_2d(ctx, f32, 32, 6)
    emb = g.ggml_new_tensor_2d(ctx, f32, 24, 10)
    rows = g.ggml_new_tensor_1d(ctx, i32, 6)
    mask = g.ggml_new_tensor_2d(ctx, f32, 24, 6)
    for i, t in enumerate((w, x, emb, rows, mask)):
        g.ggml_set_name(t, f"in{i}".encode())
        g.ggml_set_input(t)
    y = g.ggml_add(ctx, g.ggml_mul_mat(ctx, w, x), g.ggml_get_rows(ctx, emb, rows))
    y = g.ggml_soft_max_ext(ctx, y, mask, 0.125, 0.0)
    y = g.ggml_cont(ctx, g.ggml_transpose(ctx, y))
    y = g.ggml_reshape_3d(ctx, y, 6, 4, 6)
    y = g.ggml_cont(ctx, g.ggml_permute(ctx, y, 1, 0, 2, 3))
    y = g.ggml_norm(ctx, g.ggml_view_2d(ctx, y, 4, 12, 4 * 4, 0), 1e-5)
    g.ggml_set_name(y, b"a name of exactly sixty-three characters, to test the last byte!")
    g.ggml_set_output(y)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph, rows


@pytest.fixture
def setup(guest, ggml):
    """(lib, wire bytes, a second buffer's handle) with valid row ids in the graph's buffer."""
    s = GgmlScratch(ggml)
    graph, rows = _graph(ggml, s.ctx)
    remote = RemoteGraph(guest, ggml, s.ctx, graph)
    assert guest.set_tensor(remote.handle, remote.rpc(rows), np.arange(6, dtype=np.int32).tobytes()) == 0
    other = guest.alloc(1 << 16)
    yield guest.ctx._library, remote.wire, other
    remote.close()
    s.close()


def _parse(lib, wire):
    g = lib.g
    return parse_graph(wire, limits=g.limits, op_count=g.op_count, type_valid=lib.checker.valid_types)


def _one_by_one(lib, parsed):
    try:
        return hg._check_records_one_by_one(lib, parsed)
    except Refused:
        return None


def _same(a, b):
    assert all(x is y for x, y in zip(a.bufs, b.bufs)) and len(a.bufs) == len(b.bufs)
    assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.extents, b.extents)
    assert a.ops.dtype == b.ops.dtype == np.int64 and np.array_equal(a.ops, b.ops)


@needs_kernels
def test_real_graph_takes_the_fast_path(setup):
    lib, wire, _ = setup
    parsed = _parse(lib, wire)
    fast = hg._check_records(lib, parsed)
    assert fast is not None
    _same(fast, hg._check_records_one_by_one(lib, parsed))
    assert (parsed.view_src_index >= 0).sum() >= 3  # the views are checked too


_BIG = [0, 1, 2, 3, 4, 5, 7, 8, 16, 24, 32, 64, 100, 1 << 16, (1 << 30) - 1, 1 << 31, (1 << 32) - 1]


def _lie(rng, lib, t, other):
    """One random lie in one random record of `t` (in place); returns its description."""
    def pick(values):  # values may exceed int64: no rng.choice
        return values[int(rng.integers(len(values)))]

    i = int(rng.integers(len(t)))
    field = pick(["ne", "nb", "data", "view_offs", "buffer", "type", "op", "name", "ne+nb"])
    if field in ("ne", "nb", "ne+nb"):
        for f in (("ne", "nb") if field == "ne+nb" else (field,)):
            k = int(rng.integers(4))
            old = int(t[f][i, k])
            t[f][i, k] = pick([old + 1, max(old - 1, 0), old * 2, pick(_BIG)])
    elif field == "data":
        old = int(t["data"][i])
        t["data"][i] = pick([old + 4, max(old - 4, 0), old + (1 << 16), 1 << 62, (1 << 64) - 1])
    elif field == "view_offs":
        old = int(t["view_offs"][i])
        t["view_offs"][i] = pick([old + 4, max(old - 4, 0), 1 << 62, (1 << 64) - 1])
    elif field == "buffer":
        t["buffer"][i] = pick([0, other, 12345])
    elif field == "type":
        t["type"][i] = int(rng.integers(0, 50))
    elif field == "op":
        t["op"][i] = pick([lib.g.op_count, lib.g.op_count - 1] + sorted(lib.checker.custom_ops))
    else:
        t["name"].view(np.uint8)[i] = ord("x")
    return f"tensor {i} {field}"


@needs_kernels
def test_array_checks_accept_only_what_the_per_tensor_checks_accept(setup):
    lib, wire, other = setup
    rng = np.random.default_rng(11)
    counts = {"both accept": 0, "both refuse": 0, "only per-tensor accepts": 0}
    for _ in range(3000):
        parsed = _parse(lib, wire)
        what = [_lie(rng, lib, parsed.tensors, other) for _ in range(int(rng.integers(1, 3)))]
        fast, slow = hg._check_records(lib, parsed), _one_by_one(lib, parsed)
        if fast is not None:
            assert slow is not None, what
            _same(fast, slow)
            counts["both accept"] += 1
        else:
            counts["both refuse" if slow is None else "only per-tensor accepts"] += 1
    # the lies reach both outcomes (and the one-by-one fallback for huge values)
    assert counts["both accept"] > 100 and counts["both refuse"] > 1000, counts
    assert counts["only per-tensor accepts"] > 0, counts


@needs_kernels
def test_empty_tensor_with_huge_strides_falls_back_and_is_accepted(setup):
    """ne[1] = 0 makes the extent 0 whatever the strides; the array checks' int64 bound
    declines ne[0] * nb[0] near 2**64 and leave it to the exact per-tensor arithmetic."""
    lib, wire, _ = setup
    parsed = _parse(lib, wire)
    t = parsed.tensors
    leaf = int(np.flatnonzero((t["op"] == lib.g.ops["NONE"]) & (parsed.view_src_index < 0)
                              & (t["type"] == lib.g.types["F32"]))[0])
    t["ne"][leaf] = [(1 << 32) - 1, 0, 1, 1]
    t["nb"][leaf] = [(1 << 32) - 1, 4, 4, 4]
    assert hg._check_records(lib, parsed) is None
    assert _one_by_one(lib, parsed).extents[leaf] == 0


@needs_kernels
def test_span_suspects_hold_every_tensor_over_its_buffer(setup):
    """The record kernel's span suspects (`_Records.suspects`, which _check_spans checks
    exactly) include every tensor whose exact span (`base.span_nbytes`) exceeds its buffer,
    with tensors of the real graph made empty (one dimension 0) and their other dimensions
    grown to just below, at and just above their buffer."""
    from apir.host.graph.shapes.base import span_nbytes

    lib, wire, _ = setup
    rng = np.random.default_rng(11)
    over = 0
    for trial in range(60):
        parsed = _parse(lib, wire)
        t = parsed.tensors
        recs = hg._check_records(lib, parsed)
        infos = hg.TensorInfos(lib, parsed, recs, fetch=False)
        i = int(rng.integers(len(t)))
        size, row = recs.found[recs.inverse[i]].size, int(infos[i].type_size)
        if int(infos[i].blck_size) != 1 or i in parsed.view_src_index:
            continue  # (a view's source made empty would leave its views outside it)
        k = int(rng.integers(1, 4))
        t["ne"][i] = [size // row + int(rng.integers(-1, 2)), 1, 1, 1]
        t["ne"][i, k] = 0  # empty: no extent, so the record checks pass whatever ne[0] is
        t["nb"][i] = [row, row, row, row]
        recs = hg._check_records(lib, parsed)
        assert recs is not None and recs.suspects is not None
        infos = hg.TensorInfos(lib, parsed, recs, fetch=False)
        exact = [j for j in range(len(t)) if span_nbytes(infos[j]) > recs.found[recs.inverse[j]].size]
        assert set(exact) <= set(recs.suspects), (trial, exact, recs.suspects)
        over += i in exact
    assert over >= 10  # (the just-above case came up)


def _reference_twins(lib, parsed, scratch):
    """The host tensors as built before the bulk writes: host_from_rpc, then src/view_src."""
    chk, recs = lib.checker, parsed.tensors
    bufs = hg._check_records_one_by_one(lib, parsed).bufs
    host = [0] * len(recs)
    for i in (int(x) for x in parsed.order):
        t = chk.host_from_rpc(scratch, chk.rpc_tensor(recs[i].tobytes()), bufs[i])
        rec = np.frombuffer((ctypes.c_char * chk.tensor_dtype.itemsize).from_address(t),
                            dtype=chk.tensor_dtype)[0]
        for k, j in enumerate(parsed.src_index[i]):
            if j >= 0:
                rec["src"][k] = host[j]
        v = int(parsed.view_src_index[i])
        if v >= 0:
            rec["view_src"] = host[v]
            rec["view_offs"] = int(recs[i]["view_offs"])
        host[i] = t
    return host


def _as_indices(lib, addrs, data_map=None):
    """Each tensor's struct bytes, its src/view_src pointers replaced by tensor indices (and
    data pointers found in `data_map` by their value there)."""
    dtype = lib.checker.tensor_dtype
    index = {a: i for i, a in enumerate(addrs)}
    index[0] = 1 << 63  # null
    out = []
    for a in addrs:
        raw = np.frombuffer(ctypes.string_at(a, dtype.itemsize), dtype=dtype)
        rec = np.zeros(1, dtype=dtype)  # fields only: C leaves the struct's holes undefined
        for name in dtype.names:
            rec[name] = raw[name]
        rec["src"] = [[index[int(p)] for p in rec["src"][0]]]
        rec["view_src"] = index[int(rec["view_src"][0])]
        if data_map:
            rec["data"] = data_map.get(int(rec["data"][0]), int(rec["data"][0]))
        out.append(rec.tobytes())
    return out


@pytest.mark.parametrize("bulk", [True, False, "plain"])
def test_host_tensors_equal_the_one_by_one_twins(setup, monkeypatch, bulk):
    lib, wire, _ = setup
    if not bulk:  # the tensor-by-tensor writes taken when ggml's layout is not the kernel's
        monkeypatch.setattr(hg, "_kernel_layout", lambda tensor, rpc, max_src: None)
    if bulk == "plain":  # the same writes, on the plain path
        monkeypatch.setattr(accel, "enabled", lambda: False)
    parsed = _parse(lib, wire)
    n = len(parsed.tensors)
    # what a twin must not take over: view_offs of a tensor that is no view, bytes after a
    # name's NUL
    parsed.tensors["view_offs"][parsed.view_src_index < 0] = 4
    names = parsed.tensors["name"].view(np.uint8)
    names[(names[:, :-2] == 0).any(axis=1), -2] = ord("x")
    with Scratch(lib.g, n, n) as ref, Scratch(lib.g, n, n) as new:
        ref_host = _reference_twins(lib, parsed, ref)
        expect = _as_indices(lib, ref_host)
        graph = hg.build_graph_parts(lib, parsed, new, lib.op_enums).graph
        nodes = [int(lib.g.ggml_graph_node(graph, k)) for k in range(lib.g.ggml_graph_n_nodes(graph))]
        host = [0] * n
        for k, j in enumerate(parsed.node_index.tolist()):
            host[j] = nodes[k]
        # leaves and views are not nodes: reach them through the nodes' src and view_src
        dtype = lib.checker.tensor_dtype
        for i in reversed(parsed.order.tolist()):
            rec = np.frombuffer(ctypes.string_at(host[i], dtype.itemsize), dtype=dtype)[0]
            for k, j in enumerate(parsed.src_index[i].tolist()):
                if j >= 0:
                    host[j] = int(rec["src"][k])
            v = int(parsed.view_src_index[i])
            if v >= 0:
                host[v] = int(rec["view_src"])
        assert all(host) and len(nodes) == len(parsed.node_index)
        # each node's use count: the source slots naming it (on the bulk path counted by
        # write_tensors_kernel), one more for an ids writer
        assert lib.use_counts
        want = source_uses(parsed.src_index, n)
        want[hg.ids_writer_nodes(lib.g, parsed.node_index, parsed.tensors["op"].astype(np.int64))] += 1
        assert [_use_count(graph, a) for a in nodes] == want[parsed.node_index].tolist()
        # row ids are read from the copy their rule checked (TensorInfo.snapshot): the same
        # bytes at another address; everything else as the one-by-one twins
        pinned = {ctypes.addressof(s): ctypes.sizeof(s) for s in new.pinned}
        data_map = {}
        for i, a in enumerate(host):
            d = int(np.frombuffer(ctypes.string_at(a, dtype.itemsize), dtype=dtype)[0]["data"])
            if d in pinned:
                ref_d = int(np.frombuffer(ctypes.string_at(ref_host[i], dtype.itemsize), dtype=dtype)[0]["data"])
                assert ctypes.string_at(d, pinned[d]) == ctypes.string_at(ref_d, pinned[d])
                data_map[d] = ref_d
        assert data_map  # the graph's GET_ROWS ids
        assert _as_indices(lib, host, data_map) == expect
    assert b"a name of exactly sixty-three characters, to test the last byte" in b"".join(expect)


def test_infos_equal_tensor_info(setup):
    """TensorInfos' items are `tensor_info`'s, field by field, with `room` its bytes to the
    end of its buffer and `id_reads` one IdReads for the whole graph, its room the bytes
    of its buffers (each once); made once, on first use, and listed by made()."""
    lib, wire, _ = setup
    parsed = _parse(lib, wire)
    recs = hg._check_records_one_by_one(lib, parsed)
    got = hg.TensorInfos(lib, parsed, recs, fetch=False)
    assert len(got) == len(parsed.tensors) and got.made() == []
    for i in reversed(range(len(got))):
        b, o = recs.bufs[i], int(recs.offsets[i])
        want = hg.tensor_info(lib, i, parsed.tensors[i], b.base + o)
        want.room = b.size - o
        want.id_reads = IdReads(sum({id(buf): buf.size for buf in recs.bufs}.values()))
        info = got[i]
        assert info.id_reads is got[0].id_reads
        assert got[i] is info
        for f in dataclasses.fields(want):
            a, w = getattr(info, f.name), getattr(want, f.name)
            if isinstance(w, np.ndarray):
                assert a.dtype == w.dtype and np.array_equal(a, w), (i, f.name)
            else:
                assert a == w and type(a) is type(w), (i, f.name, a, w)
    assert [info.index for info in got.made()] == list(range(len(got)))
    with pytest.raises(IndexError):
        got[len(got)]


@needs_kernels
def test_record_kernels_twins_agree(setup, monkeypatch):
    """The jitted record checks and their plain-Python twins (`.py_func`) decide alike and
    fill the same arrays, on the real graph and on lying variants of it."""
    from apir.host.graph import kernels as K

    lib, wire, other = setup
    rng = np.random.default_rng(3)
    for trial in range(40):
        parsed = _parse(lib, wire)
        if trial:
            _lie(rng, lib, parsed.tensors, other)
        results = []
        for twin in (False, True):
            calls = []
            for name in ("record_fields_kernel", "record_bounds_kernel"):
                kernel = getattr(K, name)

                def run(*args, _kernel=kernel, _name=name):
                    ret = (_kernel.py_func if twin else _kernel)(*args)
                    arrays = [a.copy() for a in args if isinstance(a, np.ndarray)]
                    if ret >= 0:  # the handles found / the suspects (the rest: unwritten)
                        arrays[-1] = arrays[-1][:ret]
                    calls.append((ret, arrays))
                    return ret

                monkeypatch.setattr(hg, name, run)
            got = hg._check_records(lib, parsed)
            results.append((got is None, calls))
        (none_a, calls_a), (none_b, calls_b) = results
        assert none_a == none_b and len(calls_a) == len(calls_b)
        for (ret_a, arrays_a), (ret_b, arrays_b) in zip(calls_a, calls_b):
            assert ret_a == ret_b
            if ret_a >= 0:
                assert all(np.array_equal(x, y) for x, y in zip(arrays_a, arrays_b))


@pytest.mark.parametrize("bulk", [True, False, "plain"])
def test_graph_scratch_counts_each_tensor_once(setup, monkeypatch, bulk):
    """graph_scratch's context has room for the tensors only where they are made there (the
    ggml_new_tensor path); else they live in its tensor block, and `size` (the graph cache's
    budget) counts each once: the cgraph's room, one header of slack, the block."""
    from apir.host.backend.dispatch_backend import prepare_graph

    lib, wire, _ = setup
    if not bulk:
        monkeypatch.setattr(hg, "_kernel_layout", lambda tensor, rpc, max_src: None)
    if bulk == "plain":
        monkeypatch.setattr(accel, "enabled", lambda: False)
        bulk = False
    elif bulk and not accel.enabled():
        pytest.skip("the tensor block is the kernels'")
    g = lib.g
    parsed = _parse(lib, wire)
    n, nodes = len(parsed.tensors), len(parsed.node_index)
    entry = prepare_graph(lib, parsed, None)
    try:
        graph = g.ggml_graph_overhead_custom(nodes, False) + g.ggml_tensor_overhead() + 1024
        if bulk:
            assert entry.scratch.size == graph + n * lib.checker.tensor_dtype.itemsize + 64
        else:
            assert entry.scratch.size == graph + n * g.ggml_tensor_overhead()
    finally:
        entry.close()


# --- a large graph's build ---------------------------------------------------------------------


@pytest.fixture
def chain(guest, ggml):
    """(lib, wire) of a graph of 2,101 tensors (2,100 ADD nodes)."""
    s = GgmlScratch(ggml, 3000)  # (room for the tensors, and for a cgraph of 4,096 nodes)
    remote = RemoteGraph(guest, ggml, s.ctx, add_chain(ggml, s.ctx, 2100, 4096))
    yield guest.ctx._library, remote.wire
    remote.close()
    s.close()


def _made(lib, parsed):
    """The host tensors build_graph_parts makes of `parsed` (hostilekit.host_tensors)."""
    with Scratch(lib.g, len(parsed.tensors), max(len(parsed.node_index), 1)) as scratch:
        built = hg.build_graph_parts(lib, parsed, scratch, lib.op_enums)
        return host_tensors(lib.checker.tensor_dtype, built.host)


def test_a_large_graph_is_built_alike_on_either_path(chain, monkeypatch):
    lib, wire = chain
    fast = _made(lib, _parse(lib, wire))
    monkeypatch.setattr(accel, "enabled", lambda: False)
    plain = _made(lib, _parse(lib, wire))
    assert fast == plain
    assert len(plain) == 2101 and plain[-1][4][:2] == (2099, 0)  # the last ADD: the one before, and x


@pytest.mark.parametrize("where", ["_check_records", "_create_tensors"])
def test_an_error_of_a_build_step_is_raised_to_the_caller(chain, where, monkeypatch):
    lib, wire = chain
    if where == "_check_records" and not accel.enabled():
        pytest.skip("the array record checks run only with the kernels")

    def fail(*args):
        raise MemoryError(f"no room in {where}")

    monkeypatch.setattr(hg, where, fail)
    parsed = _parse(lib, wire)
    with Scratch(lib.g, len(parsed.tensors), len(parsed.node_index)) as scratch:
        with pytest.raises(MemoryError, match=where):
            hg.build_graph_parts(lib, parsed, scratch, lib.op_enums)
    monkeypatch.undo()
    assert len(_made(lib, _parse(lib, wire))) == 2101  # the next build is whole


def test_a_record_is_refused_before_any_node(chain, host_path):
    """The rules see the record checks' answer: a record refused before any node, on either
    path."""
    lib, wire = chain
    parsed = _parse(lib, wire)
    parsed.tensors["data"][5] = np.iinfo(np.uint64).max - 3  # tensor 5's data far past its buffer
    parsed.tensors["ne"][len(parsed.tensors) - 1, 0] = 7  # and a node refused by its rule
    with Scratch(lib.g, len(parsed.tensors), len(parsed.node_index)) as scratch:
        with pytest.raises(Refused, match="graph tensor 5"):
            hg.build_graph_parts(lib, parsed, scratch, lib.op_enums)


def _uses_graph(g, ctx):
    """Source slots that name one tensor twice (ADD(a, a), MUL(v, v), ADD(y, y)), a view
    read as a source and as a view's source, and an ids writer (ARGSORT) whose view GET_ROWS
    reads; built by ggml (its use counts filled)."""
    f32 = g.types["F32"]
    a = g.ggml_new_tensor_2d(ctx, f32, 8, 6)
    x = g.ggml_new_tensor_1d(ctx, f32, 6)
    for i, t in enumerate((a, x)):
        g.ggml_set_name(t, f"in{i}".encode())
        g.ggml_set_input(t)
    ids = g.ggml_view_1d(ctx, g.ggml_argsort(ctx, x, 0), 3, 0)  # ids in [0, 6): a's rows
    d = g.ggml_add(ctx, a, a)
    v = g.ggml_view_2d(ctx, d, 8, 3, 8 * 4, 0)
    y = g.ggml_add(ctx, g.ggml_mul(ctx, v, v), g.ggml_get_rows(ctx, d, ids))
    out = g.ggml_add(ctx, y, y)
    g.ggml_set_output(out)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, out)
    return graph


@pytest.mark.parametrize("way", ["kernels", "kernels, exact record checks", "kernels, one by one", "plain"])
@pytest.mark.parametrize("wire_counts", [False, True], ids=["own", "guest"])
def test_use_counts_are_ggmls_on_every_build_path(guest, ggml, monkeypatch, way, wire_counts):
    """The built graph's use counts on each path (source slots counted by write_tensors_kernel
    or by source_uses, the records' ops from the array or the per-tensor checks): each node's
    ggml count of the guest's graph, one more for the ids writer; under USE_COUNTS the
    guest's counts (hostile: negative, huge) raise them, capped, never lower them; the
    graph's ranges (apir.host.graph.chunks) read the same."""
    from apir.codec.constants import APIR_WIRE_USE_COUNT_MAX

    g = ggml
    if way != "plain" and not accel.enabled():
        pytest.skip("the kernels are off in this process (APIR_ACCEL=0 or no Numba)")
    if way == "plain":
        monkeypatch.setattr(accel, "enabled", lambda: False)
    elif way == "kernels, exact record checks":  # (as on a record the kernels leave)
        monkeypatch.setattr(hg, "_check_records", lambda lib, parsed: None)
    elif way == "kernels, one by one":  # (a ggml layout write_tensors_kernel does not write)
        monkeypatch.setattr(hg, "_kernel_layout", lambda tensor, rpc, max_src: None)
    s = GgmlScratch(g)
    remote = None
    try:
        gf = _uses_graph(g, s.ctx)
        n_nodes = g.ggml_graph_n_nodes(gf)
        local = [g.ggml_graph_node(gf, k) for k in range(n_nodes)]
        own = np.array([_use_count(gf, t) for t in local])
        ops = [g.op_names[int(tensor_record(t, g.tensor_dtype)["op"])] for t in local]
        assert own.tolist() == [2, 2, 1, 1, 1, 1, 2, 0] and ops.count("ARGSORT") == 1
        want = own + [op == "ARGSORT" for op in ops]
        remote = RemoteGraph(guest, g, s.ctx, gf)
        lib = guest.ctx._library
        assert lib.use_counts
        monkeypatch.setattr(lib, "wire_use_counts", wire_counts)
        parsed = _parse(lib, remote.wire)
        nodes = parsed.node_index.astype(np.int64)
        # hostile counts in the padding: below the graph's own (the ids writer's: its uses,
        # not its pin), above it, above the cap, int32's ends
        guest_counts = np.array([-(2**31), 0, 1, 1, 2**31 - 1, -1, 3, 1 << 20], np.int32)
        parsed.tensors["padding"].view("<i4").reshape(len(parsed.tensors))[nodes] = guest_counts
        if wire_counts:
            want = np.maximum(want, np.minimum(guest_counts.astype(np.int64), APIR_WIRE_USE_COUNT_MAX))
        with hg.graph_scratch(lib, parsed) as scratch:
            built = hg.build_graph_parts(lib, parsed, scratch, lib.op_enums)
            got = [_use_count(built.graph, g.ggml_graph_node(built.graph, k)) for k in range(n_nodes)]
            # ranges of 3 nodes (a backend without an abort callback) read the same counts
            chunks = GraphChunks(g, built.graph, 3)
            try:
                ranges = [(c, k) for c in chunks.graphs for k in range(g.ggml_graph_n_nodes(c))]
                in_ranges = [_use_count(c, g.ggml_graph_node(c, k)) for c, k in ranges]
            finally:
                chunks.close()
        assert got == want.tolist() and in_ranges == got
    finally:
        if remote is not None:
            remote.close()
        s.close()
