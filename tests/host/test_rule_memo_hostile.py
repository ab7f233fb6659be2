"""Grouped rule checks (apir.host.graph.rule_memo) and the other parts of a graph's first build
(apir.host.graph.build) a hostile guest can steer.
- A scratch `ggml_context` without room for the graph's tensors or its cgraph is a
  MemoryError (the dispatcher's error reply), never ggml's abort: ggml_new_tensor_1d
  GGML_ASSERTs a full context and ggml_new_graph_custom dereferences its NULL object, so
  the room is checked before ggml is called (in a child process).
- Grouped rules (apir.host.graph.rule_memo) decide as checking every tensor on its own, on a graph
  whose rules read what `Sealed` hides: ROPE's frequency factors (`room`), OPT_STEP's
  in-place result (`address`), SET_ROWS of F16 into F32 (sets `one_thread`), GET_ROWS (row
  ids), under lies in every field a guest writes, sources and views rewired, nodes swapped,
  and a second handle of the same buffer: the same refusal (message, node, rule), the same
  row-id state on every info, the same cache entry (readers, id holders, id checks), and the
  same host tensors, the grouped build's written by the kernels, the other's made one by one
  on the plain path (apir.accel off).
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from apir.codec.graph import parse_graph
from apir import accel
from apir.host.graph import build as hg
from apir.host.errors import Refused
from apir.host.graph.cache import GraphCacheEntry
from apir.host.tensors import Scratch
from tests.host.hostilekit import groups_by_definition, host_tensors
from tests.host.hostkit import GgmlScratch, RemoteGraph, needs_kernels

_ROOT = Path(__file__).resolve().parents[2]

# A child: builds a small graph in scratch contexts without room for its tensors, then for
# its cgraph; prints what each raised.
_CHILD = r"""
import numpy as np
from apir.codec.graph import parse_graph
from apir.host.graph import build as hg
from apir.host.tensors import Scratch
from tests.host.hostkit import Guest, GgmlScratch, RemoteGraph, add_chain

guest = Guest()
lib = guest.ctx._library
g = lib.g
s = GgmlScratch(g)
remote = RemoteGraph(guest, g, s.ctx, add_chain(g, s.ctx, 12))


def parsed():
    return parse_graph(remote.wire, limits=g.limits, op_count=g.op_count, type_valid=lib.checker.valid_types)


def build(scratch, p):
    try:
        hg.build_graph_parts(lib, p, scratch, lib.op_enums)
        print("built", flush=True)
    except MemoryError as exc:
        print("MemoryError", exc, flush=True)


p = parsed()
n, nodes = len(p.tensors), len(p.node_index)
kernel_layout = hg._kernel_layout
hg._kernel_layout = lambda tensor, rpc, max_src: None  # tensors made by ggml_new_tensor_1d
with Scratch(g, 2, 1) as scratch:  # room for 3 tensors of 13
    build(scratch, p)
hg._kernel_layout = kernel_layout  # tensors written in the scratch's tensor_block
with Scratch(g, 0, 0) as scratch:  # its slack eaten: no room for the cgraph
    need = g.ggml_graph_overhead_custom(nodes, False)
    while g.ggml_get_mem_size(scratch.ctx) - g.ggml_used_mem(scratch.ctx) >= need:
        g.ggml_new_tensor_1d(scratch.ctx, g.types["F32"], 1)
    build(scratch, parsed())
with Scratch(g, n, nodes) as scratch:  # as graph_compute sizes it
    build(scratch, parsed())
