"""Tensor names from a hostile guest, through every step that reads one: `_first_nul` (the first
NUL found 8 bytes at a time with the zero-byte word test, then byte by byte), the parse
(PARSE_NAME), the host's record checks (record_fields_kernel), the host tensor's name
(write_tensors_kernel) and the graph cache's key (record_key_kernel: a name cut after its NUL).
- `_first_nul` against a byte scan, jitted and plain Python: every 8-byte word over hostile
  bytes, 16-byte names with the NUL in the second word, structured names of every length
  around the word boundaries with the first NUL at each position (the borrow case included).
- The parse accepts exactly the names holding a NUL in the field, the parsed copy the bytes
  sent, for many max_name values; a guest flipping the name's only NUL while the parse runs:
  every accepted copy holds it.
- The host tensors' names are what ggml_set_name stores; a graph with hostile names computes
  ggml CPU's answer; record_fields_kernel is -1 exactly for a name without a NUL.
- graph_key and graph_wire group hostile name variants exactly by their bytes up to the NUL;
  GraphWire.matches agrees; record_key_kernel equals a brute-force cut at every offset.
- No byte past the name is read (a PROT_NONE page, in a child) by any of them.
- write_tensors_kernel's plain-Python twin runs on the int32 src indices the host passes.
Each test fails on at least one mutant of the word test (top byte lost, loads past n, the
field checked one byte short or long, junk kept in the key); the loads past n fail only the
PROT_NONE one.
"""

from __future__ import annotations

import itertools
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numba
import numpy as np
import pytest

from apir import accel
from apir.host.graph import kernels as K
from apir.codec import _kernels as CK
from apir.codec.graph import GraphError, parse_graph
from apir.codec.records import GgmlLimits, ggml_tensor_dtype, rpc_tensor_dtype
from apir.ggml.layout import tensor_record
from apir.host.graph import build as hg
from apir.host.graph import cache as graph_cache
from apir.host.graph.cache import graph_key, graph_wire
from tests.host.hostilekit import racing_guest
from tests.host.cachekit import GraphSession, direct_output, graph_inputs
from tests.host.hostkit import GgmlScratch
from tests.host.largekit import chain_wire

ROOT = Path(__file__).resolve().parents[2]

HOSTILE = (0x01, 0x7F, 0x80, 0x81, 0xFE, 0xFF)  # non-zero bytes the word test must not take for 0
LENGTHS = tuple(range(18)) + (23, 24, 25, 31, 32, 33, 63, 64, 65, 72)


@numba.njit(nogil=True)
def _scan_rows(base, stride, n, m, out):
    # the jitted _first_nul of each of m names of n bytes, `stride` bytes apart from `base`
    for i in range(m):
        out[i] = K._first_nul(base + i * stride, n)


@numba.njit(nogil=True)
def _scan_one(addr, n):
    return K._first_nul(addr, n)


def _byte_scan(names: np.ndarray) -> np.ndarray:
    """The first NUL of each row by definition (its length where none)."""
    n = names.shape[1]
    z = names == 0
    return np.where(z.any(axis=1), z.argmax(axis=1), n) if n else np.zeros(len(names), np.int64)


def _tails(b: int, k: int) -> list:
    # what follows the byte after a NUL: the background, 0x01s, 0x00 0x01 pairs, zeros
    return [np.full(k, b, np.uint8), np.full(k, 1, np.uint8), np.resize(np.array([0, 1], np.uint8), k),
            np.zeros(k, np.uint8)]


def _names(n: int) -> np.ndarray:
    """Structured names of `n` bytes (uint8[m, n]): for each position p of the first NUL,
    each hostile background byte, byte just before p, byte just after p (a hostile one or
    0x00) and tail (`_tails`); then names without a NUL: each background with each hostile
    byte pair at each position, and alternating patterns."""
    rows = []
    for p in range(n):
        for b, x, y in itertools.product(HOSTILE, HOSTILE, HOSTILE + (0,)):
            for tail in _tails(b, max(n - p - 2, 0)):
                a = np.full(n, b, np.uint8)
                if p > 0:
                    a[p - 1] = x
                a[p] = 0
                if p + 1 < n:
                    a[p + 1] = y
                    a[p + 2 :] = tail
                rows.append(a)
    for k in range(n):
        for b, x, y in itertools.product(HOSTILE, HOSTILE, HOSTILE):
            a = np.full(n, b, np.uint8)
            a[k] = x
            if k + 1 < n:
                a[k + 1] = y
            rows.append(a)
    for pair in ((0x80, 0x01), (0x01, 0x80), (0xFF, 0x01), (0x01, 0xFF), (0x7F, 0x81), (0x81, 0x7F)):
        rows.append(np.resize(np.array(pair, np.uint8), n))
    return np.array(rows, np.uint8).reshape(len(rows), n)


