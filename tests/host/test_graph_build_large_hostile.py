"""A large graph's first build (apir.host.graph.build.build_graph_parts) on the
accelerated and the plain path, and check_nodes' group sizes (group_sizes_kernel).

- A graph is refused with the same message, or built into the same host tensors, on the
  accelerated path and the plain one, under random lies in every record field; tensors made
  by ggml_new_tensor_1d where ggml's layout is not the kernels'; records in doubt checked
  one by one.
- A real guest's 2,200-tensor graph computes ggml CPU's bytes on either path, through the
  graph cache and its row-id re-checks too; two guests build and compute such graphs at once
  from two threads: no deadlock, each its own bytes, every lie refused.
- check_nodes decides as checking each member on its own, on random groupings whose rules
  pass, refuse, read a hidden field or set one.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from apir import accel
from apir.codec.graph import GraphError
from apir.codec.records import rpc_tensor_dtype
from apir.host.graph import build as hg
from apir.host.graph import rule_memo
from apir.host.errors import Refused
from apir.host.graph.shapes import TensorInfo
from tests.host.hostkit import needs_kernels
from tests.host.largekit import LAYERS, LargeRemote, build_outcome, one_thread_guest
from tests.host.largekit import parse


@pytest.fixture
def big(ggml):
    """(guest, LargeRemote): a guest whose host buffer holds a 2,200-tensor graph's inputs."""
    guest = one_thread_guest()
    remote = LargeRemote(guest, ggml)
    yield guest, remote
    remote.close()
    guest.close()


# --- a real guest: the large graph computed through the host ----------------------------------


def test_a_large_graph_through_the_host_is_ggml_cpus(big, host_path, monkeypatch):
    """graph_compute of a 2,200-tensor graph (views, GET_ROWS row ids, MUL_MAT): ggml CPU's
    bytes; again from the graph cache (no new build); with new row ids (the re-check points
    the host tensors at fresh copies); with a row id out of range (refused, the entry
    dropped), then rebuilt. The cache charges the same bytes for each build."""
    guest, remote = big
    lib = guest.ctx._library
    builds = []
    make = hg._create_tensors
    monkeypatch.setattr(hg, "_create_tensors", lambda *a: builds.append(1) or make(*a))
    assert remote.compute() == (0, 0, remote.expect)
    assert remote.compute() == (0, 0, remote.expect)  # (a cache hit: no new build)
    assert len(builds) == 1
    cached = lib.graph_cache.nbytes
    # new row ids: the host tensors pointed at fresh copies by the re-check, no build
    ids = np.arange(3 * LAYERS, dtype=np.int32) % 10
    remote.set_ids(ids.tobytes())
    assert remote.cpu(ids.tobytes()) != remote.expect
    assert remote.compute() == (0, 0, remote.cpu(ids.tobytes()))
    assert len(builds) == 1
    ids[3 * 20 * 7 + 1] = 10  # (layer 140 reads rows, of 10)
    remote.set_ids(ids.tobytes())
    rc, _, _ = remote.compute()
    assert rc != 0 and len(lib.graph_cache) == 0 and len(builds) == 1
    ids[3 * 20 * 7 + 1] = 9
    remote.set_ids(ids.tobytes())
    assert remote.compute() == (0, 0, remote.cpu(ids.tobytes()))
    assert len(builds) == 2 and lib.graph_cache.nbytes == cached


def test_tensors_made_by_ggml_new_tensor(big, monkeypatch):
    """Where ggml's tensor layout is not the one write_tensors_kernel writes, the host
    tensors are made by ggml_new_tensor_1d in the scratch's ggml_context: the same tensors
    as the kernel writes, and ggml CPU's bytes."""
    guest, remote = big
    lib = guest.ctx._library
    written = build_outcome(lib, parse(lib, remote.wire))
    monkeypatch.setattr(hg, "_kernel_layout", lambda tensor, rpc, max_src: None)
    made = build_outcome(lib, parse(lib, remote.wire))
    assert remote.compute() == (0, 0, remote.expect)
    assert made[0] == "built" and made == written


def _refused_at_the_end(lib, wire):
    """`wire` parsed, its last node lying about its width (refused by its rule, after every
    record check passed)."""
    parsed = parse(lib, wire)
    parsed.tensors["ne"][parsed.node_index[-1], 0] = 7
    return parsed