remote.close()
s.close()
guest.close()
"""


def test_a_scratch_context_without_room_is_a_memory_error_not_an_abort():
    p = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, cwd=_ROOT, timeout=300)
    lines = [line for line in p.stdout.splitlines() if line.startswith(("built", "MemoryError"))]
    assert p.returncode == 0, (p.returncode, p.stdout[-1000:], p.stderr[-3000:])
    assert [line.split()[0] for line in lines] == ["MemoryError", "MemoryError", "built"], lines


# --- grouped rules against every tensor checked on its own ------------------------------------


def _layers_a(g, ctx):
    """MUL_MAT, ROPE with frequency factors, GET_ROWS, ADD and OPT_STEP_ADAMW, three layers."""
    f32, i32 = g.types["F32"], g.types["I32"]
    x = g.ggml_new_tensor_2d(ctx, f32, 16, 3)
    emb = g.ggml_new_tensor_2d(ctx, f32, 12, 10)
    out, ids = [], []
    for layer in range(3):
        w = g.ggml_new_tensor_2d(ctx, f32, 16, 12)
        pos = g.ggml_new_tensor_1d(ctx, i32, 3)
        ff = g.ggml_new_tensor_1d(ctx, f32, 2)
        rows = g.ggml_new_tensor_1d(ctx, i32, 3)
        ids += [(pos, np.array([0, 1, 2], np.int32)), (rows, np.array([layer, 9, 0], np.int32))]
        # ne[0] 6, n_dims 4: the kernel reads 3 factors of the 2 (ROPE's rule reads `room`)
        h = g.ggml_reshape_3d(ctx, g.ggml_mul_mat(ctx, w, x), 6, 2, 3)
        r = g.ggml_rope_ext(ctx, h, pos, ff, 4, 0, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
        out.append(g.ggml_add(ctx, g.ggml_reshape_2d(ctx, r, 12, 3), g.ggml_get_rows(ctx, emb, rows)))
        w2 = g.ggml_new_tensor_2d(ctx, f32, 8, 2)
        g.ggml_set_param(w2)
        grad, m, v = (g.ggml_new_tensor_2d(ctx, f32, 8, 2) for _ in range(3))
        out.append(g.ggml_opt_step_adamw(ctx, w2, grad, m, v, g.ggml_new_tensor_1d(ctx, f32, 7)))
    return out, ids


def _layers_b(g, ctx):
    """SET_ROWS of F16 rows into F32 (one thread only) and GET_ROWS, three layers."""
    f32, f16, i32, i64 = g.types["F32"], g.types["F16"], g.types["I32"], g.types["I64"]
    dst = g.ggml_new_tensor_2d(ctx, f32, 12, 10)
    emb = g.ggml_new_tensor_2d(ctx, f32, 12, 10)
    out, ids = [], []
    for layer in range(3):
        src = g.ggml_new_tensor_2d(ctx, f16, 12, 2)
        at = g.ggml_new_tensor_1d(ctx, i64, 2)
        rows = g.ggml_new_tensor_1d(ctx, i32, 3)
        ids += [(at, np.array([layer, 9], np.int64)), (rows, np.array([layer, 0, 9], np.int32))]
        out += [g.ggml_set_rows(ctx, dst, src, at), g.ggml_get_rows(ctx, emb, rows)]
    return out, ids


@pytest.fixture(params=["a", "b"])
def layers(request, guest, ggml):
    """(lib, wire, buffer handle, a second handle of the same HostBuffer, graph name)."""
    from apir.ggml.features import Feature

    if request.param == "b" and Feature.SET_ROWS_F16 not in ggml.features:
        pytest.skip("SET_ROWS of F16 rows is new in ggml 0.20")
    s = GgmlScratch(ggml, 512)
    out, ids = (_layers_a if request.param == "a" else _layers_b)(ggml, s.ctx)
    graph = ggml.ggml_new_graph(s.ctx)
    for t in out:
        ggml.ggml_build_forward_expand(graph, t)
    remote = RemoteGraph(guest, ggml, s.ctx, graph)
    for t, values in ids:
        assert guest.set_tensor(remote.handle, remote.rpc(t), values.tobytes()) == 0
    lib = guest.ctx._library
    alias = lib.buffers.add(lib.buffers.get(remote.handle))
    yield lib, remote.wire, remote.handle, alias, request.param
    lib.buffers.pop(alias)
    remote.close()
    s.close()


def _parse(lib, wire):
    g = lib.g
    return parse_graph(wire, limits=g.limits, op_count=g.op_count, type_valid=lib.checker.valid_types)


def _build(lib, parsed, grouped, monkeypatch):
    """What build_graph_parts decided and left: the refusal (message, node, rule) or None,
    each info's row-id state (None: untouched) and the cache entry's facts, and the host
    tensors it made. `grouped`: rules once per group, on the accelerated path; else every
    tensor's rule, on the plain path (apir.accel off)."""
    monkeypatch.undo()
    if not grouped:
        monkeypatch.setattr(hg, "rule_groups", lambda p: np.arange(len(p.tensors), dtype=np.int32))
        monkeypatch.setattr(accel, "enabled", lambda: False)
    n = len(parsed.tensors)
    with Scratch(lib.g, n, max(len(parsed.node_index), 1)) as scratch:
        try:
            built = hg.build_graph_parts(lib, parsed, scratch, lib.op_enums)
        except Refused as exc:
            return (str(exc), exc.node, exc.rule), None, None, None
        made = {info.index: info for info in built.infos.made()}
        state = []
        for i in range(n):
            f = made.get(i)
            touched = f is not None and (f.snapshot is not None or f.read_by or f.id_bounds or f.one_thread)
            state.append((bytes(f.snapshot or b""), f.read_by, f.id_bounds, f.one_thread) if touched else None)
        readers = sorted({j for f in made.values() if f.snapshot is not None for j in f.read_by or ()})
        entry = GraphCacheEntry(
            b"", scratch, built.graph, built.host, built.buffers, built.infos, built.src_rows, readers
        )
        copied = {i for i, f in made.items() if f.snapshot is not None}
        made_tensors = host_tensors(lib.checker.tensor_dtype, built.host, copied)
        return None, state, (readers, entry.id_holders, entry.id_checks), made_tensors


