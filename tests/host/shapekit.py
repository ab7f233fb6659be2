"""What the host shape-rule tests share: a `Case` (an op built with ggml's own constructor),
`Remote` (its graph laid out in a host buffer and computed through the host), `direct` (the
same graph on ggml CPU), and `case_tests(CASES)`, the two tests every case gets: through the
host it equals ggml CPU's bytes, and a lie about one ne is refused by the op's own rule (the
host then serves the next command)."""

import ctypes
import logging
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from tests.host.hostkit import DATA_RES, GgmlScratch, RemoteGraph, cpu_compute

ERROR = 1  # BACKEND_RC_ERROR


@dataclass
class Case:
    """`build(g, ctx, f32) -> (out, inputs)`; `lie` = (input index or -1 for the node, dim,
    delta) applied to ne; `data` fills input i (else standard normal of its type)."""

    op: str
    build: Callable
    lie: Tuple[int, int, int] = (-1, 0, -1)
    data: Optional[Dict[int, Callable]] = None


def _in(g, ctx, type_name, *ne):
    t = getattr(g, f"ggml_new_tensor_{len(ne)}d")(ctx, g.types[type_name], *ne)
    g.ggml_set_input(t)
    return t


def g_nb(g, t, i):
    from apir.ggml.layout import tensor_record

    return int(tensor_record(t, g.tensor_dtype)["nb"][i])


def _ints(hi, dtype=np.int32):
    return lambda n, rng: rng.permutation(hi)[:n].astype(dtype) if n <= hi else rng.integers(0, hi, n).astype(dtype)


def _data(g, case, inputs, seed=3):
    rng = np.random.default_rng(seed)
    out = []
    for i, t in enumerate(inputs):
        n = g.ggml_nelements(t)
        type_name = g.type_names[int(np.frombuffer(ctypes.string_at(t, 4), np.uint32)[0])]
        if case.data and i in case.data:
            arr = case.data[i](n, rng)
        else:
            arr = rng.standard_normal(n).astype(np.float16 if type_name == "F16" else np.float32)
        out.append(arr.tobytes())
    return out


def _graph(g, ctx, case):
    out, inputs = case.build(g, ctx)
    g.ggml_set_output(out)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, out)
    return graph, out, inputs


def _direct(g, case):
    s = GgmlScratch(g)
    graph, out, inputs = _graph(g, s.ctx, case)
    data = _data(g, case, inputs)
    got = cpu_compute(g, s.ctx, graph, zip(inputs, data), out)
    s.close()
    return got


class Remote:
    """The case's graph laid out in a host buffer, its inputs written there."""

    def __init__(self, guest, g, case):
        self.s = GgmlScratch(g)
        graph, self.out, inputs = _graph(g, self.s.ctx, case)
        self.remote = RemoteGraph(guest, g, self.s.ctx, graph)
        for t, d in zip(inputs, _data(g, case, inputs)):
            assert guest.set_tensor(self.remote.handle, self.remote.rpc(t), d) == 0
        self.inputs, self.g, self.guest = inputs, g, guest
        n_nodes = int(np.frombuffer(self.remote.wire, "<u4", 1)[0])
        self.head = 4 + 8 * n_nodes + 4
        self.recs = np.frombuffer(self.remote.wire[self.head:], self._dtype()).copy()

    def _dtype(self):
        from apir.codec.records import rpc_tensor_dtype

        return rpc_tensor_dtype(self.g.limits)

    def index(self, t):
        return int(np.nonzero(self.recs["id"] == t)[0][0])

    def compute(self, recs=None):
        wire = self.remote.wire if recs is None else self.remote.wire[: self.head] + recs.tobytes()
        self.guest.data[: len(wire)] = wire
        return self.guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))

    def result(self):
        rc, got = self.guest.get_tensor(self.remote.handle, self.remote.rpc(self.out), self.g.ggml_nbytes(self.out))
        assert rc == 0
        return got

    def close(self):
        self.remote.close()
        self.s.close()


def assert_computes_like_cpu(guest, g, case):
    """`case` through the host: accepted, and its result is ggml CPU's bytes."""
    r = Remote(guest, g, case)
    try:
        rc, dec = r.compute()
        assert rc == 0 and dec.i32() == 0
        assert r.result() == _direct(g, case)
    finally:
        r.close()


def ctor(g, name):
    """ggml's constructor `name` (a field of apir.ggml.functions.GgmlFunctions); the test is skipped
    where this ggml build lacks it."""
    if not g.has(name):
        pytest.skip(f"{name} is not in this ggml build")
    return getattr(g, name)


def case_tests(cases, ids, skip=None):
    """The `remote` fixture and the two tests of `cases`; a test module takes them with
    `remote, test_op_matches_ggml_cpu, test_lying_shape_is_refused = case_tests(CASES, IDS)`.
    `skip(ggml, case)`: why this ggml cannot build the case (the test is skipped), or None."""

    @pytest.fixture
    def remote(guest, ggml, request):
        why = skip(ggml, request.param) if skip is not None else None
        if why:
            pytest.skip(why)
        r = Remote(guest, ggml, request.param)
        yield r
        r.close()

    @pytest.mark.parametrize("remote", cases, ids=ids, indirect=True)
    def test_op_matches_ggml_cpu(remote, ggml, request):
        case = request.node.callspec.params["remote"]
        assert case.op in ggml.ops
        rc, dec = remote.compute()
        assert rc == 0 and dec.i32() == 0
        got, expect = remote.result(), _direct(ggml, case)
        assert got == expect
        assert len(set(got)) > 1  # not an untouched buffer

    @pytest.mark.parametrize("remote", cases, ids=ids, indirect=True)
    def test_lying_shape_is_refused(remote, request, caplog):
        case = request.node.callspec.params["remote"]
        which, dim, delta = case.lie
        t = remote.out if which < 0 else remote.inputs[which]
        recs = remote.recs.copy()
        i = remote.index(t)
        recs["ne"][i][dim] = int(recs["ne"][i][dim]) + delta
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="apir.host"):
            rc, _ = remote.compute(recs)
        assert rc == ERROR
        assert f"({case.op})" in caplog.text, caplog.text  # refused by the op's own rule
        rc, dec = remote.compute()  # the host serves the next valid command
        assert rc == 0 and dec.i32() == 0

    return remote, test_op_matches_ggml_cpu, test_lying_shape_is_refused


def rule_refusal(guest, r, recs, t=None):
    """Why the shape rules refuse node `t` (default: the case's result) of records `recs`
    (a `Remote`'s, edited), or None: `apir.host.shapes.node_refusal` on the records as the
    rules see them, without data (device_supports_op's view: row ids are not read) and
    without the graph-level checks (extents, spans) that would refuse first through the
    host. For rules whose bound needs a tensor larger than a test can allocate."""
    from apir.host.graph import lib_op_enums, tensor_info
    from apir.host.shapes import node_refusal

    lib = guest.ctx._library
    ids = {int(v): k for k, v in enumerate(recs["id"])}
    info = [tensor_info(lib, k, recs[k], None) for k in range(len(recs))]
    node = r.index(r.out if t is None else t)
    src = [int(v) for v in recs[node]["src"]]
    while src and not src[-1]:
        src.pop()
    return node_refusal(info[node], [info[ids[v]] if v else None for v in src], lib_op_enums(lib))
