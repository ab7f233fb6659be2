"""apir.codec.graph_accel against the plain path (apir.codec.graph's *_plain functions) on the
same inputs: the same bytes from serialize, the same ParsedGraph arrays from parse, the same
error message wherever one of them refuses, on good, hostile and random input (the fuzzer's
reproducers and mutants of them included)."""

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apir import accel
from apir.codec.graph import (
    BufferTable,
    parse_graph,
    parse_graph_plain,
    rpc_tensor_from_ggml,
    rpc_tensor_from_ggml_plain,
    serialize_graph,
    serialize_graph_plain,
)
from apir.codec.records import rpc_tensor_dtype
from apir.ggml import InitParams
from apir.ggml.layout import tensor_record
from tests.codec.graphs import build_graph

pytestmark = pytest.mark.skipif(not accel.enabled(), reason="apir.accel is off: no Numba twin to compare")

REPRODUCERS = sorted((Path(__file__).parents[1] / "fuzz" / "reproducers").glob("*.json"))


@pytest.fixture(scope="module")
def graphs(ggml):
    built = {
        "layers4": build_graph(ggml, 4),
        "one_node": build_graph(ggml, 3, only_last_node=True),
    }
    yield built
    for b in built.values():
        b.free(ggml)


def outcome(fn, *args, **kw):
    """What `fn` gives: ("ok", value) or (the exception's type, its message)."""
    try:
        return "ok", fn(*args, **kw)
    except ValueError as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("name", ["layers4", "one_node"])
def test_serialize_same_bytes(ggml, graphs, name):
    bg = graphs[name]
    accelerated = serialize_graph(ggml, bg.cgraph, bg.buffers)
    plain = serialize_graph_plain(ggml, bg.cgraph, bg.buffers)
    assert plain.tobytes() == accelerated.tobytes()
    for t in bg.tensors:
        assert rpc_tensor_from_ggml_plain(ggml, t, bg.buffers).tobytes() == rpc_tensor_from_ggml(ggml, t, bg.buffers).tobytes()


@pytest.fixture
def ctx(ggml):
    ctx = ggml.ggml_init(InitParams(64 * ggml.ggml_tensor_overhead() + 4 * ggml.ggml_graph_overhead(), None, True))
    yield ctx
    ggml.ggml_free(ctx)


@pytest.mark.parametrize(
    "field, value",
    [
        ("ne", [1 << 32, 1, 1, 1]),
        ("ne", [4, -1, 1, 1]),
        ("nb", [4, 16, 1 << 40, 1 << 40]),
        ("nb", [4, 2**64 - 4, 16, 16]),
        ("data", 0x1000),  # data without a buffer
        ("buffer", 0xBAD0),  # a buffer not in the table
    ],
)
def test_serialize_same_error(ggml, ctx, field, value):
    a = ggml.ggml_new_tensor_1d(ctx, ggml.types["F32"], 4)
    ggml.ggml_set_name(a, b"bad")
    tensor_record(a, ggml.tensor_dtype)[field] = value
    cgraph = ggml.ggml_new_graph(ctx)
    ggml.ggml_build_forward_expand(cgraph, ggml.ggml_relu(ctx, a))
    table = BufferTable()
    want = outcome(serialize_graph, ggml, cgraph, table)
    assert want[0] == "ValueError" and "'bad'" in want[1]
    assert outcome(serialize_graph_plain, ggml, cgraph, table) == want
    assert outcome(rpc_tensor_from_ggml_plain, ggml, a, table) == outcome(rpc_tensor_from_ggml, ggml, a, table)


def test_serialize_into_out_same_bytes(ggml, graphs):
    bg = graphs["layers4"]
    scratch = np.full(1 << 20, 0xAA, np.uint8)
    got = serialize_graph_plain(ggml, bg.cgraph, bg.buffers, out=scratch)
    assert got.base is scratch and got.tobytes() == serialize_graph(ggml, bg.cgraph, bg.buffers).tobytes()


def parse_outcome(fn, ggml, raw):
    """A parse's arrays (or its error) as plain values."""
    kind, value = outcome(fn, raw, op_count=ggml.op_count, type_valid=ggml.valid_types, limits=ggml.limits)
    if kind != "ok":
        return kind, value
    arrays = (value.node_ids, value.tensors, value.order, value.node_index, value.src_index, value.view_src_index)
    return kind, [(a.dtype.str, a.shape, a.tobytes()) for a in arrays], value.size


def assert_parses_alike(ggml, raw) -> str:
    plain = parse_outcome(parse_graph_plain, ggml, raw)
    assert plain == parse_outcome(parse_graph, ggml, raw)
    return plain[0]