@needs_kernels
def test_records_in_doubt_are_checked_one_by_one(big, monkeypatch):
    """The array record checks in doubt (None): the records are checked one by one, and the
    same host tensors made; a node refused after them is still refused."""
    guest, remote = big
    lib = guest.ctx._library
    want = build_outcome(lib, parse(lib, remote.wire))
    checked, made = [], []
    make = hg._create_tensors
    monkeypatch.setattr(hg, "_check_records", lambda *a: checked.append(1))
    monkeypatch.setattr(hg, "_create_tensors", lambda *a: made.append(1) or make(*a))
    assert build_outcome(lib, parse(lib, remote.wire)) == want
    assert checked == [1] and made == [1]
    assert build_outcome(lib, _refused_at_the_end(lib, remote.wire))[0] == "Refused"
    assert len(made) == 1


def _records(g, wire: bytearray):
    """The tensor records of graph `wire` in place (a view: writing them edits the wire)."""
    n_nodes = int.from_bytes(wire[:4], "little")
    return np.frombuffer(wire, rpc_tensor_dtype(g.limits), offset=8 + 8 * n_nodes)


def _lie(rng, recs, g):
    """One lie of a guest in a random field of a random record of `recs`."""
    n = len(recs)
    rec, other = recs[int(rng.integers(n))], recs[int(rng.integers(n))]

    def pick(values):
        return values[int(rng.integers(len(values)))]

    field = pick(["data", "buffer", "ne", "nb", "type", "op", "op_params", "view_offs", "src", "view_src",
                  "name", "flags", "ne0"])
    if field == "data":
        value = pick([int(other["data"]), int(rec["data"]) + int(rng.integers(-64, 64)),
                      (1 << 64) - int(rng.integers(1, 1 << 20)), int(rng.integers(0, 1 << 24))])
        rec["data"] = np.uint64(value % (1 << 64))
    elif field == "buffer":
        rec["buffer"] = pick([0, int(rec["buffer"]) + 1, int(rng.integers(1, 1 << 62))])
    elif field in ("ne", "nb"):
        d = int(rng.integers(4))
        rec[field][d] = pick([0, 1, int(rec[field][d]) * 2, int(rng.integers(0, 1 << 32)), 7])
    elif field == "ne0":  # a width both a rule and the record checks see
        rec["ne"][0] = int(rng.integers(1, 17))
    elif field == "type":
        rec["type"] = int(rng.integers(0, 42))
    elif field == "op":
        rec["op"] = int(rng.integers(0, g.op_count))
    elif field == "op_params":
        rec["op_params"][int(rng.integers(len(rec["op_params"])))] = int(rng.integers(-(1 << 31), 1 << 31))
    elif field == "view_offs":
        rec["view_offs"] = pick([0, int(rec["view_offs"]) + 4, int(rng.integers(0, 1 << 40))])
    elif field == "src":
        rec["src"][int(rng.integers(len(rec["src"])))] = pick([0, int(other["id"])])
    elif field == "view_src":
        rec["view_src"] = pick([0, int(other["id"])])
    elif field == "name":
        rec["name"] = b"x" * len(rec["name"])
    else:
        rec["flags"] = int(rng.integers(-8, 64))


def test_lies_are_refused_alike_on_the_accelerated_and_the_plain_path(big, monkeypatch):
    """One to three lies in random fields of random records of a 2,200-tensor graph: the
    build on the accelerated path and the build on the plain one refuse with the same error
    and message, or make the same host tensors."""
    guest, remote = big
    lib, g = guest.ctx._library, guest.ctx._library.g
    rng = np.random.default_rng(9)
    seen = set()
    for case in range(100):
        wire = bytearray(remote.wire)
        recs = _records(g, wire)
        for _ in range(int(rng.integers(1, 4))):
            _lie(rng, recs, g)
        try:
            parsed = [parse(lib, bytes(wire)) for _ in range(2)]
        except GraphError:
            continue
        fast = build_outcome(lib, parsed[0])
        with monkeypatch.context() as m:
            m.setattr(accel, "enabled", lambda: False)
            plain = build_outcome(lib, parsed[1])
        assert fast == plain, (case, fast[:1], fast[1] if fast[0] != "built" else "", plain[1])
        seen.add(fast[0] if fast[0] == "built" else fast[1].split(":")[0].split()[0])
    assert "built" in seen and len(seen) >= 3, seen


# --- two guests at once ----------------------------------------------------------------------