def _lie(rng, parsed, handles):
    """One lie a guest can tell, in place; its description."""

    def pick(values):
        return values[int(rng.integers(len(values)))]

    t = parsed.tensors
    i = int(rng.integers(len(t)))
    field = pick(["ne", "nb", "op_params", "type", "op", "data", "buffer", "view_offs", "src", "view_src", "node"])
    if field in ("ne", "nb"):
        k = int(rng.integers(4))
        old = int(t[field][i, k])
        t[field][i, k] = pick([old + 1, max(old - 1, 0), old * 2, 0, 1, 2, 4, 12, 48, 1 << 31, (1 << 32) - 1])
    elif field == "op_params":
        t["op_params"][i, int(rng.integers(8))] = pick([0, 1, 2, 3, 4, 8, -1, 0x3F000000, 0x7F800000])
    elif field == "type":
        t["type"][i] = pick([int(t["type"][int(rng.integers(len(t)))]), 0, 1])
    elif field == "op":
        t["op"][i] = int(t["op"][int(rng.integers(len(t)))])
    elif field == "data":
        old = int(t["data"][i])
        t["data"][i] = pick([old + 4, max(old - 4, 0), old + 64, int(t["data"][int(rng.integers(len(t)))])])
    elif field == "buffer":
        t["buffer"][i] = pick(handles)
    elif field == "view_offs":
        old = int(t["view_offs"][i])
        t["view_offs"][i] = pick([old + 4, max(old - 4, 0), 0])
    else:  # rewired: a tensor earlier in the build order (the parse's order stays valid)
        order = parsed.order.tolist()
        earlier = order[: order.index(i)] + [-1]
        if field == "src":
            parsed.src_index[i, int(rng.integers(parsed.src_index.shape[1]))] = pick(earlier)
        elif field == "view_src":
            parsed.view_src_index[i] = pick(earlier)
        else:
            others = sorted(set(range(len(t))) - set(parsed.node_index.tolist()))
            parsed.node_index[int(rng.integers(len(parsed.node_index)))] = pick(others)
    return f"tensor {i} {field}"


def _copy(parsed, wire, lib):
    twin = _parse(lib, wire)
    twin.tensors[:] = parsed.tensors
    twin.src_index[:] = parsed.src_index
    twin.view_src_index[:] = parsed.view_src_index
    twin.node_index[:] = parsed.node_index
    return twin


def test_grouped_rules_decide_as_every_tensor_alone_under_lies(layers, monkeypatch):
    lib, wire, handle, alias, name = layers
    base = _parse(lib, wire)
    assert len(np.unique(hg.rule_groups(base))) < len(base.tensors) // 2  # the layers share groups
    first, state, entry, _ = _build(lib, _parse(lib, wire), True, monkeypatch)
    assert first is None and entry[0] and entry[2]  # row ids read, with bounds to re-check on hits
    assert any(s is not None and s[3] for s in state) == (name == "b")  # SET_ROWS F16 -> F32: one thread
    rng = np.random.default_rng(41 if name == "a" else 43)
    seen = {"accepted": 0, "refused": 0}
    for _ in range(400):
        parsed = _parse(lib, wire)
        what = [_lie(rng, parsed, [handle, alias]) for _ in range(int(rng.integers(1, 3)))]
        alone = _build(lib, _copy(parsed, wire, lib), False, monkeypatch)
        grouped = _build(lib, parsed, True, monkeypatch)
        assert grouped == alone, what
        seen["refused" if grouped[0] else "accepted"] += 1
    assert seen["accepted"] > 60 and seen["refused"] > 100, seen


