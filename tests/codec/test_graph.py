"""apir.codec.graph against the C guest's apir_serialize_graph / apir_serialize_tensor, and
the host's validating parse on good, broken and random input: each test on the plain path and
on the Numba twin (tests/codec/test_graph_accel.py compares the two on the same inputs)."""

import ctypes
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apir import accel
from apir.codec.graph import BufferTable, GraphError, parse_graph, rpc_tensor_from_ggml, serialize_graph
from apir.codec.records import rpc_tensor_dtype
from apir.ggml import InitParams
from apir.ggml.layout import tensor_record
from tests.codec.graphs import LONG_NAME, build_graph
from tests.codec.masks import graph_garbage, record_garbage


@pytest.fixture(params=["plain", "accel"], autouse=True)
def path(request, monkeypatch):
    """Runs the test on the plain path, then on the Numba twin (where apir.accel is on)."""
    if request.param == "plain":
        monkeypatch.setattr(accel, "enabled", lambda: False)
    elif not accel.enabled():
        pytest.skip("apir.accel is off: the plain path only")
    return request.param


def c_serialize(ref, cgraph) -> bytes:
    need = ref.ref_serialize_graph(cgraph, None, 0)
    out = ctypes.create_string_buffer(need)
    assert ref.ref_serialize_graph(cgraph, out, need) == need
    return out.raw


def assert_same_as_c(ours: np.ndarray, theirs: bytes, dtype):
    assert len(ours) == len(theirs)
    defined = ~graph_garbage(theirs, dtype)
    c = np.frombuffer(theirs, dtype=np.uint8)
    bad = np.nonzero((ours != c) & defined)[0]
    assert bad.size == 0, f"{bad.size} bytes differ from the C, first at {bad[:8]}"


@pytest.fixture(scope="module")
def rpc(ggml):
    return rpc_tensor_dtype(ggml.limits)


@pytest.fixture(scope="module")
def type_valid(ggml):
    valid = ggml.valid_types
    assert valid[ggml.types["F32"]] and valid[ggml.types["Q4_0"]] and not valid[4]  # 4, 5: removed Q4_2/Q4_3
    return valid


@pytest.fixture(scope="module")
def graphs(ggml, codec_ref):
    built = {
        "layers15": build_graph(ggml, 15, codec_ref.ref_new_buffer),
        "layers1": build_graph(ggml, 1, codec_ref.ref_new_buffer, n_buffers=1),
        # one node whose ancestors far outnumber it: the serializer's work arrays must grow
        "one_node": build_graph(ggml, 12, codec_ref.ref_new_buffer, only_last_node=True),
    }
    yield built
    for b in built.values():
        b.free(ggml)


@pytest.mark.parametrize("name", ["layers15", "layers1", "one_node"])
def test_serialize_graph_matches_c(ggml, codec_ref, graphs, rpc, name):
    bg = graphs[name]
    ours = serialize_graph(ggml, bg.cgraph, bg.buffers)
    assert_same_as_c(ours, c_serialize(codec_ref, bg.cgraph), rpc)


def test_serialized_graph_content(ggml, graphs, rpc):
    bg = graphs["layers15"]
    out = serialize_graph(ggml, bg.cgraph, bg.buffers)
    n_nodes = ggml.ggml_graph_n_nodes(bg.cgraph)
    assert n_nodes > 300
    assert struct.unpack_from("<I", out, 0)[0] == n_nodes
    nodes = (ctypes.c_uint64 * n_nodes).from_address(ggml.ggml_graph_nodes(bg.cgraph))
    assert list(np.frombuffer(out, "<u8", n_nodes, 4)) == list(nodes)
    n_tensors = struct.unpack_from("<I", out, 4 + 8 * n_nodes)[0]
    recs = np.frombuffer(out, rpc, n_tensors, 8 + 8 * n_nodes)
    # every tensor of the context is reachable from the output, so all of them are there once
    assert sorted(recs["id"]) == sorted(bg.tensors)
    # ours zeroes what the C leaves undefined
    assert not out[8 + 8 * n_nodes:].reshape(n_tensors, -1)[:, 12:16].any()
    names = {bytes(r["name"]).split(b"\0")[0] for r in recs}
    assert (LONG_NAME % 0)[:63] in names