_NAMES = {}


def _names_cached(n: int) -> np.ndarray:
    if n not in _NAMES:
        _NAMES[n] = _names(n)
    return _NAMES[n]


def _laid_out(names: np.ndarray, shift: int, stride: int):
    """The names `stride` bytes apart from an address `shift` bytes past an 8-byte boundary,
    0xEE between them (a read past a name would see no NUL there)."""
    m, n = names.shape
    buf = np.full(shift + m * stride + 16, 0xEE, np.uint8)
    view = buf[shift : shift + m * stride].reshape(m, stride)
    view[:, :n] = names
    return buf, buf.ctypes.data + shift


# --- _first_nul against a byte scan ----------------------------------------------------------


def test_first_nul_jitted_on_every_word_of_hostile_bytes():
    """Every 8-byte word over {00 01 7F 80 81 FE FF}^8 (5,764,801 words: every borrow the word
    test can meet, 0x80 00.. (INT64_MIN) and 0x7F FF.. (INT64_MAX) among them), at an odd
    stride (each alignment): the jitted _first_nul is the byte scan."""
    s = np.array([0x00, 0x01, 0x7F, 0x80, 0x81, 0xFE, 0xFF], np.uint8)
    words = s[np.indices((7,) * 8).reshape(8, -1).T]
    rows = np.zeros((len(words), 9), np.uint8)
    rows[:, :8] = words
    out = np.empty(len(words), np.int64)
    _scan_rows(rows.ctypes.data, 9, 8, len(words), out)
    want = _byte_scan(words)
    assert np.array_equal(out, want)
    assert np.bincount(out).tolist() == [7**7] + [6**k * 7 ** (7 - k) for k in range(1, 8)] + [6**8]


def test_first_nul_twin_on_every_word_of_hostile_bytes():
    """The plain-Python _first_nul (the twins', where load_i64 is exact in [-2**63, 2**63) and
    `v - 0x01..01` may go below -2**63) on every word over {00 01 80 FF}^8; the word test
    itself, as Python ints, is non-zero exactly for the words holding a 0 byte."""
    s = np.array([0x00, 0x01, 0x80, 0xFF], np.uint8)
    words = np.ascontiguousarray(s[np.indices((4,) * 8).reshape(8, -1).T])
    base = words.ctypes.data
    got = np.array([K._first_nul(base + 8 * i, 8) for i in range(len(words))])
    assert np.array_equal(got, _byte_scan(words))
    values = words.view("<i8").ravel().tolist()
    test = [bool((v - CK._ONES) & ~v & CK._HIGHS) for v in values]
    assert test == (words == 0).any(axis=1).tolist()
    assert min(values) == -(1 << 63) and sum(test) == 4**8 - 3**8


def test_first_nul_in_the_second_word_after_a_hostile_first():
    """16-byte names, the first word without a NUL over {01 7F 80 FF}^8 (65,536 words), the
    second word 0x01s or 0x80s with its NUL at each byte: the jitted _first_nul is 8 + that
    byte; without a NUL in either word, 16."""
    s = np.array([0x01, 0x7F, 0x80, 0xFF], np.uint8)
    first = s[np.indices((4,) * 8).reshape(8, -1).T]
    out = np.empty(len(first), np.int64)
    for fill in (0x01, 0x80):
        for j in list(range(8)) + [None]:
            rows = np.full((len(first), 16), fill, np.uint8)
            rows[:, :8] = first
            if j is not None:
                rows[:, 8 + j] = 0
            _scan_rows(rows.ctypes.data, 16, 16, len(rows), out)
            assert (out == (16 if j is None else 8 + j)).all(), (fill, j)


def test_first_nul_on_structured_names_of_every_length():
    """Every family of `_names` for n = 0..17, 23..25, 31..33, 63..65, 72, at each of the 8
    alignments (jitted) and one (twin): the byte scan's answer, n where there is no NUL."""
    total = 0
    for n in LENGTHS:
        names = _names_cached(n)
        want = _byte_scan(names)
        for shift in range(8):
            buf, base = _laid_out(names, shift, n + 8)
            out = np.empty(len(names), np.int64)
            _scan_rows(base, n + 8, n, len(names), out)
            assert np.array_equal(out, want), (n, shift)
        buf, base = _laid_out(names, 3, n + 8)
        step = 1 if n <= 17 else 7  # (the twin: every 7th name of the long ones)
        got = [K._first_nul(base + i * (n + 8), n) for i in range(0, len(names), step)]
        assert got == want[::step].tolist(), n
        total += len(names)
        if n:
            assert set(want.tolist()) == set(range(n + 1)), n  # (every position, and none)
    assert total > 300_000