@pytest.mark.parametrize("layers", ["a"], indirect=True)
@pytest.mark.parametrize("lie", ["opt_step", "rope"])
def test_a_later_layer_whose_data_lies_elsewhere_is_refused(layers, lie, monkeypatch):
    """Rules that read where data lies, in the last layer only (its records compare equal to
    the first layer's, so it shares their group): OPT_STEP's result no view of its
    parameter (`address`), ROPE's frequency factors moved to the last bytes of the buffer,
    where the kernel's read of 3 factors leaves it (`room`)."""
    lib, wire, handle, _, _ = layers
    parsed = _parse(lib, wire)
    t, ops = parsed.tensors, lib.g.ops
    node = int(np.flatnonzero(t["op"] == ops["OPT_STEP_ADAMW" if lie == "opt_step" else "ROPE"])[-1])
    if lie == "opt_step":  # its data at its gradient's (the same shape), no longer a view
        parsed.view_src_index[node] = -1
        t["view_offs"][node] = 0
        t["data"][node] = t["data"][parsed.src_index[node, 1]]
        why = "result is not a view of src0"
    else:
        t["data"][parsed.src_index[node, 2]] = lib.buffers.get(handle).size - 8
        why = "frequency factors: 12 bytes read past the end of their buffer"
    groups = hg.rule_groups(parsed)
    assert groups[node] != node  # a member, checked on its own only because its rule reads more
    alone = _build(lib, _copy(parsed, wire, lib), False, monkeypatch)
    grouped = _build(lib, parsed, True, monkeypatch)
    assert grouped == alone
    assert grouped[0] is not None and grouped[0][1] == node and why in grouped[0][0], grouped[0]


# --- the grouping kernel against its definition -----------------------------------------------


@pytest.mark.parametrize("twin", [False, True])
def test_group_kernel_matches_its_definition(twin):
    """Few distinct records and sources, so that many tensors share a probe chain in the
    kernel's table and only its exact comparisons tell groups apart (the hash never decides)."""
    from apir.host.graph.kernels import TABLE_KEY, rule_group_kernel

    kernel = rule_group_kernel.py_func if twin else rule_group_kernel
    rng = np.random.default_rng(7)
    mask = np.array([-1, 0, 0x0000FFFF00000000, -1], np.int64)
    for trial in range(300 if twin else 3000):
        n = int(rng.integers(1, 40))
        variants = rng.integers(-3, 3, size=(int(rng.integers(1, 4)), 4))
        words = variants[rng.integers(len(variants), size=n)].astype(np.int64)
        words[:, 1] = rng.integers(1 << 62, size=n)  # unmasked: where data lies, ids...
        words[:, 2] ^= rng.integers(1 << 31, size=n) & 0x7FFF  # unmasked low bits of a masked word
        src = np.full((n, 3), -1, np.int32)
        for i in range(n):
            for k in range(3):
                r = rng.random()
                if r < 0.25:
                    src[i, k] = i  # (a graph the parse refuses; the kernel must still be exact)
                elif r < 0.75 and i:
                    src[i, k] = int(rng.integers(i))
                elif r < 0.85 and k:
                    src[i, k] = src[i, int(rng.integers(k))]
        got = np.full(n, -7, np.int32)
        keep = np.flatnonzero(mask)
        groups = kernel(words, keep, mask[keep], src, got, TABLE_KEY if trial % 2 else 1)  # (1: the worst key)
        want = groups_by_definition(words, mask, src)
        assert np.array_equal(got, want), (trial, got, want)
        assert groups == len(np.unique(want))


@pytest.mark.parametrize("twin", [False, True])
def test_group_kernel_matches_its_definition_on_repeated_layers(twin):
    """Layers that repeat (what the kernel tries first: the tensor after the one found like
    the tensor before), each tensor of a layer now and then unlike its twin in the layer
    before by a masked word, a source, or a source's slot: the groups are the definition's."""
    from apir.host.graph.kernels import TABLE_KEY, rule_group_kernel

    kernel = rule_group_kernel.py_func if twin else rule_group_kernel
    rng = np.random.default_rng(17)
    mask = np.array([-1, 0, 0x0000FFFF00000000, -1], np.int64)
    for trial in range(40 if twin else 400):
        period, layers = int(rng.integers(1, 9)), int(rng.integers(2, 7))
        n = period * layers
        base = rng.integers(-2, 2, size=(period, 4)).astype(np.int64)
        words = np.tile(base, (layers, 1))
        words[:, 1] = rng.integers(1 << 62, size=n)  # unmasked
        src = np.full((n, 2), -1, np.int32)
        for i in range(n):
            for k in range(2):
                if rng.random() < 0.6 and i:  # a source in its own layer, or in the one before
                    src[i, k] = int(rng.integers(max(0, i - period - 1), i))
            if i >= period and rng.random() < 0.7:  # most often: its twin's sources, moved a layer on
                twin_src = src[i - period]
                src[i] = np.where(twin_src >= 0, twin_src + period, -1)
        for i in np.flatnonzero(rng.random(n) < 0.1):  # now and then unlike its twin
            if rng.random() < 0.5:
                words[i, int(rng.choice([0, 2, 3]))] ^= np.int64(int(rng.choice([1, 1 << 33, -(1 << 63)])))
            else:
                src[i, int(rng.integers(2))] = int(rng.integers(-1, i)) if i else -1
        got = np.full(n, -7, np.int32)
        keep = np.flatnonzero(mask)
        groups = kernel(words, keep, mask[keep], src, got, TABLE_KEY if trial % 2 else 1)
        want = groups_by_definition(words, mask, src)
        assert np.array_equal(got, want), (trial, got, want)
        assert groups == len(np.unique(want))