def test_two_guests_build_large_graphs_at_once(ggml):
    """Two contexts (two guests) on two threads each compute their own 2,200-tensor graph
    again and again, every one a first build (their graph caches emptied), a refused build
    (a lie in the last node) between. Nobody hangs,
    each gets ggml CPU's bytes of its own graph, every lie is refused."""
    guests = [one_thread_guest(7 + k) for k in range(2)]
    remotes = [LargeRemote(guest, ggml, seed=seed) for seed, guest in enumerate(guests)]
    assert remotes[0].expect != remotes[1].expect
    results = [[] for _ in guests]
    errors = []
    start = threading.Barrier(2)

    def lie(remote):
        wire = bytearray(remote.wire)
        recs = _records(ggml, wire)
        recs["ne"][-1][0] = 7  # (the graph's last record: a node, 7 wide of its sources' 8)
        return bytes(wire)

    def run(k):
        guest, remote = guests[k], remotes[k]
        lib = guest.ctx._library
        bad = lie(remote)
        try:
            start.wait(60)
            for _ in range(12):
                lib.graph_cache.clear()
                results[k].append(remote.compute())
                results[k].append(remote.compute(bad)[0])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    try:
        assert not any(th.is_alive() for th in threads), "a build never finished"
        assert not errors, errors
        for remote, got in zip(remotes, results):
            assert got[0::2] == [(0, 0, remote.expect)] * 12
            assert all(rc != 0 for rc in got[1::2]), got[1::2]
    finally:
        for remote, guest in zip(remotes, guests):
            remote.close()
            guest.close()


# --- check_nodes: group_sizes_kernel and the members left to check alone ------------------------


def _info(i: int, kind: str, room: int) -> TensorInfo:
    # what rules see sealed (type_name: the rule's kind; ne) is the group's; index and room
    # are the member's own
    return TensorInfo(index=i, type_name=kind, ne=[4, 1, 1, 1], nb=[4, 16, 16, 16], op_name="NONE",
                      op_params=np.zeros(16, np.int32), type_size=4, blck_size=1, address=64 * i, room=room)


def _rule(node, srcs, enums):
    """A rule of each kind: `pass`, `refuse` (pure), `room` (reads a hidden field, refuses the
    members near their buffer's end), `mark` (sets an attribute: impure, a side effect)."""
    kind = node.type_name
    if kind == "refuse":
        raise Refused(f"node {node.index}: refused")
    if kind == "room" and node.room < 8:
        raise Refused(f"node {node.index}: too close to the end")
    if kind == "mark":
        node.one_thread = True


def _one_by_one(infos):
    """(first refusal's message or None, the members marked): every tensor on its own."""
    for info in infos:
        try:
            _rule(info, [], None)
        except Refused as exc:
            return str(exc), sorted(i.index for i in infos if i.one_thread)
    return None, sorted(i.index for i in infos if i.one_thread)


def test_grouped_checks_decide_as_one_by_one_on_random_groupings(monkeypatch):
    """check_nodes (group_sizes_kernel's representatives and sizes; the members left alone
    found without a pass when every shared group passed sealed, in one pass otherwise) on
    random groupings of up to 300 tensors whose groups' rules pass, refuse, read a hidden
    field or set one: the same first refusal and the same members marked as checking every
    tensor on its own; a group's members are never skipped unless its representative passed
    sealed."""
    monkeypatch.setitem(rule_memo.__dict__, "check_node", lambda n, s, e, r: _rule(n, s, e))
    rng = np.random.default_rng(41)
    outcomes = set()
    for case in range(300):
        n = int(rng.integers(0, 300))
        groups = np.arange(n, dtype=np.int32)
        for i in range(1, n):
            if rng.random() < 0.8:
                groups[i] = groups[int(rng.integers(i))]  # (a representative at or before its members)
        weights = [[0.9, 0.02, 0.04, 0.04], [0.7, 0.1, 0.1, 0.1], [0.4, 0.0, 0.3, 0.3]][case % 3]
        kinds = {r: str(rng.choice(["pass", "refuse", "room", "mark"], p=weights)) for r in set(groups.tolist())}
        rooms = rng.choice([4, 16], size=n, p=[0.05, 0.95])
        grouped = [_info(i, kinds[int(groups[i])], int(rooms[i])) for i in range(n)]
        alone = [_info(i, kinds[int(groups[i])], int(rooms[i])) for i in range(n)]
        want = _one_by_one(alone)
        try:
            rule_memo.check_nodes(grouped, np.full((n, 1), -1, np.int32), None, None, groups)
            got = None
        except Refused as exc:
            got = str(exc)
        assert (got, sorted(i.index for i in grouped if i.one_thread)) == want, (case, n)
        outcomes.add(got is None)
    assert outcomes == {True, False}