def test_first_nul_agrees_with_copy_name():
    """_copy_name (the guest's snprintf of a name, whose word test _first_nul took) copies
    exactly min(_first_nul, max_name - 1) bytes, then zeros, on the structured 64-byte names
    (its word path) and 13-byte ones (its byte path), jitted and twin."""

    @numba.njit
    def copy_all(src, stride, n, m, dst):
        for i in range(m):
            CK._copy_name(src + i * stride, dst + i * n, n)

    for n in (64, 13):
        names = np.ascontiguousarray(_names_cached(n))
        first = np.minimum(_byte_scan(names), n - 1)
        want = np.where(np.arange(n)[None, :] < first[:, None], names, 0).astype(np.uint8)
        dst = np.zeros_like(names)
        copy_all(names.ctypes.data, n, n, len(names), dst.ctypes.data)
        assert np.array_equal(dst, want), n
        dst = np.zeros_like(names)
        for i in range(0, len(names), 11):
            CK._copy_name(names.ctypes.data + i * n, dst.ctypes.data + i * n, n)
        assert np.array_equal(dst[::11], want[::11]), n


# --- the parse ---------------------------------------------------------------------------------


def _kw(g, limits=None):
    return dict(limits=limits or g.limits, op_count=g.op_count, type_valid=g.valid_types)


def _names_wire(g, names: np.ndarray, limits=None, padding: int = 0) -> bytes:
    """A graph of one record per name (ids 16, 32, ..., the first valid type, op NONE, no
    sources), its last tensor the one node, `padding` in every padding byte."""
    rpc = rpc_tensor_dtype(limits or g.limits)
    n = len(names)
    recs = np.zeros(n, rpc)
    recs["id"] = np.arange(1, n + 1) * 16
    recs["type"] = int(np.flatnonzero(g.valid_types)[0])
    recs["name"].view(np.uint8).reshape(n, -1)[:] = names
    recs["padding"].view(np.uint8).reshape(n, -1)[:] = padding
    return struct.pack("<IQI", 1, n * 16, n) + recs.tobytes()


def _parsed_names(p) -> np.ndarray:
    return p.tensors["name"].view(np.uint8).reshape(len(p.tensors), -1)


@pytest.mark.parametrize("twin", [False, True])
def test_parse_accepts_exactly_the_names_with_a_nul(ggml, twin):
    """Every structured 64-byte name holding a NUL (64,512, in one graph; the twin every 9th)
    is accepted and parsed to the bytes sent, padding 0xFF or 0; every one without (13,830, the
    twin every 9th), alone in the field or followed by a 0 in `padding`, is refused as
    tensor 1 of a three-record graph: "tensor 1: name is not NUL-terminated"."""
    kernel = CK.parse_graph_kernel.py_func if twin else None
    names = _names_cached(64)
    nul = (names == 0).any(axis=1)
    ok, bad = names[nul], names[~nul]
    step = 9 if twin else 1
    ok, bad = ok[::step], bad[::step]
    for padding in (0xFF, 0):
        p = parse_graph(_names_wire(ggml, ok, padding=padding), **_kw(ggml), _kernel=kernel)
        assert p.n_tensors == len(ok) and np.array_equal(_parsed_names(p), ok)
    good = np.full((1, 64), ord("n"), np.uint8)
    good[0, 63] = 0
    refused = 0
    for i, name in enumerate(bad):
        wire = _names_wire(ggml, np.concatenate([good, name[None], good]), padding=0 if i % 2 else 0xFF)
        with pytest.raises(GraphError, match=r"^tensor 1: name is not NUL-terminated$"):
            parse_graph(wire, **_kw(ggml), _kernel=kernel)
        refused += 1
    assert len(ok) == (64 * 6 * 6 * 7 * 4 + step - 1) // step and refused == (64 * 216 + 6 + step - 1) // step