def _slots(hashes, cap):
    return len(set(int(h) & (cap - 1) for h in hashes))


def test_hash_tables_spread_keys_that_differ_only_in_high_bits():
    """The tables of guest-written keys (rule groups: masked records; record fields: buffer
    handles; the parse: tensor ids) take a slot from the low bits of their hash: those must
    depend on every bit of the key, or records differing only in a word's high half (ne[1],
    nb[1], op_params[0]: any graph of such tensors, no crafting needed) share one probe chain
    and each insert compares against all before it (quadratic). The multiplier is drawn per
    process (`TABLE_KEY`), so a guest cannot aim keys at one chain either."""
    from apir.host.graph import kernels as K
    from apir.codec import _kernels as CK
    from apir.codec.records import rpc_tensor_dtype
    from apir.host.graph import rule_memo

    assert K.TABLE_KEY % 2 == 1 and 0 < K.TABLE_KEY < 1 << 62
    n, cap = 4096, 8192
    dt = rpc_tensor_dtype()
    t = np.zeros(n, dt)
    t["ne"], t["nb"] = [1, 1, 1, 1], [4, 4, 4, 4]
    fields = {"op_params": (t["op_params"], 0), "ne": (t["ne"], 1), "nb": (t["nb"], 3)}
    mask = rule_memo._mask(dt)
    for name, (values, k) in fields.items():
        base = values[:, k].copy()
        values[:, k] = np.arange(n)
        assert dt.fields[name][1] % 8 == 4 or k % 2 == 1  # (in the high half of a word)
        words = np.ascontiguousarray(t).view(np.int64).reshape(n, -1)
        keep = np.flatnonzero(mask)
        seeds = K._lane_seeds(len(keep), K.TABLE_KEY)
        hashes = [K._row_hash(words, keep, mask[keep], seeds, r, K.TABLE_KEY) for r in range(n)]
        assert _slots(hashes, cap) > n // 2, name  # a random hash: ~3,200
        values[:, k] = base
    def as_i64(u):
        return u - (1 << 64) if u >= 1 << 63 else u

    handles = [(j + 1) << 40 for j in range(n)]
    assert _slots([K._mix(0, as_i64(h), K.TABLE_KEY) for h in handles], cap) > n // 2
    # tensor ids (parse_graph_kernel's map): ones the fixed Fibonacci slot put all in slot 0
    inverse = pow(CK._GOLDEN % (1 << 64), -1, 1 << 64)
    ids = [as_i64((j + 1) * inverse % (1 << 64)) for j in range(n)]
    assert _slots([CK._slot(i, cap - 1) for i in ids], cap) == 1  # (what parse hashed before)
    assert _slots([K._mix(0, i, K.TABLE_KEY) for i in ids], cap) > n // 2


def test_hash_tables_keep_guest_words_apart_whatever_the_key():
    """`_mix` keeps 62 bits of state: a 64-bit word folded in as `(v ^ v >> 32) * key`, its top
    two bits cut, made x, ~x, x ^ (2**62 | 2**30) and ~x ^ (2**62 | 2**30) hash alike under
    every key and seed. A guest so varying the whole masked words of its records (op_params;
    nb where ne is 1) would put 4**k distinct records in one probe chain of rule_group_kernel
    (quadratic). Those words must not collide
    unless the secret key makes them."""
    import itertools

    from apir.host.graph import kernels as K
    from apir.codec.records import rpc_tensor_dtype
    from apir.host.graph import rule_memo

    flip = (1 << 62) | (1 << 30)
    rng = np.random.default_rng(5)
    for x in rng.integers(-(1 << 63), 1 << 63, size=50, dtype=np.int64).tolist():
        h = int(rng.integers(1 << 62))
        assert len({K._mix(h, y, K.TABLE_KEY) for y in (x, ~x, x ^ flip, ~x ^ flip)}) == 4
    dt = rpc_tensor_dtype()
    mask = rule_memo._mask(dt)
    keep = np.flatnonzero(mask)
    free = [w for w in keep.tolist() if mask[w] == -1 and 64 <= 8 * w < 120][:6]  # op_params only
    assert len(free) == 6
    n, cap = 4 ** len(free), 8192
    t = np.zeros(n, dt)
    t["ne"], t["nb"] = [1, 1, 1, 1], [4, 4, 4, 4]
    words = np.ascontiguousarray(t).view(np.int64).reshape(n, -1)
    for r, combo in enumerate(itertools.product(range(4), repeat=len(free))):
        for w, c in zip(free, combo):
            x = int(words[r, w])
            words[r, w] = (~x if c & 1 else x) ^ (flip if c & 2 else 0)
    seeds = K._lane_seeds(len(keep), K.TABLE_KEY)
    hashes = [K._row_hash(words, keep, mask[keep], seeds, r, K.TABLE_KEY) for r in range(n)]
    assert _slots(hashes, cap) > n // 2  # a random hash: ~3,200 (1 before)


