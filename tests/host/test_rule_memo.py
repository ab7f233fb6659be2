"""apir.host.graph.rule_memo: a rule run once per group of equal inputs decides as running it on
every tensor would.

A graph of four equal layers (mul_mat, add, get_rows with each layer's own ids, rms_norm,
soft_max, cont of a transpose) is built with the groups and, as a reference, with every tensor
checked on its own; on thousands of lying variants both must accept or refuse alike, with the
same message, and leave the same row-id state on the infos.
"""

import numpy as np
import pytest

from apir.host.graph.kernels import TABLE_KEY, group_sizes_kernel, rule_group_kernel
from apir.codec.graph import parse_graph
from apir.host.graph import build as hg
from apir.host.graph import rule_memo
from apir.host.errors import Refused
from apir.host.graph.rule_memo import Impure, Sealed, rule_groups
from apir.host.graph.shapes import TensorInfo
from apir.host.tensors import Scratch
from tests.host.hostkit import GgmlScratch, RemoteGraph

LAYERS = 4
N_ROWS = 10


def _graph(g, ctx):
    f32, i32 = g.types["F32"], g.types["I32"]
    x = g.ggml_new_tensor_2d(ctx, f32, 16, 3)
    emb = g.ggml_new_tensor_2d(ctx, f32, 12, N_ROWS)
    g.ggml_set_input(x)
    ids = []
    for layer in range(LAYERS):
        w = g.ggml_new_tensor_2d(ctx, f32, 16, 12)
        b = g.ggml_new_tensor_1d(ctx, f32, 12)
        rows = g.ggml_new_tensor_1d(ctx, i32, 3)
        g.ggml_set_name(rows, f"rows{layer}".encode())
        ids.append(rows)
        h = g.ggml_add(ctx, g.ggml_add(ctx, g.ggml_mul_mat(ctx, w, x), b), g.ggml_get_rows(ctx, emb, rows))
        h = g.ggml_soft_max_ext(ctx, g.ggml_rms_norm(ctx, h, 1e-6), None, 0.5, 0.0)
        h = g.ggml_cont(ctx, g.ggml_transpose(ctx, h))  # [3, 12]
        h = g.ggml_reshape_2d(ctx, g.ggml_cont(ctx, g.ggml_transpose(ctx, h)), 12, 3)
        x = g.ggml_add(ctx, x, g.ggml_concat(ctx, h, g.ggml_view_2d(ctx, h, 4, 3, g.ggml_row_size(f32, 12), 0), 0))
    g.ggml_set_output(x)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, x)
    return graph, ids


@pytest.fixture
def setup(guest, ggml):
    """(lib, wire bytes) of the four-layer graph, each layer's row ids in range."""
    s = GgmlScratch(ggml, 256)
    graph, ids = _graph(ggml, s.ctx)
    remote = RemoteGraph(guest, ggml, s.ctx, graph)
    for k, rows in enumerate(ids):
        data = np.array([k, N_ROWS - 1, 0], np.int32).tobytes()
        assert guest.set_tensor(remote.handle, remote.rpc(rows), data) == 0
    yield guest.ctx._library, remote.wire, remote, guest, ids
    remote.close()
    s.close()


def _parse(lib, wire):
    g = lib.g
    return parse_graph(wire, limits=g.limits, op_count=g.op_count, type_valid=lib.checker.valid_types)


def _build(lib, parsed, grouped: bool, monkeypatch):
    """(refusal message or None, row-id state of every info) of build_graph_parts."""
    if grouped:
        monkeypatch.setattr(hg, "rule_groups", rule_groups)
    else:
        monkeypatch.setattr(hg, "rule_groups", lambda p: np.arange(len(p.tensors), dtype=np.int32))
    with Scratch(lib.g, len(parsed.tensors), max(len(parsed.node_index), 1)) as scratch:
        try:
            built = hg.build_graph_parts(lib, parsed, scratch, lib.op_enums)
        except Refused as exc:
            return str(exc), None
        state = [
            (i.snapshot is not None and bytes(i.snapshot), i.read_by, i.id_bounds, i.one_thread) for i in built.infos
        ]
        return None, state


def test_layers_share_groups_and_row_id_readers_stay_apart(setup):
    lib, wire, *_ = setup
    parsed = _parse(lib, wire)
    rep = rule_groups(parsed)
    n = len(parsed.tensors)
    assert len(np.unique(rep)) < n // 2  # the layers' nodes share their first layer's group
    assert all(rep[i] <= i and rep[rep[i]] == rep[i] for i in range(n))
    ops = parsed.tensors["op"]
    rows = np.flatnonzero(ops == lib.g.ops["GET_ROWS"])
    assert len(rows) == LAYERS and len(set(rep[rows].tolist())) == 1  # one group: impure, each checked


def test_group_kernel_twins_agree(setup):
    lib, wire, *_ = setup
    parsed = _parse(lib, wire)
    rng = np.random.default_rng(5)
    t = parsed.tensors
    for trial in range(20):
        words = np.ascontiguousarray(t).view(np.int64).reshape(len(t), -1).copy()
        words[rng.integers(len(t), size=3), rng.integers(words.shape[1], size=3)] ^= 1
        mask = rule_memo._mask(t.dtype)
        src = np.ascontiguousarray(parsed.src_index, np.int32).copy()
        if trial % 2:
            src[rng.integers(len(t)), 0] = rng.integers(len(t))  # (a graph the parse would refuse)
        a = np.empty(len(t), np.int32)
        b = np.empty(len(t), np.int32)
        keep = np.flatnonzero(mask)
        args = (words, keep, mask[keep], src)
        assert rule_group_kernel(*args, a, TABLE_KEY) == rule_group_kernel.py_func(*args, b, TABLE_KEY)
        assert np.array_equal(a, b)


