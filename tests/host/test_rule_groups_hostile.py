"""rule_group_kernel's guess (the tensor after the last one matched, tried before
the hash), GraphWire.matches of a large graph, and check_nodes' group sizes
(group_sizes_kernel).

- rule_group_kernel and its Python twin against the definition (hostilekit.groups_by_definition)
  on adversarial graphs: guesses equal in the masked words but not in their sources (a source
  of another class, itself, a slot repeated, a source after its tensor, a difference only in
  the last slot), with the process's key and the worst key 1; its answer is idempotent (what
  check_nodes' fast path relies on), and its comparisons stay linear in the tensors on
  crafted graphs (a count, not a time).
- GraphWire.matches of a 4,097-record graph, on the accelerated and the plain path: every
  byte of the records in the middle and at both ends, the header, shorter sizes, trailing
  bytes, other alignments, a mismatch in either half only; a guest rewriting a read byte
  between two wrong values while it is compared never matches.
"""

from __future__ import annotations

import numpy as np
import pytest

from apir.host.graph import kernels as K
from apir.host.graph.kernels import TABLE_KEY, group_sizes_kernel, rule_group_kernel
from apir.codec.graph import parse_graph
from apir.codec.records import rpc_tensor_dtype
from apir.host.graph.cache import graph_wire
from tests.host.hostilekit import groups_by_definition, racing_guest
from tests.host.largekit import chain_wire



# --- rule_group_kernel's guess against the definition ----------------------------------------


def _groups(kernel, words, mask, src, key):
    keep = np.flatnonzero(mask)
    got = np.full(len(words), -7, np.int32)
    n_groups = kernel(words, keep, mask[keep], np.ascontiguousarray(src, np.int32), got, key)
    return got, n_groups


def _check_groups(words, mask, src, twins=(False, True)):
    """The kernel (and its twin) with both keys: the definition's groups, their count, and
    each tensor's representative its own (rep[rep] == rep, at or before it)."""
    want = groups_by_definition(words, mask, np.asarray(src, np.int32))
    for twin in twins:
        kernel = rule_group_kernel.py_func if twin else rule_group_kernel
        for key in (TABLE_KEY, 1):
            got, n_groups = _groups(kernel, words, mask, src, key)
            assert np.array_equal(got, want), (twin, key == 1, got.tolist(), want.tolist())
            assert n_groups == len(np.unique(want))
            assert (got[got] == got).all() and (got <= np.arange(len(got))).all()
    return want


_MASK = np.array([-1, 0, 0x0000FFFF00000000, -1], np.int64)


def _words(classes):
    """One row per tensor: masked words from its class letter, unmasked noise elsewhere."""
    rng = np.random.default_rng(len(classes))
    words = np.zeros((len(classes), 4), np.int64)
    for i, c in enumerate(classes):
        words[i, 0] = ord(c)
        words[i, 1] = int(rng.integers(1 << 62))  # unmasked
        words[i, 2] = (ord(c) << 32) | int(rng.integers(1 << 31))  # its low half unmasked
        words[i, 3] = -ord(c)
    return words