def test_rule_group_hash_keeps_swapped_words_and_halves_apart():
    """`_row_hash` sums one NH lane per word position (`_nh`: the word's 32-bit halves, each
    plus a secret seed, multiplied). Rows holding the same words in other positions, or a
    word with its halves swapped, or halves that trade a carry between them, must not share a
    slot: with a seed per position and per half they collide only by the seeds' chance."""
    import itertools

    from apir.host.graph import kernels as K
    from apir.codec.records import rpc_tensor_dtype
    from apir.host.graph import rule_memo

    dt = rpc_tensor_dtype()
    mask = rule_memo._mask(dt)
    keep = np.flatnonzero(mask)
    free = [w for w in keep.tolist() if mask[w] == -1 and 64 <= 8 * w < 120][:6]  # op_params only
    values = [3, 5 << 32, (7 << 32) | 11, -1, 1 << 31, (1 << 32) - 1]
    rows = []
    for perm in itertools.permutations(range(6)):  # the same six words, in every order
        rows.append([values[p] for p in perm])
    for x in values:  # each word with its halves swapped, and with a carry moved across
        lo, hi = x & 0xFFFFFFFF, (x >> 32) & 0xFFFFFFFF
        for y in ((lo << 32) | hi, x + (1 << 32) - 1, x - (1 << 32) + 1):
            rows.append([y if k == 0 else values[k] for k in range(6)])
    n, cap = len(rows), 4096
    t = np.zeros(n, dt)
    words = np.ascontiguousarray(t).view(np.int64).reshape(n, -1)
    for r, row in enumerate(rows):
        for w, x in zip(free, row):
            words[r, w] = np.int64(x - (1 << 64) if x >= 1 << 63 else x)
    distinct = {tuple(words[r, keep].tolist()) for r in range(n)}
    seeds = K._lane_seeds(len(keep), K.TABLE_KEY)
    hashes = [K._row_hash(words, keep, mask[keep], seeds, r, K.TABLE_KEY) for r in range(n)]
    assert len(set(hashes)) == len(distinct)  # no two distinct rows share a hash
    assert _slots(hashes, cap) > len(distinct) * 3 // 4  # a random hash: ~660 of 738


# --- the first write over each range of row ids -----------------------------------------------


@pytest.mark.parametrize("direct_max", [0, 1 << 30], ids=["sweep", "pairs"])
@pytest.mark.parametrize("twin", [False, True])
def test_first_overlap_kernel_matches_its_definition(twin, direct_max):
    """_check_graph_needs' sweep (`first_overlap_kernel`) against every pair compared: the
    least position of a write whose bytes overlap each query's in the same buffer, empty
    ranges included (one overlaps a range that strictly contains its offset)."""
    from apir.host.graph.kernels import first_overlap_kernel

    kernel = first_overlap_kernel.py_func if twin else first_overlap_kernel
    rng = np.random.default_rng(13)
    for trial in range(200 if twin else 2000):
        nw, nq = int(rng.integers(0, 30)), int(rng.integers(1, 12))
        span = int(rng.choice([4, 16, 64]))
        w_buf, q_buf = rng.integers(0, 3, nw), rng.integers(0, 3, nq)
        w_lo, q_lo = rng.integers(0, span, nw), rng.integers(0, span, nq)
        w_hi = w_lo + rng.integers(0, 8, nw) * (rng.random(nw) < 0.85)  # some empty
        q_hi = q_lo + rng.integers(0, 8, nq) * (rng.random(nq) < 0.85)
        w_pos = rng.integers(0, 20, nw)  # (several writes at one position: an OPT_STEP's)
        got = np.full(nq, -7, np.int64)
        arrays = [a.astype(np.int64) for a in (w_buf, w_lo, w_hi, w_pos, q_buf, q_lo, q_hi)]
        assert kernel(*arrays, got, direct_max) == 0
        over = (w_buf[None, :] == q_buf[:, None]) & (w_lo[None, :] < q_hi[:, None]) & (q_lo[:, None] < w_hi[None, :])
        least = np.where(over, w_pos[None, :], 1 << 40).min(axis=1, initial=1 << 40)
        want = np.where(over.any(axis=1), least, -1)
        assert np.array_equal(got, want), (trial, got, want)