def test_rpc_tensor_from_ggml_matches_c(ggml, codec_ref, graphs, rpc):
    bg = graphs["layers1"]
    for t in bg.tensors:
        ours = rpc_tensor_from_ggml(ggml, t, bg.buffers)
        theirs = ctypes.create_string_buffer(rpc.itemsize)
        assert codec_ref.ref_serialize_tensor(t, theirs) == rpc.itemsize
        raw = theirs.raw
        defined = ~record_garbage(raw, rpc)
        mine = np.frombuffer(ours.tobytes(), np.uint8)
        assert (mine[defined] == np.frombuffer(raw, np.uint8)[defined]).all()
        rec = tensor_record(t, ggml.tensor_dtype)
        if rec["data"]:
            handle, base = bg.buffers.lookup(int(rec["buffer"]))
            assert ours["buffer"] == handle and ours["data"] == rec["data"] - base


@pytest.fixture
def small_ctx(ggml):
    ctx = ggml.ggml_init(InitParams(64 * ggml.ggml_tensor_overhead() + 4 * ggml.ggml_graph_overhead(), None, True))
    yield ctx
    ggml.ggml_free(ctx)


def one_node_graph(ggml, ctx, t):
    cgraph = ggml.ggml_new_graph(ctx)
    ggml.ggml_build_forward_expand(cgraph, t)
    return cgraph


def test_serialize_rejects_ne_beyond_u32(ggml, small_ctx):
    a = ggml.ggml_new_tensor_1d(small_ctx, ggml.types["I8"], 1 << 33)
    ggml.ggml_set_name(a, b"huge")
    with pytest.raises(ValueError, match=r"'huge'.*ne\[0\] = 8589934592"):
        serialize_graph(ggml, one_node_graph(ggml, small_ctx, ggml.ggml_relu(small_ctx, a)), BufferTable())


def test_serialize_rejects_nb_beyond_u32(ggml, small_ctx):
    a = ggml.ggml_new_tensor_2d(small_ctx, ggml.types["F32"], 1 << 30, 2)
    with pytest.raises(ValueError, match=r"nb\[1\] = 4294967296"):
        serialize_graph(ggml, one_node_graph(ggml, small_ctx, ggml.ggml_relu(small_ctx, a)), BufferTable())


def test_serialize_rejects_data_without_buffer(ggml, small_ctx):
    a = ggml.ggml_new_tensor_1d(small_ctx, ggml.types["F32"], 4)
    tensor_record(a, ggml.tensor_dtype)["data"] = 0x1000
    with pytest.raises(ValueError, match="has data 0x1000 but no buffer"):
        serialize_graph(ggml, one_node_graph(ggml, small_ctx, ggml.ggml_relu(small_ctx, a)), BufferTable())


def test_serialize_rejects_unregistered_buffer(ggml, small_ctx):
    a = ggml.ggml_new_tensor_1d(small_ctx, ggml.types["F32"], 4)
    tensor_record(a, ggml.tensor_dtype)["buffer"] = 0xBEEF0
    table = BufferTable()
    table.register(0xBEEF8, 1, 0x10)
    with pytest.raises(ValueError, match="buffer 0xbeef0 is not a registered"):
        serialize_graph(ggml, one_node_graph(ggml, small_ctx, ggml.ggml_relu(small_ctx, a)), table)
    table.register(0xBEEF0, 0xAA, 0x100)
    out = serialize_graph(ggml, one_node_graph(ggml, small_ctx, ggml.ggml_relu(small_ctx, a)), table)
    assert len(out) == 8 + 8 + 2 * 304
    assert table.unregister(0xBEEF0) and not table.unregister(0xBEEF0)


