"""parse_graph (apir.codec.graph) and the graph cache's byte match (GraphWire.matches) on
hostile graphs.
- parse_graph_kernel against the one-pass kernel it replaced (read from git history) on random
  graphs with sources before, after (shuffled DAGs) and at their tensor, unknown, zero,
  duplicated and high-bit ids, bad types / ops / names: the same error text, or the same
  indices and order; never a _LATER (-2) left in an accepted graph; jitted and twin.
- the second pass under a racing guest: a graph whose sources all come after their tensor
  (reversed C order), a guest thread flipping a src / view_src id to an unknown id, the
  tensor itself, a later tensor: what is kept parses again to the same links.
- GraphWire.matches against a brute-force definition (header, masked record bytes, each name
  up to its first NUL; a name without NUL never matches), at every alignment, after multi-byte
  name rewrites and random flips; a match also means an equal parse and an equal graph_key;
  graph_key equal exactly when a brute-force key is.
- GraphWire.matches on a graph that ends at a PROT_NONE guard page (in a child process): no
  byte past `size` is read, whatever the name lengths.
"""

import importlib.util
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from apir.codec import _kernels as CK
from apir.codec.graph import GraphError, parse_graph
from apir.codec.records import rpc_tensor_dtype
from apir.host.graph.cache import _key_mask, graph_key, graph_wire
from tests.host.hostilekit import racing_guest

ROOT = Path(__file__).resolve().parents[2]


def _kw(g):
    return dict(limits=g.limits, op_count=g.op_count, type_valid=g.valid_types)