def _needs_by_pairs(lib, parsed, made, recs):
    """_check_graph_needs' refusal of overwritten row ids (its message, or None) by its
    definition: every ids tensor, in tensor order, against every write (a node that is not
    empty, and an OPT_STEP's sources) up to its last reader, in graph order."""
    from apir.host.graph.profiles import EMPTY_OPS

    op_names, ops = lib.g.op_names, parsed.tensors["op"]
    nodes = parsed.node_index.tolist()
    position = {j: p for p, j in enumerate(nodes)}
    bufs, offsets, extents = recs.bufs, recs.offsets.tolist(), recs.extents.tolist()
    writes = []
    for p, j in enumerate(nodes):
        name = op_names[int(ops[j])]
        if name not in EMPTY_OPS:
            writes += [(p, j, j)] + [(p, j, k) for k in parsed.src_index[j].tolist() if k >= 0 and "OPT_STEP" in name]
    for info in made:
        if info.snapshot is None:
            continue
        i = info.index
        until = max((position.get(j, -1) for j in info.read_by or ()), default=-1)
        lo, hi = offsets[i], offsets[i] + extents[i]
        for p, j, k in writes:
            if p <= until and bufs[k] is bufs[i] and offsets[k] < hi and lo < offsets[k] + extents[k]:
                op = op_names[int(ops[j])]
                why = f"row ids read before compute, but node {j} ({op}) writes over them before they are read"
                return f"graph tensor {i}: {why}"
    return None


@needs_kernels
@pytest.mark.parametrize("direct_pairs", [0, 1 << 30], ids=["sweep", "pairs"])
@pytest.mark.parametrize("layers", ["a"], indirect=True)
def test_graph_needs_decide_as_comparing_every_pair(layers, direct_pairs, monkeypatch):
    """The sweep of _check_graph_needs (not every ids tensor against every write: that is
    quadratic) against its definition,
    on graphs whose ids, results and OPT_STEP parameters are moved over each other, whose
    nodes are reordered, and whose tensors name the buffer by a second handle."""
    from apir.host.graph.rule_memo import check_nodes

    lib, wire, handle, alias, _ = layers
    monkeypatch.setattr(hg, "_DIRECT_PAIRS", direct_pairs)
    rng = np.random.default_rng(17)
    seen = {"refused": 0, "passed": 0}
    for _ in range(600):
        parsed = _parse(lib, wire)
        t = parsed.tensors
        readers = np.isin(t["op"], [lib.g.ops["GET_ROWS"], lib.g.ops["ROPE"]])
        ids = parsed.src_index[readers, 1].tolist()
        steps = parsed.src_index[t["op"] == lib.g.ops["OPT_STEP_ADAMW"]]
        nodes = parsed.node_index.tolist() + steps[steps >= 0].tolist()  # (what OPT_STEP updates)
        for _ in range(int(rng.integers(1, 4))):
            i, k = (int(x) for x in rng.integers(len(t), size=2))
            what = int(rng.integers(5))
            if what < 2:  # row ids at what a node writes, or that at row ids
                a, b = int(rng.choice(ids)), int(rng.choice(nodes))
                a, b = (a, b) if what == 0 else (b, a)
                t["data"][a] = max(int(t["data"][b]) + int(rng.choice([0, 0, 4, -4])), 0)
            elif what == 2:  # two nodes swap places in the graph
                a, b = rng.integers(len(parsed.node_index), size=2)
                parsed.node_index[[a, b]] = parsed.node_index[[b, a]]
            elif what == 3:
                t["buffer"][i] = alias
            else:
                parsed.view_src_index[i] = -1
        try:
            recs = hg._check_records(lib, parsed) or hg._check_records_one_by_one(lib, parsed)
            infos = hg.TensorInfos(lib, parsed, recs, fetch=False)
            hg._check_spans(lib, parsed, infos, recs)
            check_nodes(infos, parsed.src_index, lib.op_enums, None, hg.rule_groups(parsed))
        except Refused:
            continue
        made = infos.made()
        try:
            hg._check_graph_needs(lib, parsed, made, recs)
            got = None
        except Refused as exc:
            got = str(exc)
        assert got == _needs_by_pairs(lib, parsed, made, recs)
        seen["passed" if got is None else "refused"] += 1
    assert seen["refused"] > 40 and seen["passed"] > 200, seen


# --- the row ids the rules copy ------------------------------------------------------------------