def assert_defined_and_same_as_c(ours: np.ndarray, theirs: bytes, dtype):
    """The C's defined bytes, and zeros wherever the C leaves garbage (holes, padding, the
    name after its NUL): ours is then fully determined."""
    assert_same_as_c(ours, theirs, dtype)
    assert not ours[graph_garbage(theirs, dtype)].any()


@pytest.fixture
def edge_ctx(ggml):
    ctx = ggml.ggml_init(InitParams(512 * ggml.ggml_tensor_overhead() + 4 * ggml.ggml_graph_overhead(), None, True))
    yield ctx
    ggml.ggml_free(ctx)


def test_serialize_empty_graph(ggml, codec_ref, edge_ctx, rpc):
    cgraph = ggml.ggml_new_graph(edge_ctx)
    assert ggml.ggml_graph_n_nodes(cgraph) == 0
    ours = serialize_graph(ggml, cgraph, BufferTable())
    assert ours.tobytes() == b"\0" * 8 == c_serialize(codec_ref, cgraph)


@pytest.mark.parametrize("n_tensors", [1, 63, 64, 65, 128, 200])
def test_serialize_chain_matches_c(ggml, codec_ref, edge_ctx, rpc, n_tensors):
    """A chain of n tensors, one node: record counts around the kernel's batch of 64."""
    t = ggml.ggml_new_tensor_1d(edge_ctx, ggml.types["F32"], 4)
    for i in range(n_tensors - 1):
        t = ggml.ggml_scale(edge_ctx, t, 0.5 + i)
        ggml.ggml_set_name(t, b"chain.%d" % i)
    cgraph = ggml.ggml_new_graph_custom(edge_ctx, 256, False)
    ggml.ggml_graph_add_node(cgraph, t)
    ours = serialize_graph(ggml, cgraph, BufferTable())
    assert len(ours) == 8 + 8 + rpc.itemsize * n_tensors
    assert_defined_and_same_as_c(ours, c_serialize(codec_ref, cgraph), rpc)


def test_serialize_max_srcs_and_views_match_c(ggml, codec_ref, edge_ctx, rpc):
    """A node using every src slot (one repeated), a view reached only through view_src (its
    src[0] cleared), and a view of a view (view_src is the root, src[0] the first view)."""
    f32 = ggml.types["F32"]
    max_src = ggml.limits.max_src
    leafs = [ggml.ggml_new_tensor_1d(edge_ctx, f32, 16) for _ in range(max_src + 1)]
    for i, leaf in enumerate(leafs):
        ggml.ggml_set_name(leaf, b"leaf.%d" % i)
    hidden = ggml.ggml_view_1d(edge_ctx, leafs[-1], 8, 16)  # view_src = src[0] = the last leaf
    tensor_record(hidden, ggml.tensor_dtype)["src"][0] = 0
    view_of_view = ggml.ggml_view_1d(edge_ctx, hidden, 4, 8)
    rec = tensor_record(view_of_view, ggml.tensor_dtype)
    assert rec["view_src"] == leafs[-1] and rec["src"][0] == hidden and rec["view_offs"] == 24
    node = ggml.ggml_scale(edge_ctx, leafs[0], 2.0)
    srcs = leafs[: max_src - 2] + [leafs[1], hidden]  # every slot filled, src[max_src - 2] repeats
    tensor_record(node, ggml.tensor_dtype)["src"] = srcs
    cgraph = ggml.ggml_new_graph(edge_ctx)
    ggml.ggml_graph_add_node(cgraph, node)
    ggml.ggml_graph_add_node(cgraph, view_of_view)
    ours = serialize_graph(ggml, cgraph, BufferTable())
    assert_defined_and_same_as_c(ours, c_serialize(codec_ref, cgraph), rpc)
    recs = np.frombuffer(ours, rpc, offset=8 + 16)
    ids = [int(i) for i in recs["id"]]
    # post-order: the srcs in slot order, the hidden view after its view_src, then the node
    want = leafs[: max_src - 2] + [leafs[-1], hidden, node, view_of_view]
    assert ids == want
    assert list(recs[ids.index(node)]["src"]) == srcs