@pytest.mark.parametrize("max_name", [1, 2, 3, 5, 7, 8, 9, 12, 15, 16, 17, 23, 24, 25, 63, 65])
def test_parse_names_of_other_lengths(ggml, max_name):
    """ggml built with another GGML_MAX_NAME (records of 241 .. 305 bytes, names at any
    alignment): each structured name is accepted exactly when it holds a NUL, jitted and twin
    (every 13th), and parsed to the bytes sent."""
    limits = GgmlLimits(max_name=max_name)
    names = _names_cached(max_name)
    nul = (names == 0).any(axis=1)
    ok = names[nul]
    p = parse_graph(_names_wire(ggml, ok, limits, 0xFF), **_kw(ggml, limits))
    assert np.array_equal(_parsed_names(p), ok)
    q = parse_graph(_names_wire(ggml, ok[::13], limits, 0xFF), **_kw(ggml, limits),
                    _kernel=CK.parse_graph_kernel.py_func)
    assert np.array_equal(_parsed_names(q), ok[::13])
    bad = names[~nul]
    for i, name in enumerate(bad[:: max(1, len(bad) // 150)]):
        wire = _names_wire(ggml, np.concatenate([ok[:1], name[None]]), limits, 0)
        for kernel in (None, CK.parse_graph_kernel.py_func) if i % 10 == 0 else (None,):
            with pytest.raises(GraphError, match=r"^tensor 1: name is not NUL-terminated$"):
                parse_graph(wire, **_kw(ggml, limits), _kernel=kernel)
    assert len(ok) == max_name * 6 * 6 * 7 * 4 and len(bad) == max_name * 216 + 6


def test_a_guest_flipping_the_names_only_nul_during_the_parse(ggml):
    """The last name's only possible NUL (its byte 63, the other 63 bytes 0x80 / 0x01, of the
    last of 64 records) rewritten between 0 and 0x01 by a guest thread while 1,500 parses
    or more run (until both outcomes were seen): each refuses, or accepts a copy holding that
    NUL (the check reads the host's copy)."""
    names = np.resize(np.array([0x80, 0x01], np.uint8), (64, 64)).copy()
    names[:, 63] = 0
    wire = _names_wire(ggml, names)
    rpc = rpc_tensor_dtype(ggml.limits)
    at = len(wire) - rpc.itemsize + rpc.fields["name"][1] + 63  # the last record's name byte 63
    outcomes = {"accepted": 0, "refused": 0}
    deadline = time.monotonic() + 30  # (on a loaded machine the guest thread may wait for a core)
    with racing_guest(wire, [(at, 0, 1)]) as mem:
        while sum(outcomes.values()) < 1500 or (min(outcomes.values()) == 0 and time.monotonic() < deadline):
            try:
                p = parse_graph(mem, **_kw(ggml))
            except GraphError as exc:
                assert str(exc) == "tensor 63: name is not NUL-terminated"
                outcomes["refused"] += 1
                continue
            last = _parsed_names(p)[-1]
            assert last[63] == 0 and (last[:63] != 0).all()
            outcomes["accepted"] += 1
    assert min(outcomes.values()) > 0, outcomes  # (both were seen)


# --- the host tensors --------------------------------------------------------------------------


@pytest.fixture
def session(guest, ggml):
    s = GraphSession(guest, ggml)
    s.set_inputs(graph_inputs(5))
    yield s
    s.close()


def _set_name_reference(g, names: np.ndarray) -> list:
    """What ggml_set_name stores in a fresh tensor's 64-byte name for each name's bytes up to
    its first NUL (all 64 when none: ggml keeps 63)."""
    s = GgmlScratch(g, len(names) + 4)
    try:
        out = []
        dtype = g.tensor_dtype
        for name in names:
            t = g.ggml_new_tensor_1d(s.ctx, g.types["F32"], 1)
            g.ggml_set_name(t, bytes(name).split(b"\0")[0])
            out.append(tensor_record(t, dtype)["name"].tobytes())
        return out
    finally:
        s.close()


def _hostile_names(n_tensors: int, round_: int) -> np.ndarray:
    """One 64-byte name per tensor of a graph, round `round_` of 64: tensor i's first NUL at
    byte (round_ + 5 * i) % 64, hostile bytes before it (from the round), junk after it (0x01
    right after, 0x00 0x01, 0xFF...); the last round's last tensor's NUL at byte 63."""
    rng = np.random.default_rng(round_)
    names = rng.choice(np.array(HOSTILE, np.uint8), (n_tensors, 64))
    for i in range(n_tensors):
        p = (round_ + 5 * i) % 64
        names[i, p] = 0
        tail = _tails(int(names[i, 0]), 64)[(round_ + i) % 4]
        names[i, p + 1 :] = tail[: 63 - p]
        if p + 1 < 64 and i % 3 == 0:
            names[i, p + 1] = 0x01  # the borrow case: 0x01 right after the NUL
    return names


@pytest.mark.parametrize("twin", [False, True])
def test_host_tensor_names_are_what_ggml_set_name_stores(session, ggml, monkeypatch, twin):
    """The graph's records renamed with `_hostile_names` (the first NUL at every byte of a
    name over the rounds, hostile bytes around it), parsed and built (build_graph_parts,
    write_tensors_kernel jitted or twin): each host tensor's name is, byte for byte, what
    ggml_set_name stores in a fresh tensor; the rest of each host tensor is the build of the
    graph as sent."""
    if twin and not accel.enabled():
        pytest.skip("the kernels are off: no twin to swap in")
    if twin:  # (src and view_src as int64: the twin fails on the int32 ones, see the BUG test below)
        def twin_kernel(*args):
            args = list(args)
            args[-4], args[-3] = args[-4].astype(np.int64), args[-3].astype(np.int64)
            return K.write_tensors_kernel.py_func(*args)

        monkeypatch.setattr(hg, "write_tensors_kernel", twin_kernel)
    lib = session.guest.ctx._library
    dtype = lib.checker.tensor_dtype
    n_nodes, recs = session.records()
    plain = None
    positions = set()
    for round_ in range(0, 64, 2 if twin else 1):
        names = _hostile_names(len(recs), round_)
        positions |= set(_byte_scan(names).tolist())
        r = recs.copy()
        r["name"].view(np.uint8).reshape(len(r), -1)[:] = names
        parsed = parse_graph(session.wire_with(r), limits=lib.g.limits, op_count=lib.g.op_count,
                             type_valid=lib.checker.valid_types)
        with hg.graph_scratch(lib, parsed) as scratch:
            built = hg.build_graph_parts(lib, parsed, scratch, lib.op_enums)
            got = [tensor_record(int(a), dtype)["name"].tobytes() for a in built.host]
            rest = []
            for a in built.host:
                rec = tensor_record(int(a), dtype)
                rest.append(tuple(rec[f].tobytes() for f in ("type", "ne", "nb", "op", "op_params", "flags")))
        assert got == _set_name_reference(ggml, names), round_
        if plain is None:
            plain = rest
        assert rest == plain
    assert positions == set(range(64))


def test_a_graph_with_hostile_names_computes_ggmls_answer(session, ggml):
    """The graph sent with hostile names (NUL at bytes 0, 7, 8, 31, 63 of its records' names,
    junk after it, a new junk each time): computed on the host, ggml CPU's answer each time."""
    want = direct_output(ggml, graph_inputs(5))
    n_nodes, recs = session.records()
    for round_ in (0, 7, 8, 31, 63, 0):
        r = recs.copy()
        r["name"].view(np.uint8).reshape(len(r), -1)[:] = _hostile_names(len(r), round_)
        rc, status = session.compute(session.wire_with(r))
        assert (rc, status) == (0, 0), round_
        assert session.output() == want, round_


# --- the record checks -------------------------------------------------------------------------


def _fields_args(lib, rows: np.ndarray):
    chk = lib.checker
    rpc = rows.dtype
    f = rpc.fields
    off = np.array([f[k][1] for k in ("type", "op", "ne", "nb", "name", "data", "view_offs", "buffer")], np.int64)
    n = len(rows)
    arrays = [np.zeros(n, np.int64) for _ in range(5)] + [np.zeros(n, np.float64), np.zeros(n, np.int64)]
    return (rows.ctypes.data, n, rpc.itemsize, off, 4, f["name"][0].itemsize, chk.valid_types.astype(np.uint8),
            chk.custom_op_mask[: chk.g.op_count].astype(np.uint8), chk.type_size_arr, chk.blck_size_arr,
            *arrays, K.TABLE_KEY)


def test_record_checks_refuse_exactly_the_names_without_a_nul(guest, ggml):
    """record_fields_kernel on one valid F32 record per structured 64-byte name: -1 exactly for
    a name without a NUL (padding 0: a NUL right after the field), else 1 handle; jitted for
    all 78,342 names, twin for every 17th; on all names at once, -1 (some have none) and 1
    for those with one."""
    lib = guest.ctx._library
    names = _names_cached(64)
    rpc = rpc_tensor_dtype(ggml.limits)
    rows = np.zeros(len(names), rpc)
    rows["type"], rows["ne"], rows["nb"], rows["buffer"] = ggml.types["F32"], [1, 1, 1, 1], [4, 4, 4, 4], 7
    rows["name"].view(np.uint8).reshape(len(rows), -1)[:] = names
    has = (names == 0).any(axis=1)
    got = np.array([K.record_fields_kernel(*_fields_args(lib, rows[i : i + 1])) for i in range(len(rows))])
    assert np.array_equal(got, np.where(has, 1, -1))
    twin = [K.record_fields_kernel.py_func(*_fields_args(lib, rows[i : i + 1])) for i in range(0, len(rows), 17)]
    assert twin == got[::17].tolist()
    assert K.record_fields_kernel(*_fields_args(lib, rows)) == -1
    assert K.record_fields_kernel(*_fields_args(lib, np.ascontiguousarray(rows[has]))) == 1
    assert (~has).sum() == 64 * 216 + 6


# --- the cache key ------------------------------------------------------------------------------


def _key_variants() -> list:
    """64-byte names: prefixes (hostile bytes, lengths 0..63) and their near misses (last or
    first byte changed, one byte shorter), each followed by a NUL and each of 5 junk tails."""
    rng = np.random.default_rng(12)
    prefixes = set()
    for length in (0, 1, 2, 3, 6, 7, 8, 9, 10, 15, 16, 17, 23, 24, 25, 31, 32, 33, 47, 55, 56, 57, 61, 62, 63):
        base = bytes(rng.choice(np.array(HOSTILE, np.uint8), length).tolist())
        prefixes |= {base, base[:-1]}
        if length:
            prefixes.add(base[:-1] + bytes([base[-1] ^ 0xFE or 1]))
            prefixes.add(bytes([base[0] ^ 0x81 or 1]) + base[1:])
    names = []
    for prefix in sorted(prefixes):
        room = 63 - len(prefix)
        for tail in (b"", b"\x01" * room, b"\x00\x01" * 32, b"\xff" * room, bytes(rng.integers(0, 256, room).tolist())):
            names.append((prefix, (prefix + b"\0" + tail)[:64].ljust(64, b"\0")))
    return names


@pytest.mark.parametrize("twin", [False, True])
def test_graph_key_groups_names_exactly_by_their_bytes_up_to_the_nul(ggml, monkeypatch, twin):
    """A three-tensor chain whose middle tensor takes each of ~475 names of `_key_variants`
    (and the last one the reverse list's): graph_key and graph_wire's bytes are equal exactly
    when both names are equal up to their NUL (the junk after it is cut; a byte or a length
    before it differs: another key), with record_key_kernel jitted or twin; GraphWire.matches
    of one variant's wire on another's bytes agrees."""
    if twin and not accel.enabled():
        pytest.skip("the kernels are off: no twin to swap in")
    if twin:
        monkeypatch.setattr(graph_cache, "record_key_kernel", K.record_key_kernel.py_func)
    variants = _key_variants()
    base = chain_wire(ggml, 3)
    rpc = rpc_tensor_dtype(ggml.limits)
    head = 8 + 8 * 2
    keys, wires, raws, prefixes = {}, {}, [], []
    for k, (prefix, name) in enumerate(variants):
        other_prefix, other = variants[-1 - k]
        recs = np.frombuffer(base, rpc, 3, head).copy()
        recs["name"][1] = np.frombuffer(name, "S1")
        recs["name"][2] = np.frombuffer(other, "S1")
        raw = base[:head] + recs.tobytes()
        p = parse_graph(raw, **_kw(ggml))
        keys.setdefault(graph_key(p), set()).add((prefix, other_prefix))
        w = graph_wire(p)
        wires.setdefault(w.data.tobytes(), set()).add((prefix, other_prefix))
        raws.append((w, raw))
        prefixes.append((prefix, other_prefix))
    distinct = set(prefixes)
    assert len(keys) == len(distinct) and all(len(v) == 1 for v in keys.values())
    assert len(wires) == len(distinct) and all(len(v) == 1 for v in wires.values())
    assert len(variants) == 475 and len(distinct) == len(variants) // 5
    step = 1 if not twin else 3
    hits = 0
    for i in range(0, len(raws), step):
        for j in range(max(0, i - 12), min(len(raws), i + 12)):
            got = raws[i][0].matches(raws[j][1], len(raws[j][1]))
            assert got is (prefixes[i] == prefixes[j]), (i, j)
            hits += got
    assert hits > len(raws) // step * 4


def test_record_key_kernel_cuts_at_the_first_nul_at_every_offset_and_length():
    """record_key_kernel on records of name_at + n + 3 bytes (names at offsets 0..9, lengths
    0..17, 64) holding the structured names, mask 0xFF: each row kept, its name zeroed after
    its first NUL (whole without one), jitted for all and twin for every 29th row."""
    checked = 0
    for n in tuple(range(18)) + (64,):
        names = _names_cached(n)
        for name_at in (0, 1, 3, 7, 8, 9) if n in (5, 8, 9, 16, 64) else (3,):
            size = name_at + n + 3
            rows = np.full((len(names), size), 0xA5, np.uint8)
            rows[:, name_at : name_at + n] = names
            first = _byte_scan(names)
            want = rows.copy()
            cut = np.arange(n)[None, :] > first[:, None]
            want[:, name_at : name_at + n][cut] = 0
            mask = np.full(size, 0xFF, np.uint8)
            out = np.full(rows.size, 0xEE, np.uint8)
            assert K.record_key_kernel(rows, mask, name_at, n, out) == 0
            assert np.array_equal(out.reshape(rows.shape), want), (n, name_at)
            sub = np.ascontiguousarray(rows[::29])
            out = np.full(sub.size, 0xEE, np.uint8)
            assert K.record_key_kernel.py_func(sub, mask, name_at, n, out) == 0
            assert np.array_equal(out.reshape(sub.shape), want[::29]), (n, name_at)
            checked += len(rows)
    assert checked > 200_000


# --- no read past the name ---------------------------------------------------------------------


_GUARD_CHILD = textwrap.dedent(
    """
    import ctypes, mmap, struct, sys
    sys.path.insert(0, sys.argv[1])
    import numba
    import numpy as np
    from apir.host.graph import kernels as K
    from apir.codec import _kernels as CK
    from apir.codec.graph import GraphError, parse_graph
    from apir.codec.records import GgmlLimits, ggml_tensor_dtype, rpc_tensor_dtype
    from apir.host.graph import build as hg

    @numba.njit
    def first_nul(addr, n):
        return K._first_nul(addr, n)

    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    mm = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE: the second page
    guard = base + page
    done = 0
    patterns = [b"\\x01", b"\\x80", b"\\xff", b"\\x80\\x01", b"\\x01\\x80", b"\\x7f"]

    # _first_nul: n bytes ending at the guard, no NUL (read to the end) or the NUL last
    for n in list(range(18)) + [23, 24, 25, 31, 32, 33, 63, 64, 65, 72]:
        for pat in patterns:
            name = (pat * n)[:n]
            mm[page - n : page] = name
            assert first_nul(guard - n, n) == n and K._first_nul(guard - n, n) == n
            if n:
                mm[page - 1] = 0
                assert first_nul(guard - n, n) == n - 1 and K._first_nul(guard - n, n) == n - 1
            done += 1

    # record_key_kernel: k records whose name is their last n bytes, the last one at the guard
    for n in list(range(1, 18)) + [64]:
        size, k = n + 8, 3
        rows = np.frombuffer(mm, np.uint8, k * size, page - k * size).reshape(k, size)
        rows[:] = 0x80
        rows[0, 8 + n // 2] = 0
        mask = np.full(size, 0xFF, np.uint8)
        for fn in (K.record_key_kernel, K.record_key_kernel.py_func):
            out = np.zeros(k * size, np.uint8)
            assert fn(rows, mask, 8, n, out) == 0
            want = rows.copy()
            want[0, 8 + n // 2 + 1 :] = 0
            assert np.array_equal(out.reshape(k, size), want)
        done += 1

    # record_fields_kernel and write_tensors_kernel: a record whose name ends at the guard
    # (its padding, which neither reads, past it)
    rpc = rpc_tensor_dtype()
    name_at = rpc.fields["name"][1]
    r_addr = guard - (name_at + 64)
    head = np.frombuffer(mm, np.uint8, name_at + 64, page - (name_at + 64))
    rec = np.zeros(1, rpc)
    rec["type"], rec["ne"], rec["nb"], rec["buffer"] = 0, [1, 1, 1, 1], [4, 4, 4, 4], 7
    off = np.array([rpc.fields[f][1] for f in ("type", "op", "ne", "nb", "name", "data", "view_offs", "buffer")])
    tl = ggml_tensor_dtype()
    w_off, roff, width = hg._kernel_layout(tl, rpc, 10)
    for name, want in ((b"\\x80\\x01" * 32, -1), (b"\\x01" * 63 + b"\\0", 1), (b"\\xff" * 64, -1)):
        head[:] = np.frombuffer(rec.tobytes()[: name_at + 64], np.uint8)
        mm[page - 64 : page] = name
        for fn in (K.record_fields_kernel, K.record_fields_kernel.py_func):
            arrays = [np.zeros(1, np.int64) for _ in range(5)] + [np.zeros(1), np.zeros(1, np.int64)]
            got = fn(r_addr, 1, rpc.itemsize, off.astype(np.int64), 4, 64, np.ones(40, np.uint8),
                     np.zeros(100, np.uint8), np.full(40, 4, np.int64), np.ones(40, np.int64), *arrays, K.TABLE_KEY)
            assert got == want, (name, got)
        for fn in (K.write_tensors_kernel, K.write_tensors_kernel.py_func):
            block = np.full(tl.itemsize, 0xEE, np.uint8)
            host = np.zeros(1, np.int64)
            fn(block.ctypes.data, tl.itemsize, w_off, r_addr, rpc.itemsize, roff, width, np.zeros(1, np.int64),
               np.zeros(1, np.int64), np.array([5], np.int64), np.array([4096], np.int64), np.zeros(1, np.int64),
               np.full((1, 10), -1, np.int32), np.full(1, -1, np.int32), host, np.zeros(1, np.int32))
            got = np.frombuffer(block.tobytes(), tl)[0]["name"].tobytes()
            assert got == name.split(b"\\0")[0].ljust(64, b"\\0"), (name, got)
        done += 1

    # the parse of a graph ending at the guard: its last name's NUL last, in its padding, none
    for max_name in (64, 13, 8):
        lim = GgmlLimits(max_name=max_name)
        r = rpc_tensor_dtype(lim)
        recs = np.zeros(2, r)
        recs["id"] = [16, 32]
        recs["type"] = 0
        for last, pad, ok in ((b"\\x80" * (max_name - 1) + b"\\0", 0xFF, True), (b"\\x01" * max_name, 0, False),
                              (b"\\xff" * max_name, 0xFF, False)):
            recs["name"][1] = np.frombuffer(last, "S1")
            recs["padding"].view(np.uint8)[:] = pad
            raw = struct.pack("<IQI", 1, 32, 2) + recs.tobytes()
            at = page - len(raw)
            mm[at:page] = raw
            for kern in (None, CK.parse_graph_kernel.py_func):
                view = memoryview(mm)[at:page]
                try:
                    p = parse_graph(view, limits=lim, op_count=100, type_valid=np.ones(40, bool), _kernel=kern)
                    got = p.tensors["name"][1].tobytes() == last
                except GraphError as exc:
                    got = str(exc)
                view.release()
                assert got is True if ok else got == "tensor 1: name is not NUL-terminated", (max_name, last, got)
            done += 1
    print("OK", done, flush=True)
    if len(sys.argv) > 2:  # the guard is real: one byte past the name faults
        ctypes.string_at(guard, 1)
    """
)


def test_nothing_past_a_name_is_read(ggml):
    """Names (or records, or a graph) ending exactly at a PROT_NONE page, in a child process:
    _first_nul (every length 0..17 and 23..72's edges, six hostile patterns), record_key_kernel,
    record_fields_kernel, write_tensors_kernel and the parse, jitted and twin, answer without a
    fault; the guard does fault on the next byte."""
    res = subprocess.run([sys.executable, "-c", _GUARD_CHILD, str(ROOT)], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0 and res.stdout.strip() == "OK 198", (res.returncode, res.stdout, res.stderr[-3000:])
    probe = subprocess.run([sys.executable, "-c", _GUARD_CHILD, str(ROOT), "probe"], capture_output=True, text=True,
                           timeout=240)
    assert probe.returncode < 0 and probe.stdout.strip() == "OK 198", (probe.returncode, probe.stdout)


# --- write_tensors_kernel's twin ---------------------------------------------------------------


def test_write_tensors_twin_runs_on_the_int32_src_indices_the_host_passes():
    """write_tensors_kernel.py_func (its twin) on two records, tensor 1's src[0] tensor 0, with
    src / view_src int32 as apir.host.graph.build._create_tensors passes them: both the jitted kernel
    and the twin store tensor 0's address. The twin raised OverflowError at `base + j * stride`
    while j was a numpy int32 (under NumPy 2's promotion rules, NEP 50, the Python int `base`,
    a heap address over 2**31, was cast to int32): harmless in production (the host runs the
    jitted kernel), but the twin could not run a graph with any source or view. The indices
    are now taken as int."""
    rpc, tl = rpc_tensor_dtype(), ggml_tensor_dtype()
    off, roff, width = hg._kernel_layout(tl, rpc, 10)
    recs = np.zeros(2, rpc)
    recs["name"][:, 0] = b"a"
    src = np.full((2, 10), -1, np.int32)
    src[1, 0] = 0
    view_src = np.full(2, -1, np.int32)
    got = []
    for fn in (K.write_tensors_kernel, K.write_tensors_kernel.py_func):
        block = np.zeros(2 * tl.itemsize, np.uint8)
        host, uses = np.zeros(2, np.int64), np.zeros(2, np.int32)
        assert block.ctypes.data > 1 << 31
        try:
            fn(block.ctypes.data, tl.itemsize, off, recs.ctypes.data, rpc.itemsize, roff, width, np.zeros(2, np.int64),
               np.zeros(2, np.int64), np.array([5], np.int64), np.array([4096], np.int64), np.zeros(2, np.int64), src,
               view_src, host, uses)
        except OverflowError as exc:
            got.append(f"OverflowError: {exc}")
            continue
        out = np.frombuffer(block.tobytes(), tl)
        got.append((int(out[1]["src"][0]) - block.ctypes.data, out[1]["name"].tobytes()[:2], uses.tolist()))
    assert got[0] == (0, b"a\0", [1, 0])
    assert got[1] == got[0], got[1]