def _set_rows_over_one_ids(g, ctx, n, readers):
    """`readers` SET_ROWS into one 2-row tensor, each at its own view of the same `n` I64 ids
    (and the same `n` source rows): a few MiB of buffers, a graph of 2 records a reader."""
    a = g.ggml_new_tensor_2d(ctx, g.types["F32"], 1, 2)
    b = g.ggml_new_tensor_2d(ctx, g.types["F32"], 1, n)
    ids = g.ggml_new_tensor_1d(ctx, g.types["I64"], n)
    graph = g.ggml_new_graph(ctx)
    y = a
    for _ in range(readers):
        y = g.ggml_set_rows(ctx, y, b, g.ggml_view_1d(ctx, ids, n, 0))
        g.ggml_build_forward_expand(graph, y)
    return graph


def test_row_id_copies_of_a_graph_stay_within_its_buffers(guest, ggml):
    """Each tensor of row ids a rule reads is copied (TensorInfo.snapshot), and a guest may
    view the same ids through as many tensors as its graph has room for: 32 readers of one
    2 MiB ids tensor made the host copy 64 MiB from 3 MiB of buffers (a larger graph, many
    GiB: the host's memory, not the guest's budget). The copies of one graph are bounded by
    the bytes of the buffers it names (each once): past that it is refused, with the rule
    that read the ids; the same graph with as many readers as fit is built."""
    lib = guest.ctx._library
    n = 1 << 18
    for readers, refused in ((32, True), (1, False)):
        s = GgmlScratch(ggml, 4 * readers + 8)
        remote = RemoteGraph(guest, ggml, s.ctx, _set_rows_over_one_ids(ggml, s.ctx, n, readers))
        try:
            room = ggml.ggml_backend_buffer_get_size(remote.local)
            assert (8 * n * readers > room) == refused
            parsed = _parse(lib, remote.wire)
            with Scratch(ggml, len(parsed.tensors), len(parsed.node_index)) as scratch:
                try:
                    built = hg.build_graph_parts(lib, parsed, scratch, lib.op_enums)
                except Refused as exc:
                    assert refused, exc
                    assert "row ids" in str(exc) and exc.op == "SET_ROWS"
                    continue
                assert not refused
                copies = [f.snapshot for f in built.infos.made() if f.snapshot is not None]
                assert [len(c) for c in copies] == [8 * n]
        finally:
            remote.close()
            s.close()


def _set_rows_of_one_ids(g, ctx, rows):
    """SET_ROWS of one tensor of 8 I64 row ids (and 8 source rows) into a tensor of `r` rows,
    for each r of `rows` in turn."""
    b = g.ggml_new_tensor_2d(ctx, g.types["F32"], 1, 8)
    ids = g.ggml_new_tensor_1d(ctx, g.types["I64"], 8)
    graph = g.ggml_new_graph(ctx)
    for r in rows:
        into = g.ggml_new_tensor_2d(ctx, g.types["F32"], 1, r)
        g.ggml_build_forward_expand(graph, g.ggml_set_rows(ctx, into, b, ids))
    return graph, ids


def test_row_ids_many_nodes_read_are_read_once(guest, ggml, monkeypatch):
    """One tensor of row ids read by many nodes (each its own SET_ROWS, so no rule group
    shares the check) is copied once and its values read once: a graph of N readers of n ids
    would cost N * n before compute, outside the compute's time limit. Every reader's bound is still checked (a lower one refuses an id
    the others pass), and recorded for the cache's re-check."""
    from apir.host.graph.shapes import base

    lib = guest.ctx._library
    s = GgmlScratch(ggml, 256)
    graph, ids = _set_rows_of_one_ids(ggml, s.ctx, [4] * 40 + [2] + [4] * 5)
    remote = RemoteGraph(guest, ggml, s.ctx, graph)
    reads = []
    real = base.id_values
    monkeypatch.setattr(base, "id_values", lambda *a: reads.append(a[0].index) or real(*a))
    try:
        # (ids, the bounds of the readers that refuse them: None where all pass)
        for values, refused_by in (([0, 1] * 4, None), ([0, 1, 3, 0, 1, 0, 1, 0], {2}), ([4] + [0] * 7, {2, 4})):
            assert guest.set_tensor(remote.handle, remote.rpc(ids), np.array(values, np.int64).tobytes()) == 0
            parsed = _parse(lib, remote.wire)
            reads.clear()
            with Scratch(ggml, len(parsed.tensors), len(parsed.node_index)) as scratch:
                try:
                    built = hg.build_graph_parts(lib, parsed, scratch, lib.op_enums)
                except Refused as exc:
                    assert refused_by is not None and exc.op == "SET_ROWS", exc
                    assert int(parsed.tensors["ne"][exc.node][1]) in refused_by  # (a view of its rows)
                    continue
            assert refused_by is None
            (holder,) = [f for f in built.infos.made() if f.snapshot is not None]
            assert len(holder.read_by) == 46 and sorted(set(holder.id_bounds)) == [(False, 2), (False, 4)]
            assert len(reads) == 1
    finally:
        remote.close()
        s.close()