def test_serialize_error_in_a_late_tensor(ggml, graphs):
    """An unregistered buffer on a tensor far into the walk (past several batches of records)
    is reported for that tensor."""
    bg = graphs["layers15"]
    out = serialize_graph(ggml, bg.cgraph, bg.buffers)
    n_nodes = ggml.ggml_graph_n_nodes(bg.cgraph)
    recs = np.frombuffer(out, rpc_tensor_dtype(ggml.limits), offset=8 + 8 * n_nodes)
    late = int(recs["id"][len(recs) - 5])
    rec = tensor_record(late, ggml.tensor_dtype)
    saved = int(rec["buffer"]), int(rec["data"])
    rec["buffer"], rec["data"] = 0xBAD0, 0x10
    try:
        with pytest.raises(ValueError, match=f"tensor {late:#x}.*buffer 0xbad0 is not a registered"):
            serialize_graph(ggml, bg.cgraph, bg.buffers)
    finally:
        rec["buffer"], rec["data"] = saved


def test_serialize_into_out(ggml, graphs):
    """`out` is written when large enough (stale bytes of a larger graph in it do not leak into
    the result), a fresh array otherwise; `result.base` is the array written either way."""
    big, small = graphs["layers15"], graphs["layers1"]
    want_big = serialize_graph(ggml, big.cgraph, big.buffers).tobytes()
    want_small = serialize_graph(ggml, small.cgraph, small.buffers).tobytes()
    first = serialize_graph(ggml, big.cgraph, big.buffers, out=np.full(16, 0xAA, np.uint8))
    assert first.tobytes() == want_big and first.base is not None and len(first.base) >= len(want_big)
    scratch = first.base
    for cg, buffers, want in [(small.cgraph, small.buffers, want_small), (big.cgraph, big.buffers, want_big)]:
        got = serialize_graph(ggml, cg, buffers, out=scratch)
        assert got.base is scratch and got.tobytes() == want
    with pytest.raises(ValueError, match="out must be"):
        serialize_graph(ggml, small.cgraph, small.buffers, out=np.zeros(len(scratch) // 4, np.int32))


def test_buffer_table():
    table = BufferTable()
    for ptr in (0x30, 0x10, 0x20):
        table.register(ptr, ptr * 2, ptr * 3)
    table.register(0x20, 2**64 - 1, 0x99)  # replaces; handles are u64
    ptrs, handles, bases = table.arrays()
    assert list(ptrs) == [0x10, 0x20, 0x30]
    assert list(handles.view(np.uint64)) == [0x20, 2**64 - 1, 0x60]
    assert list(bases) == [0x30, 0x99, 0x90]
    assert table.lookup(0x20) == (2**64 - 1, 0x99) and table.lookup(0x40) is None
    assert len(table) == 3 and 0x30 in table
    with pytest.raises(ValueError):
        table.register(0, 1, 2)


# --- parse (host) ------------------------------------------------------------------------------

def parse(data, ggml, type_valid, **kw):
    return parse_graph(data, op_count=ggml.op_count, type_valid=type_valid, limits=ggml.limits, **kw)


def check_parsed(p, raw: bytes, rpc):
    """Independent check of a ParsedGraph against the bytes it came from."""
    n_nodes = int.from_bytes(raw[:4], "little")
    assert p.n_nodes == n_nodes
    assert list(p.node_ids) == list(np.frombuffer(raw, "<u8", n_nodes, 4))
    recs = np.frombuffer(raw, rpc, p.n_tensors, 8 + 8 * n_nodes)
    assert p.tensors.tobytes() == recs.tobytes()
    ids = [int(i) for i in recs["id"]]
    pos = {tid: k for k, tid in enumerate(ids)}
    assert len(pos) == len(ids) and 0 not in pos
    assert [ids[k] for k in p.node_index] == list(p.node_ids)
    for k in range(p.n_tensors):
        for s, sid in enumerate(recs[k]["src"]):
            assert p.src_index[k, s] == (pos[int(sid)] if sid else -1)
        vid = int(recs[k]["view_src"])
        assert p.view_src_index[k] == (pos[vid] if vid else -1)
    assert sorted(p.order) == list(range(p.n_tensors))
    done = set()
    for k in p.order:
        deps = [d for d in list(p.src_index[k]) + [p.view_src_index[k]] if d >= 0]
        assert all(d in done for d in deps)
        done.add(int(k))


def test_parse_serialized_graph(ggml, graphs, rpc, type_valid):
    bg = graphs["layers15"]
    raw = serialize_graph(ggml, bg.cgraph, bg.buffers).tobytes()
    shared = bytearray(b"\xee" * 16 + raw + b"\xff" * 8)  # a window inside a larger buffer
    p = parse(shared, ggml, type_valid, start=16, end=16 + len(raw))
    assert p.size == len(raw)
    check_parsed(p, raw, rpc)
    # the C's own order is already topological, and the parse keeps it
    assert list(p.order) == list(range(p.n_tensors))
    shared[16:] = b"\0" * (len(shared) - 16)  # the guest scribbles afterwards: our copy is unaffected
    check_parsed(p, raw, rpc)


@pytest.mark.parametrize("twin", [False, True])
def test_parse_orders_records_listed_after_their_users(ggml, graphs, rpc, type_valid, twin, path):
    """Records in reverse (every source after its users: legal, though not the C's order) get a
    sources-first `order` from the depth-first search, not the records' own order (which the
    parse takes as it is only when every source comes first); a self-source is a cycle."""
    bg = graphs["layers15"]
    raw = serialize_graph(ggml, bg.cgraph, bg.buffers).tobytes()
    n_nodes = int.from_bytes(raw[:4], "little")
    head = 8 + 8 * n_nodes
    recs = np.frombuffer(raw, rpc, offset=head)
    reordered = raw[:head] + recs[::-1].tobytes()
    kernel = None
    if twin:  # the kernel's own Python twin (`py_func`), beside the accelerated path
        if path == "plain":
            pytest.skip("the kernel's twin is tested with the accelerated path")
        from apir.codec import _kernels as K

        kernel = K.parse_graph_kernel.py_func
    p = parse(reordered, ggml, type_valid, _kernel=kernel)
    check_parsed(p, reordered, rpc)
    assert list(p.order) != list(range(p.n_tensors))
    node = np.frombuffer(bytearray(raw), rpc, offset=head).copy()
    k = int(np.flatnonzero(node["src"][:, 0])[-1])
    node["src"][k, 1] = node["id"][k]  # a tensor its own source
    with pytest.raises(GraphError, match="cycle"):
        parse(raw[:head] + node.tobytes(), ggml, type_valid, _kernel=kernel)


def mutate(raw: bytes, rpc, n_nodes, k, field, value, index=None):
    data = np.frombuffer(bytearray(raw), np.uint8)
    recs = data[8 + 8 * n_nodes:].view(rpc)
    if index is None:
        recs[k][field] = value
    else:
        recs[k][field][index] = value
    return data.tobytes()


def test_parse_errors(ggml, graphs, rpc, type_valid):
    bg = graphs["layers1"]
    raw = serialize_graph(ggml, bg.cgraph, bg.buffers).tobytes()
    n = int.from_bytes(raw[:4], "little")
    recs = np.frombuffer(raw, rpc, offset=8 + 8 * n)
    with_src = int(np.nonzero(recs["src"][:, 1])[0][0])
    with_view = int(np.nonzero(recs["view_src"])[0][0])
    removed = [t for t in range(ggml.type_count) if not type_valid[t]]
    cases = [
        (raw[:3], "no room for n_nodes"),
        (b"\xff\xff\xff\xff" + raw[4:], "n_nodes = 4294967295 needs"),
        (raw[:-1], r"n_tensors = \d+ needs"),
        (raw[: 8 + 8 * n - 4] + b"\xff\xff\xff\x7f" + raw[8 + 8 * n:], "n_tensors = 2147483647"),
        (mutate(raw, rpc, n, 2, "id", 0), "tensor 2: id is 0"),
        (mutate(raw, rpc, n, 2, "id", int(recs[5]["id"])), "appears twice"),
        (mutate(raw, rpc, n, 1, "type", ggml.type_count), f"type {ggml.type_count} is not"),
        (mutate(raw, rpc, n, 1, "op", ggml.op_count), f"op {ggml.op_count} is out of range"),
        (mutate(raw, rpc, n, 0, "name", b"x" * 64), "name is not NUL-terminated"),
        (mutate(raw, rpc, n, 0, "name", np.frombuffer(b"\x80\x01" * 32, "S1")), "name is not NUL-terminated"),
        (mutate(raw, rpc, n, with_src, "src", 0x1234, 1), r"src\[1\] = 0x1234 is not among"),
        (mutate(raw, rpc, n, with_view, "view_src", 0x4321), "view_src 0x4321 is not among"),
        (raw[:4] + (0x777).to_bytes(8, "little") + raw[12:], "node 0: id 0x777 is not among"),
        # tensor 0 takes the last tensor (which depends on everything) as a source
        (mutate(raw, rpc, n, 0, "src", int(recs[-1]["id"]), 0), "form a cycle"),
        (mutate(raw, rpc, n, 3, "src", int(recs[3]["id"]), 2), "tensor 3: its sources form a cycle"),
    ]
    if removed:
        cases.append((mutate(raw, rpc, n, 1, "type", removed[0]), f"type {removed[0]} is not"))
    for data, message in cases:
        with pytest.raises(GraphError, match=message):
            parse(data, ggml, type_valid)
    with pytest.raises(GraphError, match="outside"):
        parse(raw, ggml, type_valid, start=8, end=len(raw) + 1)
    for name in (b"\x80" * 63 + b"\0", b"\x01\x80" * 31 + b"\x01\0", b"x" * 63 + b"\0"):  # NUL last: valid
        assert parse(mutate(raw, rpc, n, 0, "name", np.frombuffer(name, "S1")), ggml, type_valid).n_tensors == len(recs)


def test_parse_empty_graph(ggml, type_valid):
    p = parse(bytes(8), ggml, type_valid)
    assert p.n_nodes == 0 and p.n_tensors == 0 and p.size == 8


@pytest.fixture(scope="module")
def small_raw(ggml, graphs):
    bg = graphs["layers1"]
    return serialize_graph(ggml, bg.cgraph, bg.buffers).tobytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_parse_mutated_never_crashes(ggml, small_raw, rpc, type_valid, data):
    raw = bytearray(small_raw)
    n_tensors = (len(raw) - 8 - 8 * int.from_bytes(raw[:4], "little")) // rpc.itemsize
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), max_size=6))
    for pos, value in edits:
        raw[pos] = value
    # re-point a src / view_src at another tensor's id: reachable cycles and aliases
    for _ in range(data.draw(st.integers(0, 2))):
        k, j = data.draw(st.integers(0, n_tensors - 1)), data.draw(st.integers(0, n_tensors - 1))
        slot = data.draw(st.sampled_from(["src0", "src3", "view_src"]))
        base = 8 + 8 * int.from_bytes(small_raw[:4], "little") + rpc.itemsize * k
        off = base + (rpc.fields["view_src"][1] if slot == "view_src" else rpc.fields["src"][1] + 8 * int(slot[3]))
        tid = small_raw[base - rpc.itemsize * k + rpc.itemsize * j:][:8]
        raw[off : off + 8] = tid
    cut = data.draw(st.integers(0, len(raw)))
    raw = bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw)
    try:
        p = parse(raw, ggml, type_valid)
    except GraphError:
        return
    check_parsed(p, raw, rpc)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=2000))
def test_parse_random_bytes(ggml, rpc, type_valid, raw):
    try:
        p = parse(raw, ggml, type_valid)
    except GraphError:
        return
    check_parsed(p, raw, rpc)