def mutants(raw: bytes, rpc, rng, n: int):
    """`n` copies of `raw` with one field of one record (or a count, or a node id) rewritten:
    ids, sources and view sources pointed at other records, at themselves or at nothing;
    types, ops and names out of range; counts off by one."""
    n_nodes = int.from_bytes(raw[:4], "little")
    head = 8 + 8 * n_nodes
    n_tensors = (len(raw) - head) // rpc.itemsize
    for _ in range(n):
        data = bytearray(raw)
        recs = np.frombuffer(data, rpc, n_tensors, head)
        ids = [int(i) for i in recs["id"]] + [0, 0x777]
        k = int(rng.integers(0, max(n_tensors, 1)))
        what = int(rng.integers(0, 9))
        if n_tensors == 0 or what == 0:
            pos = int(rng.choice([0, head - 4]))  # n_nodes or n_tensors, one more or one less
            count = int.from_bytes(raw[pos : pos + 4], "little") + int(rng.choice([-1, 1]))
            data[pos : pos + 4] = (count % 2**32).to_bytes(4, "little")
        elif what == 1:
            recs[k]["id"] = ids[int(rng.integers(0, len(ids)))]
        elif what == 2:
            recs[k]["src"][int(rng.integers(0, rpc["src"].shape[0]))] = ids[int(rng.integers(0, len(ids)))]
        elif what == 3:
            recs[k]["view_src"] = ids[int(rng.integers(0, len(ids)))]
        elif what == 4:
            recs[k]["type"] = int(rng.integers(0, 64))
        elif what == 5:
            recs[k]["op"] = int(rng.integers(0, 2 * 100))
        elif what == 6:
            recs[k]["name"] = np.frombuffer(bytes(rng.integers(1, 256, rpc["name"].shape[0], dtype=np.uint8)), "S1")
        elif what == 7 and n_nodes:
            i = int(rng.integers(0, n_nodes))
            data[4 + 8 * i : 12 + 8 * i] = ids[int(rng.integers(0, len(ids)))].to_bytes(8, "little")
        else:
            data[int(rng.integers(0, len(data)))] ^= 1 << int(rng.integers(0, 8))
        yield bytes(data)


def test_parse_alike_on_the_fuzzers_reproducers_and_their_mutants(ggml):
    rpc = rpc_tensor_dtype(ggml.limits)
    rng = np.random.default_rng(33)
    kinds = set()
    assert REPRODUCERS
    for path in REPRODUCERS:
        rec = json.loads(path.read_text())
        for step in rec["steps"]:
            if step[0] != "blob":
                continue
            raw = base64.b64decode(step[2])
            assert assert_parses_alike(ggml, raw) == "ok"
            for data in mutants(raw, rpc, rng, 40):
                kinds.add(assert_parses_alike(ggml, data))
    assert kinds == {"ok", "GraphError"}


def test_parse_alike_on_a_real_graph_and_its_mutants(ggml, graphs):
    rpc = rpc_tensor_dtype(ggml.limits)
    raw = serialize_graph(ggml, graphs["layers4"].cgraph, graphs["layers4"].buffers).tobytes()
    n_nodes = int.from_bytes(raw[:4], "little")
    head = 8 + 8 * n_nodes
    reversed_records = raw[:head] + np.frombuffer(raw, rpc, offset=head)[::-1].tobytes()
    assert assert_parses_alike(ggml, raw) == "ok"
    assert assert_parses_alike(ggml, reversed_records) == "ok"  # the depth-first order, not the records'
    messages = set()
    for data in list(mutants(raw, rpc, np.random.default_rng(7), 300)) + list(
        mutants(reversed_records, rpc, np.random.default_rng(8), 100)
    ):
        plain = parse_outcome(parse_graph_plain, ggml, data)
        assert plain == parse_outcome(parse_graph, ggml, data)
        if plain[0] != "ok":
            messages.add(plain[1].split(": ", 1)[-1].split(" ")[0])
    # every kind of refusal was met: counts, ids, types, ops, names, sources, nodes, cycles
    assert len(messages) >= 6, messages


def test_parse_alike_on_a_cycle_through_view_src(ggml, graphs):
    rpc = rpc_tensor_dtype(ggml.limits)
    raw = serialize_graph(ggml, graphs["layers4"].cgraph, graphs["layers4"].buffers).tobytes()
    n_nodes = int.from_bytes(raw[:4], "little")
    data = bytearray(raw)
    recs = np.frombuffer(data, rpc, offset=8 + 8 * n_nodes)
    recs[0]["view_src"] = recs[-1]["id"]
    kind = parse_outcome(parse_graph_plain, ggml, bytes(data))
    assert kind[0] == "GraphError" and "cycle" in kind[1]
    assert kind == parse_outcome(parse_graph, ggml, bytes(data))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=1500), n_nodes=st.integers(0, 3), n_tensors=st.integers(0, 4))
def test_parse_alike_on_random_bytes(ggml, raw, n_nodes, n_tensors):
    """Random bytes, and random bytes behind counts that fit them."""
    assert_parses_alike(ggml, raw)
    rec = rpc_tensor_dtype(ggml.limits).itemsize
    body = (raw * (1 + (8 * n_nodes + rec * n_tensors) // max(len(raw), 1)))[: 8 * n_nodes + rec * n_tensors]
    if len(body) == 8 * n_nodes + rec * n_tensors:
        framed = n_nodes.to_bytes(4, "little") + body[: 8 * n_nodes] + n_tensors.to_bytes(4, "little") + body[8 * n_nodes :]
        assert_parses_alike(ggml, framed)


def test_parse_copy_is_private_on_both_paths(ggml, graphs):
    """Both paths parse a window inside a larger buffer and keep nothing of it."""
    raw = serialize_graph(ggml, graphs["layers4"].cgraph, graphs["layers4"].buffers).tobytes()
    shared = bytearray(b"\xee" * 16 + raw + b"\xff" * 8)
    for fn in (parse_graph, parse_graph_plain):
        p = fn(shared, 16, 16 + len(raw), op_count=ggml.op_count, type_valid=ggml.valid_types, limits=ggml.limits)
        before = p.tensors.tobytes()
        shared[16:] = b"\0" * (len(shared) - 16)
        assert p.tensors.tobytes() == before and p.size == len(raw)
        shared[16 : 16 + len(raw)] = raw
    shared.extend(b"\0")  # BufferError if a parse still viewed it