@pytest.mark.parametrize(
    "classes, src, apart",
    [
        # the guess (the tensor after the one like tensor i - 1) alike but for its source's class
        ("ABAB" + "X", [[-1], [0], [-1], [4], [-1]], [(1, 3)]),
        # the guess's source is itself, tensor i's another tensor of the same class (and back)
        ("PAPA", [[-1], [1], [-1], [2]], [(1, 3)]),
        ("PAPA", [[-1], [0], [-1], [3]], [(1, 3)]),
        ("PAPA", [[-1], [1], [-1], [1]], [(1, 3)]),  # its source the guess itself, alike by class
        # one source in two slots against two sources of one class
        ("PAPA", [[-1, -1], [0, 0], [-1, -1], [2, 0]], [(1, 3)]),
        # sources after their tensor (the parse refuses these; the kernel must still be exact)
        ("PAPAP", [[-1], [4], [-1], [0], [-1]], []),
        ("PAPAQ", [[-1], [2], [-1], [4], [-1]], [(1, 3)]),
        # a difference in the last of many slots only, and holes before a last source
        ("PAPA", [[0] + [-1] * 9, [-1] * 10, [2] + [-1] * 8 + [2], [-1] * 10], []),
        ("PAPA", [[-1] * 10, [0] + [-1] * 9, [-1] * 10, [2] + [-1] * 8 + [2]], [(1, 3)]),
        ("PAPA", [[-1] * 10, [-1, 0] + [-1] * 8, [-1] * 10, [2] + [-1] * 9], [(1, 3)]),
        # the guess a member (not the representative) of a group its tensor is not in
        ("PAPAPA", [[-1], [0], [-1], [2], [-1], [5]], [(3, 5), (1, 5)]),
        # a layer's guess chain broken and taken up again by the table
        ("ABCABCABC", [[-1], [0], [1], [-1], [3], [4], [-1], [5], [7]], [(4, 7), (1, 7)]),
    ],
)
def test_the_guess_never_joins_tensors_the_definition_keeps_apart(classes, src, apart):
    """Hand-made graphs where the guess (the tensor after the one tensor i - 1 matched) has
    tensor i's masked record but not its inputs: the definition's groups, and the pairs
    `apart` in different groups (a wrong group skips a shape rule a tensor needed)."""
    want = _check_groups(_words(classes), _MASK, src)
    for a, b in apart:
        assert want[a] != want[b], (a, b, want.tolist())


@pytest.mark.parametrize("twin", [False, True])
def test_group_kernel_matches_its_definition_on_adversarial_layers(twin):
    """Repeated layers (the guess right most of the time) with sources anywhere (after their
    tensor too), equal to their tensor, repeated in a later slot, a twin's self-source made a
    source on the tensor before it (or the reverse), masked words flipped now and then, up to 4
    slots: the definition's groups, idempotent, with the process's key and the worst key."""
    rng = np.random.default_rng(1010)
    mask = np.array([-1, 0, 0x0000FFFF00000000, -1, 0xFF], np.int64)
    for _ in range(60 if twin else 1200):
        period, layers = int(rng.integers(1, 7)), int(rng.integers(1, 8))
        n = period * layers + int(rng.integers(0, 3))
        slots = int(rng.integers(1, 5))
        base = rng.integers(0, 2, size=(period, 5)).astype(np.int64)
        words = np.tile(base, (layers + 2, 1))[:n].copy()
        words[:, 1] = rng.integers(1 << 62, size=n)
        words[:, 2] |= rng.integers(0, 2, size=n) * 0xFF  # unmasked bits of masked words
        words[:, 4] |= rng.integers(0, 2, size=n) << 9
        src = np.full((n, slots), -1, np.int32)
        for i in range(n):
            for k in range(slots):
                r = rng.random()
                if r < 0.3:
                    continue
                if r < 0.45:
                    src[i, k] = i
                elif r < 0.6 and k:
                    src[i, k] = src[i, int(rng.integers(k))]
                elif r < 0.75:
                    src[i, k] = int(rng.integers(n))
                else:
                    src[i, k] = int(rng.integers(max(0, i - period - 1), i + 1))
            if i >= period and rng.random() < 0.6:  # its twin's sources, a layer on
                twin_src = src[i - period]
                src[i] = np.where(twin_src >= 0, np.minimum(twin_src + period, n - 1), -1)
                if rng.random() < 0.3:
                    src[i, int(rng.integers(slots))] = i - period if rng.random() < 0.5 else i
        for i in np.flatnonzero(rng.random(n) < 0.15):
            words[i, int(rng.choice([0, 2, 3, 4]))] ^= np.int64(int(rng.choice([1, 1 << 33, 1 << 8, -(1 << 63)])))
        _check_groups(words, mask, src, twins=(twin,))


def _real_records(n):
    dt = rpc_tensor_dtype()
    t = np.zeros(n, dt)
    t["ne"], t["nb"] = [1, 1, 1, 1], [4, 4, 4, 4]
    return t, dt