def _parent_kernel(tmp_path_factory):
    try:
        src = subprocess.run(["git", "show", "e6d7da8~1:apir/codec/_kernels.py"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history here")
    path = tmp_path_factory.mktemp("parent") / "kernels_parent_e6d7da8.py"
    path.write_bytes(src)
    spec = importlib.util.spec_from_file_location("kernels_parent_e6d7da8", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.parse_graph_kernel


def _random_graph(rng, g, valid_types):
    """Wire bytes of a random graph: mostly valid DAGs (sources before their tensor, or a
    shuffled DAG: sources after), sometimes a self source, a cycle, an unknown / zero /
    duplicated id, a bad type / op / name."""
    rpc = rpc_tensor_dtype(g.limits)
    S = g.limits.max_src
    n = int(rng.integers(1, 14))
    ids = rng.choice(np.arange(1, 60), n, replace=False).astype(np.uint64) * np.uint64(rng.choice([1, 4096, 1 << 40]))
    if rng.random() < 0.3:
        ids |= np.uint64(1 << 63)
    if rng.random() < 0.04:
        ids[rng.integers(n)] = 0
    if rng.random() < 0.04 and n > 1:
        ids[rng.integers(n)] = ids[rng.integers(n)]
    good = np.flatnonzero(valid_types)
    recs = np.zeros(n, rpc)
    recs["id"] = ids
    recs["type"] = good[rng.integers(0, min(4, good.size), n)]
    recs["op"] = rng.integers(0, 5, n)
    names = recs["name"].view(np.uint8).reshape(n, -1)
    names[:] = rng.integers(0, 256, names.shape)
    for i in range(n):
        names[i, rng.integers(0, names.shape[1])] = 0
    mode = rng.random()
    rank = rng.permutation(n) if mode < 0.35 else np.arange(n)  # topological rank of each record
    for i in range(n):
        lower = [j for j in range(n) if rank[j] < rank[i]] if mode < 0.7 else list(range(n))
        for s in range(S):
            if rng.random() < 0.2 and lower:
                recs["src"][i, s] = ids[rng.choice(lower)]
        if rng.random() < 0.2 and lower:
            recs["view_src"][i] = ids[rng.choice(lower)]
        r = rng.random()
        if r < 0.02:
            recs["src"][i, rng.integers(S)] = ids[i]
        elif r < 0.04:
            recs["view_src"][i] = ids[i]
        elif r < 0.05:
            recs["src"][i, rng.integers(S)] = np.uint64(rng.integers(1, 1 << 62))
        elif r < 0.06:
            recs["view_src"][i] = np.uint64(rng.integers(1, 1 << 62))
    if rng.random() < 0.03:
        recs["type"][rng.integers(n)] = np.flatnonzero(~valid_types)[0] if (~valid_types).any() else 10_000
    if rng.random() < 0.03:
        recs["op"][rng.integers(n)] = g.op_count
    if rng.random() < 0.03:
        names[rng.integers(n)] = 7
    nodes = rng.choice(ids, int(rng.integers(0, n + 1))).astype(np.uint64)
    if rng.random() < 0.04 and nodes.size:
        nodes[rng.integers(nodes.size)] = 12345
    return struct.pack("<I", nodes.size) + nodes.astype("<u8").tobytes() + struct.pack("<I", n) + recs.tobytes()


def _outcome(raw, g, kernel):
    try:
        p = parse_graph(raw, **_kw(g), _kernel=kernel)
    except GraphError as exc:
        return str(exc)
    return tuple(np.asarray(getattr(p, f)).tobytes() for f in ("node_index", "src_index", "view_src_index", "order"))


@pytest.mark.parametrize("twin", [False, True])
def test_parse_kernel_answers_as_its_parent(ggml, tmp_path_factory, twin):
    parent = _parent_kernel(tmp_path_factory)
    kernel = CK.parse_graph_kernel.py_func if twin else CK.parse_graph_kernel
    if twin:
        parent = parent.py_func
    rng = np.random.default_rng(81)
    seen = {"valid": 0, "later": 0, "refused": 0}
    for _ in range(300 if twin else 4000):
        raw = _random_graph(rng, ggml, ggml.valid_types)
        want, got = _outcome(raw, ggml, parent), _outcome(raw, ggml, kernel)
        assert got == want
        if isinstance(got, str):
            seen["refused"] += 1
            continue
        p = parse_graph(raw, **_kw(ggml), _kernel=kernel)
        assert p.src_index.min(initial=-1) >= -1 and p.view_src_index.min(initial=-1) >= -1
        pos = np.empty(len(p.order), int)
        pos[p.order] = np.arange(len(p.order))
        for i in range(len(p.order)):  # sources before their tensor in `order`
            for s in list(p.src_index[i]) + [p.view_src_index[i]]:
                assert s < 0 or pos[s] < pos[i]
        seen["valid"] += 1
        seen["later"] += bool((p.src_index > np.arange(len(p.order))[:, None]).any())
    assert min(seen.values()) > 5, seen


def test_second_pass_under_a_racing_guest(ggml):
    """Every source listed after its tensor (the second pass finds them all): a guest thread
    flips src / view_src ids (to unknown, to the tensor itself, to a tensor listed before it)
    while the host parses; a kept graph parses again to the same links, none of them -2."""
    rpc = rpc_tensor_dtype(ggml.limits)
    n = 160
    ids = (np.arange(n, dtype=np.uint64) + 1) * np.uint64(0x1000)
    recs = np.zeros(n, rpc)
    recs["id"] = ids
    recs["type"] = np.flatnonzero(ggml.valid_types)[0]
    recs["name"].view(np.uint8)[:, 0] = ord("t")
    for i in range(n - 1):  # tensor i reads tensor i + 1 (listed after it): a chain, reversed
        recs["src"][i, 0] = ids[i + 1]
        recs["src"][i, 1] = ids[min(n - 1, i + 2)]
    for i in range(0, n - 3, 7):
        recs["view_src"][i] = ids[i + 3]
    nodes = ids[:4]
    wire = bytearray(struct.pack("<I", nodes.size) + nodes.astype("<u8").tobytes() + struct.pack("<I", n)
                     + recs.tobytes())
    head = 8 + 8 * nodes.size
    k = n // 2

    def at(field, i=k, sub=0):
        return head + i * rpc.itemsize + rpc.fields[field][1] + sub

    def u64(v):
        return [(int(v) >> (8 * b)) & 255 for b in range(8)]

    cases = {
        "src unknown": [(at("src"), wire[at("src")], wire[at("src")] ^ 0x33)],
        "src self": [(at("src", sub=b), u64(ids[k + 1])[b], u64(ids[k])[b]) for b in range(8)],
        "src before (a cycle)": [(at("src", sub=b), u64(ids[k + 1])[b], u64(ids[k - 1])[b]) for b in range(8)],
        "view_src unknown": [(at("view_src", i=k - k % 7, sub=1), u64(ids[k - k % 7 + 3])[1], 0x77)],
        "view_src self": [(at("view_src", i=k - k % 7, sub=b), u64(ids[k - k % 7 + 3])[b], u64(ids[k - k % 7])[b])
                          for b in range(8)],
        "last src unknown": [(at("src", i=n - 2), wire[at("src", i=n - 2)], 0)],  # 0: no source, valid
    }
    for name, spec in cases.items():
        seen = {"kept": 0, "refused": 0}
        with racing_guest(wire, spec) as mem:
            start = time.monotonic()  # (a shared machine may not run the flipper at once)
            while time.monotonic() < start + 0.3 or (
                not (seen["kept"] and (seen["refused"] or name.startswith("last"))) and time.monotonic() < start + 8
            ):
                try:
                    p = parse_graph(mem, **_kw(ggml))
                except GraphError:
                    seen["refused"] += 1
                    continue
                seen["kept"] += 1
                assert p.src_index.min() >= -1 and p.view_src_index.min() >= -1, name
                copy = struct.pack("<I", p.n_nodes) + p.node_ids.astype("<u8").tobytes()
                copy += struct.pack("<I", p.n_tensors) + p.tensors.tobytes()
                q = parse_graph(copy, **_kw(ggml))
                for f in ("node_index", "src_index", "view_src_index", "order"):
                    assert np.array_equal(getattr(p, f), getattr(q, f)), (name, f)
        assert seen["kept"], (name, seen)
        assert seen["refused"] or name == "last src unknown", (name, seen)


def _read_equal(rpc, old, new, size):
    """Brute force: whether `new` (its first `size` bytes) holds every byte the host read of
    the valid graph `old`: the header, each record's fields but padding and holes, each name
    up to its first NUL (`new`'s must have one)."""
    if size < len(old):
        return False
    n_nodes = struct.unpack_from("<I", old)[0]
    head = 8 + 8 * n_nodes
    if new[:head] != old[:head]:
        return False
    name_at, name_len = rpc.fields["name"][1], rpc.fields["name"][0].itemsize
    outside = _key_mask(rpc, ids=True).copy()
    outside[name_at : name_at + name_len] = 0
    for i in range((len(old) - head) // rpc.itemsize):
        a = np.frombuffer(old, np.uint8, rpc.itemsize, head + i * rpc.itemsize)
        b = np.frombuffer(new, np.uint8, rpc.itemsize, head + i * rpc.itemsize)
        if ((a ^ b) & outside).any():
            return False
        na, nb = bytes(a[name_at : name_at + name_len]), bytes(b[name_at : name_at + name_len])
        if b"\0" not in nb or na.split(b"\0")[0] != nb.split(b"\0")[0]:
            return False
    return True


def _brute_key(p, rpc):
    name_at, name_len = rpc.fields["name"][1], rpc.fields["name"][0].itemsize
    rows = np.ascontiguousarray(p.tensors).view(np.uint8).reshape(len(p.tensors), -1) & _key_mask(rpc)
    names = [bytes(r[name_at : name_at + name_len]).split(b"\0")[0] for r in
             np.ascontiguousarray(p.tensors).view(np.uint8).reshape(len(p.tensors), -1)]
    rows[:, name_at : name_at + name_len] = 0
    return (rows.tobytes(), tuple(names), p.node_index.tobytes(), p.src_index.tobytes(),
            p.view_src_index.tobytes())


def test_wire_match_and_key_by_definition(ggml, host_path):
    rpc = rpc_tensor_dtype(ggml.limits)
    name_at, name_len = rpc.fields["name"][1], rpc.fields["name"][0].itemsize
    unread = np.flatnonzero(_key_mask(rpc, ids=True) == 0)
    rng = np.random.default_rng(82)
    seen = {True: 0, False: 0, "same key": 0, "other key": 0}
    for _ in range(700):
        raw = _random_graph(rng, ggml, ggml.valid_types)
        try:
            p = parse_graph(raw, **_kw(ggml))
        except GraphError:
            continue
        wire, key = graph_wire(p), graph_key(p)
        head = 8 + 8 * len(p.node_ids)
        nt = len(p.tensors)
        for _ in range(6):
            new = bytearray(raw) + bytes(rng.integers(0, 256, int(rng.integers(0, 9)), dtype=np.uint8))
            mode = rng.random()
            if mode < 0.35:
                for _ in range(int(rng.integers(1, 4))):
                    new[int(rng.integers(0, len(new)))] ^= int(rng.integers(1, 256))
            elif mode < 0.8:  # a name rewritten
                o = head + int(rng.integers(0, nt)) * rpc.itemsize + name_at
                cur = bytes(new[o : o + name_len]).split(b"\0")[0]
                junk = bytes(rng.integers(0, 256, name_len, dtype=np.uint8))
                c = rng.random()
                if c < 0.3:
                    name = cur + b"\0" + junk  # the same name, other bytes after its NUL
                elif c < 0.45:
                    name = cur[:-1] + b"\0" + junk  # one byte shorter
                elif c < 0.6:
                    name = cur + bytes(rng.integers(1, 256, name_len, dtype=np.uint8))  # longer, maybe no NUL
                elif c < 0.75:
                    name = cur + b"x\0" + junk
                elif c < 0.85:
                    name = cur[:1] + bytes([cur[1] ^ 1]) + cur[2:] + b"\0" if len(cur) > 1 else b"\0\0"
                else:
                    name = junk
                new[o : o + name_len] = (name + bytes(name_len))[:name_len]
            else:  # padding and holes only
                for _ in range(3):
                    new[head + int(rng.integers(0, nt)) * rpc.itemsize + int(rng.choice(unread))] ^= 0x5A
            size = len(new) - (int(rng.integers(0, 3)) if rng.random() < 0.1 else 0)
            want = _read_equal(rpc, raw, bytes(new), size)
            for shift in range(8):
                buf = bytearray(shift) + new
                assert wire.matches(memoryview(buf)[shift:], size) is want, (mode, shift)
            seen[want] += 1
            try:
                q = parse_graph(bytes(new[:size]), **_kw(ggml))
            except GraphError:
                assert not want
                continue
            if want:  # what take_same serves is what a parse would give
                for f in ("node_ids", "node_index", "src_index", "view_src_index", "order"):
                    assert np.array_equal(getattr(p, f), getattr(q, f)), f
            same = _brute_key(p, rpc) == _brute_key(q, rpc)
            assert (graph_key(q) == key) is same
            assert not want or same
            seen["same key" if same else "other key"] += 1
    assert min(seen.values()) > 20, seen


_GUARD_CHILD = textwrap.dedent(
    """
    import ctypes, mmap, struct, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import apir.ggml
    from apir.codec.graph import parse_graph
    from apir.codec.records import rpc_tensor_dtype
    from apir.host.graph.cache import graph_wire
    g = apir.ggml.load()
    rpc = rpc_tensor_dtype(g.limits)
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    hits = 0
    for n, name_len in ((1, 0), (1, 63), (3, 63), (3, 10), (5, 62)):
        recs = np.zeros(n, rpc)
        recs["id"] = np.arange(1, n + 1) * 16
        recs["type"] = int(np.flatnonzero(g.valid_types)[0])
        recs["name"].view(np.uint8)[:, :name_len] = ord("n")
        for i in range(1, n):
            recs["src"][i, 0] = recs["id"][i - 1]
        raw = struct.pack("<IQI", 1, n * 16, n) + recs.tobytes()
        wire = graph_wire(parse_graph(raw, limits=g.limits, op_count=g.op_count, type_valid=g.valid_types))
        pages = -(-len(raw) // page) + 1
        mm = mmap.mmap(-1, pages * page)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        assert libc.mprotect(base + (pages - 1) * page, page, 0) == 0  # PROT_NONE after the graph
        for cut in (0, 1, 7, 8, 9):  # the graph (or its first len - cut bytes) ends at the guard page
            at = (pages - 1) * page - (len(raw) - cut)
            mm[at : at + len(raw) - cut] = raw[: len(raw) - cut]
            view = memoryview(mm)[at : (pages - 1) * page]
            ok = wire.matches(view, len(view))
            assert ok is (cut == 0), (n, name_len, cut, ok)
            hits += ok
            view.release()
        # the last name without a NUL, up to the last byte before padding: still no read past
        at = (pages - 1) * page - len(raw)
        mm[at : at + len(raw)] = raw
        last = at + len(raw) - rpc.itemsize + rpc.fields["name"][1]
        mm[last : last + 64] = b"m" * 64
        view = memoryview(mm)[at : (pages - 1) * page]
        assert not wire.matches(view, len(view))
        view.release()
    print("OK", hits, flush=True)
    if len(sys.argv) > 2:  # the guard is real: one byte past the guest's bytes faults
        ctypes.string_at(base + (pages - 1) * page, 1)
    """
)


def test_wire_match_reads_nothing_past_the_guests_bytes(ggml):
    """A graph ending exactly at a PROT_NONE page: matched (or refused) without a fault."""
    res = subprocess.run([sys.executable, "-c", _GUARD_CHILD, str(ROOT)], capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0 and res.stdout.strip() == "OK 5", (res.returncode, res.stdout, res.stderr[-3000:])
    probe = subprocess.run([sys.executable, "-c", _GUARD_CHILD, str(ROOT), "probe"], capture_output=True, text=True,
                           timeout=240)
    assert probe.returncode < 0 and probe.stdout.strip() == "OK 5", (probe.returncode, probe.stdout)