@pytest.mark.parametrize("twin", [False, True])
def test_group_sizes_are_numpys(twin):
    """group_sizes_kernel: the representatives in index order and each group's size, as
    numpy finds them (`rep == arange`, bincount), on random groupings."""
    kernel = group_sizes_kernel.py_func if twin else group_sizes_kernel
    rng = np.random.default_rng(11)
    for n in (0, 1, 7, 500):
        rep = np.arange(n, dtype=np.int32)
        for i in range(1, n):
            if rng.random() < 0.7:
                rep[i] = rep[rng.integers(i)]  # (a representative is at or before its members)
        reps, sizes = np.full(n, -9, np.int32), np.zeros(n, np.int32)
        k = kernel(rep, reps, sizes)
        assert reps[:k].tolist() == np.flatnonzero(rep == np.arange(n)).tolist()
        assert sizes.tolist() == np.bincount(rep, minlength=n).tolist()


_LIES = ("ne", "nb", "op_params", "type")


def _lie(rng, t):
    i = int(rng.integers(len(t)))
    field = _LIES[int(rng.integers(len(_LIES)))]
    if field == "type":
        t["type"][i] = int(rng.integers(0, 3))
    elif field == "op_params":
        t["op_params"][i, int(rng.integers(4))] = int(rng.choice([0, 1, 2, 3, -1, 0x3F000000]))
    else:
        k = int(rng.integers(4))
        old = int(t[field][i, k])
        t[field][i, k] = int(rng.choice([old + 1, max(old - 1, 0), old * 2, 0, 4, 48]))
    return f"tensor {i} {field}"


def test_grouped_checks_decide_as_checking_every_tensor(setup, monkeypatch):
    lib, wire, *_ = setup
    rng = np.random.default_rng(23)
    seen = {"accepted": 0, "refused": 0}
    for _ in range(600):
        parsed = _parse(lib, wire)
        what = [_lie(rng, parsed.tensors) for _ in range(int(rng.integers(1, 3)))]
        one_by_one = _build(lib, parsed, False, monkeypatch)
        grouped = _build(lib, parsed, True, monkeypatch)
        assert grouped == one_by_one, what
        seen["refused" if grouped[0] else "accepted"] += 1
    assert seen["accepted"] > 20 and seen["refused"] > 200, seen


def test_a_bad_row_id_in_a_later_layer_is_refused(setup, monkeypatch):
    """GET_ROWS reads its ids (Sealed hides them): every layer's ids are checked."""
    lib, _, remote, guest, ids = setup
    assert guest.set_tensor(remote.handle, remote.rpc(ids[-1]), np.array([0, N_ROWS, 0], np.int32).tobytes()) == 0
    msg, _ = _build(lib, _parse(lib, remote.wire), True, monkeypatch)
    assert msg is not None and "row id out of [0, 10)" in msg


def test_a_changed_op_param_in_a_later_layer_is_its_own_group(setup, monkeypatch):
    lib, wire, *_ = setup
    parsed = _parse(lib, wire)
    t = parsed.tensors
    soft = np.flatnonzero(t["op"] == lib.g.ops["SOFT_MAX"])
    assert len(soft) == LAYERS
    t["op_params"][soft[-1], 1] = np.float32(8.0).view(np.int32)  # max_bias without a mask: refused
    rep = rule_groups(parsed)
    assert rep[soft[-1]] == soft[-1] and rep[soft[1]] == soft[0]
    msg, _ = _build(lib, parsed, True, monkeypatch)
    assert msg is not None and f"node {soft[-1]} (SOFT_MAX)" in msg


def _info(**kw):
    base = dict(index=3, type_name="F32", ne=[4, 1, 1, 1], nb=[4, 16, 16, 16], op_name="NONE",
                op_params=np.zeros(16, np.int32), type_size=4, blck_size=1, address=64, room=16)
    base.update(kw)
    return TensorInfo(**base)


def test_sealed_lets_rules_read_only_what_groups_compare():
    info = _info()
    s = Sealed(info)
    assert s.ne == [4, 1, 1, 1] and s.nelements() == 4 and s.contiguous() and s.type_name == "F32"
    for name in ("index", "address", "room", "snapshot", "fetch", "read_by", "id_bounds", "one_thread"):
        with pytest.raises(Impure):
            getattr(s, name)
    with pytest.raises(Impure):
        s.one_thread = True
    assert info.one_thread is False


def test_a_rule_that_reads_hidden_fields_is_run_on_every_member(monkeypatch):
    """A rule that reads `room` passes sealed never: each member runs it with its own infos."""
    seen = []

    def rule(node, srcs, enums):
        seen.append(node.index)
        if node.room < 8:
            raise Refused(f"node {node.index}: too close to the end")

    monkeypatch.setitem(rule_memo.__dict__, "check_node", lambda n, s, e, r: rule(n, s, e))
    infos = [_info(index=i, room=16 if i < 2 else 4) for i in range(3)]
    groups = np.zeros(3, np.int32)
    with pytest.raises(Refused, match="node 2"):
        rule_memo.check_nodes(infos, np.full((3, 1), -1, np.int32), None, None, groups)
    assert seen == [0, 1, 2]


def test_a_pure_rule_runs_once_per_group(monkeypatch):
    seen = []

    def rule(node, srcs, enums):
        seen.append(node.ne[0])

    monkeypatch.setitem(rule_memo.__dict__, "check_node", lambda n, s, e, r: rule(n, s, e))
    infos = [_info(index=i) for i in range(5)]
    groups = np.array([0, 0, 2, 0, 2], np.int32)
    assert rule_memo.check_nodes(infos, np.full((5, 1), -1, np.int32), None, None, groups) == 2
    assert seen == [4, 4]