def _crafted(n, slots):
    """Graphs of `n` tensors a guest may craft against the guess and the table."""
    rng = np.random.default_rng(3)
    out = {}
    t, _ = _real_records(n)
    t["op_params"][:, 0] = np.arange(n)
    out["all distinct"] = (t, np.full((n, slots), -1, np.int32))
    t, _ = _real_records(n)
    t["op_params"][:, 0] = np.arange(n) % 2
    out["two classes in turn"] = (t, np.full((n, slots), -1, np.int32))
    t, _ = _real_records(n)
    t["op_params"][: n // 2, 0] = np.arange(n // 2) + 1
    src = np.full((n, slots), -1, np.int32)
    src[n // 2 :, 0] = np.arange(n // 2)  # one class, each of another source class
    out["one class, distinct sources"] = (t, src)
    t, _ = _real_records(n)
    src = np.full((n, slots), -1, np.int32)
    for i in range(n):
        for k in range(slots):
            r = rng.random()
            if r < 0.3:
                continue  # none
            if r < 0.6:
                src[i, k] = i  # itself
            elif r < 0.8 and k:
                src[i, k] = src[i, int(rng.integers(k))]  # an earlier slot's again
            else:
                src[i, k] = int(rng.integers(n))  # anywhere
    out["one class, random slot patterns"] = (t, src)
    # n // 3 sources of distinct classes, then X, Y, X, Y, ...: each X like the first, so each
    # Y's guess is the first Y, alike in its record but not in its source (its last slot)
    t, _ = _real_records(n)
    m = n // 3
    t["op_params"][:m, 0] = np.arange(m) + 2
    t["op_params"][m:, 0] = -1 - (np.arange(n - m) % 2)
    src = np.full((n, slots), -1, np.int32)
    src[m + 1 :: 2, slots - 1] = np.arange(len(src[m + 1 :: 2])) % m
    out["every guess alike but in its last slot"] = (t, src)
    return out


def test_group_kernel_comparisons_stay_linear_on_crafted_graphs(monkeypatch):
    """The guess costs one comparison a tensor, the table a few: on graphs crafted against
    both (every guess wrong, every record distinct, one class with distinct inputs) the
    Python twin makes at most 6 comparisons a tensor with the process's key (counted, not
    timed)."""
    calls = {"row": 0, "inputs": 0}
    same_row, same_inputs = K._same_row, K._same_inputs

    def row(*a):
        calls["row"] += 1
        return same_row(*a)

    def inputs(*a):
        calls["inputs"] += 1
        return same_inputs(*a)

    monkeypatch.setattr(K, "_same_row", row)
    monkeypatch.setattr(K, "_same_inputs", inputs)
    from apir.host.graph import rule_memo

    n = 1500
    _, dt = _real_records(1)
    mask = rule_memo._mask(dt)
    slots = dt.fields["src"][0].shape[0]
    for name, (t, src) in _crafted(n, slots).items():
        calls.update(row=0, inputs=0)
        words = np.ascontiguousarray(t).view(np.int64).reshape(n, -1)
        got, _ = _groups(rule_group_kernel.py_func, words, mask, src, TABLE_KEY)
        assert calls["row"] <= 6 * n and calls["inputs"] <= 6 * n, (name, calls)
        jit, _ = _groups(rule_group_kernel, words, mask, src, TABLE_KEY)
        assert np.array_equal(got, jit), name


def test_group_sizes_of_the_kernels_answer_leave_no_tensor_unchecked():
    """check_nodes' fast path (every shared group passed) checks only the groups of one: a
    tensor is skipped only as a member of a representative that ran. group_sizes_kernel on
    rule_group_kernel's answers: the representatives in order, sizes summing to n, every
    tensor's representative listed."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        n = int(rng.integers(0, 60))
        words = _words("".join(rng.choice(list("ABC"), size=n)) if n else "")
        src = np.where(rng.random((n, 3)) < 0.5, rng.integers(0, max(n, 1), size=(n, 3)), -1).astype(np.int32)
        rep, _ = _groups(rule_group_kernel, words, _MASK, src, TABLE_KEY)
        reps, sizes = np.empty(n, np.int32), np.zeros(n, np.int32)
        reps = reps[: group_sizes_kernel(rep, reps, sizes)]
        assert np.array_equal(reps, np.flatnonzero(rep == np.arange(n)))
        assert np.array_equal(sizes, np.bincount(rep, minlength=n)) and sizes.sum() == n
        assert np.isin(rep, reps).all()


# --- GraphWire.matches in two parts -----------------------------------------------------------


_N = 4097  # records: odd, past the 2,048 at which the match was once split in two


def _read_offsets(rpc, name_len_r):
    """The record's byte offsets the host reads (by definition: every field but `padding`,
    not the holes between fields; the name up to and including its first NUL, at
    `name_len_r`)."""
    read = np.zeros(rpc.itemsize, bool)
    for field, (sub, at, *_) in rpc.fields.items():
        if field not in ("padding", "name"):
            read[at : at + sub.itemsize] = True
    name_at = rpc.fields["name"][1]
    read[name_at : name_at + name_len_r + 1] = True
    return read


@pytest.fixture(scope="module")
def large(ggml):
    raw = chain_wire(ggml, _N)
    parsed = parse_graph(raw, limits=ggml.limits, op_count=ggml.op_count, type_valid=ggml.valid_types)
    return raw, graph_wire(parsed), rpc_tensor_dtype(ggml.limits)


def test_every_byte_of_a_large_graph_is_in_the_match(large, host_path):
    """A 4,097-record graph's match: each byte of the header's ends and of records 0, 1,
    2047, 2048, 2049 and 4096 flipped: a mismatch exactly where the host reads; the graph at
    8 alignments and with trailing bytes matches, one byte short does not."""
    raw, wire, rpc = large
    assert wire.matches(raw, len(raw))
    for shift in range(8):
        buf = bytearray(shift) + raw + bytes(8)
        assert wire.matches(memoryview(buf)[shift:], len(raw))
        assert wire.matches(memoryview(buf)[shift:], len(raw) + 8)  # (trailing bytes: not read)
        assert not wire.matches(memoryview(buf)[shift:], len(raw) - 1)
    head = wire.head
    mem = bytearray(raw)
    for p in list(range(16)) + list(range(head - 16, head)):
        for flip in (0x01, 0x80):
            mem[p] ^= flip
            assert not wire.matches(mem, len(mem)), p
            mem[p] ^= flip
    for r in (0, 1, _N // 2 - 1, _N // 2, _N // 2 + 1, _N - 1):
        read = _read_offsets(rpc, len(f"t{r}"))
        at = head + r * rpc.itemsize
        for o in range(rpc.itemsize):
            mem[at + o] ^= 0x41
            assert wire.matches(mem, len(mem)) is not bool(read[o]), (r, o)
            mem[at + o] ^= 0x41
    assert wire.matches(mem, len(mem))


def test_a_mismatch_in_one_half_only(large, host_path):
    """A read byte changed in the first half of the records only, or in the second only: no
    match."""
    raw, wire, rpc = large
    type_at = rpc.fields["type"][1]
    for r in (5, _N - 5, _N // 2 - 1, _N // 2):
        mem = bytearray(raw)
        mem[wire.head + r * rpc.itemsize + type_at] ^= 0x04
        assert not wire.matches(mem, len(mem)), r


def test_a_guest_rewriting_read_bytes_with_wrong_values_never_matches(large, host_path):
    """While the graph is compared, a guest rewrites a byte the host reads, in the second
    half, in the first, or both, between two values neither of which is the graph's: no
    read ever sees the graph, so no match; bytes the host does not read (padding, after a
    name's NUL), rewritten in both halves: every match."""
    raw, wire, rpc = large
    head, size = wire.head, rpc.itemsize
    op_at, pad_at, name_at = rpc.fields["op"][1], rpc.fields["padding"][1], rpc.fields["name"][1]

    def at(r, o):
        return head + r * size + o

    def flips(r, o):
        v = raw[at(r, o)]
        return (at(r, o), v ^ 0x10, v ^ 0x20)

    cases = {
        "second half": ([flips(_N - 2, op_at), flips(_N // 2, op_at)], False),
        "first half": ([flips(1, op_at), flips(_N // 2 - 1, op_at)], False),
        "both": ([flips(3, op_at), flips(_N - 3, name_at)], False),
        "unread": ([flips(2, pad_at), flips(_N - 1, pad_at), flips(_N // 2, name_at + 20)], True),
    }
    for name, (spec, want) in cases.items():
        with racing_guest(raw, spec) as mem:
            seen = {wire.matches(mem, len(raw)) for _ in range(150)}
        assert seen == {want}, name
