"""The build helper thread (apir.host.graph.build_helper) beside a large graph's first build
(apir.host.graph.build.build_graph_parts), and check_nodes' group sizes (group_sizes_kernel).
- The caller leaves build_graph_parts only after the helper is done with the scratch, however
  it leaves: a refusal, a BaseException on either thread, a SIGINT while it waits for the
  helper (in its `finally` too), and a job left queued by a helper thread that failed to
  start never writes a scratch it lost; a scratch closed while the helper writes it is freed
  only after, and one closed before the helper starts is never written.
- A graph is refused with the same message, or built into the same host tensors, with the
  helper and on one thread, under random lies in every record field; tensors made by
  ggml_new_tensor_1d on the helper; records in doubt checked by the caller.
- A real guest's 2,200-tensor graph computes ggml CPU's bytes, through the graph cache and
  its row-id re-checks too; two guests build and compute such graphs at once from two
  threads, sharing the one helper: no deadlock, each its own bytes, every lie refused.
- A fork while a build is in flight; interpreter shutdown with builds on another thread.
- check_nodes decides as checking each member on its own, on random groupings whose rules
  pass, refuse, read a hidden field or set one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from apir.codec.graph import GraphError
from apir.codec.records import rpc_tensor_dtype
from apir.host.graph import build_helper
from apir.host.backend import dispatch_backend
from apir.host.graph import build as hg
from apir.host.graph import rule_memo
from apir.host.errors import Refused
from apir.host.graph.shapes import TensorInfo
from tests.host.largekit import LAYERS, LargeRemote, block_tensors, build_outcome, graph_scratch, one_thread_guest
from tests.host.largekit import parse

_ROOT = Path(__file__).resolve().parents[2]

needs_two_cpus = pytest.mark.skipif(build_helper.helper_cpus() < 2, reason="one CPU: no build helper")


@pytest.fixture
def big(ggml):
    """(guest, LargeRemote): a guest whose host buffer holds a 2,200-tensor graph's inputs."""
    guest = one_thread_guest()
    remote = LargeRemote(guest, ggml)
    yield guest, remote
    remote.close()
    guest.close()


# --- a real guest: the large graph computed through the host ----------------------------------


@needs_two_cpus
def test_a_large_graph_through_the_host_is_ggml_cpus_with_the_helper_and_without(big, monkeypatch):
    """graph_compute of a 2,200-tensor graph (views, GET_ROWS row ids, MUL_MAT) with its
    host tensors made on the helper: ggml CPU's bytes; again from the graph cache (no new
    build); with new row ids (the re-check points the helper's tensors at fresh copies);
    with a row id out of range (refused, the entry dropped), then rebuilt beside; and with
    the helper off. The cache charges the same bytes for a build beside and one alone."""
    guest, remote = big
    lib = guest.ctx._library
    assert len(parse(lib, remote.wire).tensors) >= hg._BESIDE_MIN_TENSORS
    on_helper = []
    make = hg._create_tensors
    monkeypatch.setattr(hg, "_create_tensors", lambda *a: on_helper.append(threading.get_ident()) or make(*a))
    assert remote.compute() == (0, 0, remote.expect)
    assert on_helper and on_helper[0] != threading.get_ident()
    assert remote.compute() == (0, 0, remote.expect)  # (a cache hit: no new build)
    assert len(on_helper) == 1
    cached = lib.graph_cache.nbytes
    # new row ids: the helper's host tensors pointed at fresh copies by the re-check, no build
    ids = np.arange(3 * LAYERS, dtype=np.int32) % 10
    remote.set_ids(ids.tobytes())
    assert remote.cpu(ids.tobytes()) != remote.expect
    assert remote.compute() == (0, 0, remote.cpu(ids.tobytes()))
    assert len(on_helper) == 1
    ids[3 * 20 * 7 + 1] = 10  # (layer 140 reads rows, of 10)
    remote.set_ids(ids.tobytes())
    rc, _, _ = remote.compute()
    assert rc != 0 and len(lib.graph_cache) == 0 and len(on_helper) == 1
    ids[3 * 20 * 7 + 1] = 9
    remote.set_ids(ids.tobytes())
    assert remote.compute() == (0, 0, remote.cpu(ids.tobytes()))
    assert len(on_helper) == 2 and lib.graph_cache.nbytes == cached
    lib.graph_cache.clear()
    monkeypatch.setattr(build_helper, "enabled", False)
    assert remote.compute() == (0, 0, remote.cpu(ids.tobytes()))
    assert on_helper[2] == threading.get_ident() and lib.graph_cache.nbytes == cached


# --- the caller leaves only after the helper left the scratch ---------------------------------


class _Interrupt(BaseException):
    """What the test's SIGINT handler raises (a KeyboardInterrupt of its own)."""


def _refused_at_the_end(lib, wire):
    """`wire` parsed, its last node lying about its width (refused by its rule, after every
    record check passed)."""
    parsed = parse(lib, wire)
    parsed.tensors["ne"][parsed.node_index[-1], 0] = 7
    return parsed


def _interrupted(big, where: str, monkeypatch) -> bool:
    """Whether build_graph_parts left while the helper was still to write the scratch, when a
    SIGINT (its handler raising `_Interrupt`) reached the caller waiting for the helper:
    `records` (for the record checks), `tensors` (for the host tensors, every check passed),
    `finally` (in its `finally`, after a refusal came while the helper still writes). The
    helper is held until half a second after the interrupt was raised."""
    guest, remote = big
    lib = guest.ctx._library
    parsed = _refused_at_the_end(lib, remote.wire) if where == "finally" else parse(lib, remote.wire)
    release, waiting, done = threading.Event(), threading.Event(), threading.Event()
    blocked = "_check_records" if where == "records" else "_create_tensors"
    real = getattr(hg, blocked)

    def held(*args):  # (on the helper: holds the scratch until released)
        release.wait(60)
        try:
            return real(*args)
        finally:
            done.set()

    monkeypatch.setattr(hg, blocked, held)
    if where == "finally":
        real_wait = build_helper.futures.wait

        class _Futures:
            @staticmethod
            def wait(fs, *a, **k):
                waiting.set()
                return real_wait(fs, *a, **k)

        monkeypatch.setattr(build_helper, "futures", _Futures)
    else:
        step = "rule_groups" if where == "records" else "_check_graph_needs"
        before = getattr(hg, step)
        monkeypatch.setattr(hg, step, lambda *a: (before(*a), waiting.set())[0])

    handled = threading.Event()

    def interrupt():
        if waiting.wait(60):
            # (again until handled: a signal that lands just before the caller blocks on a lock
            # is handled only once that lock is released, CPython's own race)
            for _ in range(300):
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                if handled.wait(0.2):  # (the helper held until the interrupt was raised in the caller)
                    break
            time.sleep(0.5)  # (a correct host is still waiting: this only lets a bad one leave)
        release.set()

    def handler(signum, frame):
        if not handled.is_set():  # (one interrupt: the signals sent after it are ignored)
            handled.set()
            raise _Interrupt()

    old = signal.signal(signal.SIGINT, handler)
    th = threading.Thread(target=interrupt)
    scratch = graph_scratch(lib, parsed)
    try:
        th.start()
        with pytest.raises((_Interrupt, Refused)):
            hg.build_graph_parts(lib, parsed, scratch, hg.lib_op_enums(lib))
        left_early = not done.is_set()
    finally:
        release.set()
        th.join(60)
        signal.signal(signal.SIGINT, old)
        done.wait(60)  # (the scratch outlives the helper's writes even where the host did not wait)
        scratch.close()
    return left_early


_MAIN_ONLY = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals")


@needs_two_cpus
@_MAIN_ONLY
@pytest.mark.parametrize("where", ["records", "tensors"])
def test_an_interrupt_while_the_caller_waits_for_the_helper(big, where, monkeypatch):
    """SIGINT (the user's Ctrl-C: an embedded host builds on the guest application's own
    thread, a notebook's main thread) while the caller waits for the record checks or the
    host tensors: build_graph_parts raises the interrupt once the helper stopped writing the
    host tensors into the scratch, which prepare_graph frees as it unwinds."""
    assert not _interrupted(big, where, monkeypatch)


@needs_two_cpus
@_MAIN_ONLY
def test_an_interrupt_in_the_finally_waits_for_the_helper(big, monkeypatch):
    """A refusal (or a first Ctrl-C) comes while the helper still writes the host tensors,
    and a SIGINT arrives while build_graph_parts' `finally` waits for it: the wait goes on
    until the helper is done, then the interrupt is raised. (It was a plain
    `futures.wait([job])`, which the interrupt left at once: prepare_graph then freed the
    scratch as it unwound, and the helper wrote ~740 KB of ggml_tensor structs into freed
    memory, `free(): invalid pointer` at exit.)"""
    assert not _interrupted(big, "finally", monkeypatch), "build_graph_parts left while the helper still wrote"


@needs_two_cpus
@pytest.mark.parametrize("where", ["rule_groups", "check_nodes", "_check_graph_needs"])
def test_a_base_exception_in_the_caller_waits_for_the_helper(big, where, monkeypatch):
    """A BaseException (not an Exception: what a `except Exception` would let through) raised
    on the caller's side, at each of its steps, while the helper writes the host tensors:
    build_graph_parts raises it only once the helper is done with the scratch."""
    guest, remote = big
    lib = guest.ctx._library
    parsed = parse(lib, remote.wire)
    raised, done = threading.Event(), threading.Event()
    make = hg._create_tensors

    def late(*args):  # (on the helper: writes only after the caller raised, and slowly)
        raised.wait(60)
        time.sleep(0.2)
        try:
            return make(*args)
        finally:
            done.set()

    def fail(*args, **kw):
        raised.set()
        raise _Interrupt(where)

    monkeypatch.setattr(hg, "_create_tensors", late)
    monkeypatch.setattr(hg, where, fail)
    with graph_scratch(lib, parsed) as scratch:
        with pytest.raises(_Interrupt):
            hg.build_graph_parts(lib, parsed, scratch, hg.lib_op_enums(lib))
        assert done.is_set()
    monkeypatch.undo()
    assert build_outcome(lib, parse(lib, remote.wire))[0] == "built"


@needs_two_cpus
@pytest.mark.parametrize("where", ["_check_records", "_create_tensors"])
def test_a_base_exception_on_the_helper_reaches_the_caller_and_the_helper_lives(big, where, monkeypatch):
    """A BaseException raised on the helper (in the record checks: the `records` Future the
    caller waits on must get it; in the host tensors: the job's): the caller raises it,
    nothing hangs, and the one helper thread still serves the next build."""
    guest, remote = big
    lib = guest.ctx._library
    want = build_outcome(lib, parse(lib, remote.wire))
    threads = []

    def fail(*args):
        threads.append(threading.current_thread().name)
        raise _Interrupt(where)

    monkeypatch.setattr(hg, where, fail)
    parsed = parse(lib, remote.wire)
    with graph_scratch(lib, parsed) as scratch:
        with pytest.raises(_Interrupt, match=where):
            hg.build_graph_parts(lib, parsed, scratch, hg.lib_op_enums(lib))
    assert threads and threads[0].startswith("apir-build-helper")
    monkeypatch.undo()
    made = []
    make = hg._create_tensors
    monkeypatch.setattr(hg, "_create_tensors", lambda *a: made.append(threading.current_thread().name) or make(*a))
    assert build_outcome(lib, parse(lib, remote.wire)) == want
    assert made[0] == threads[0]


@needs_two_cpus
def test_tensors_made_by_ggml_new_tensor_on_the_helper(big, monkeypatch):
    """Where ggml's tensor layout is not the one write_tensors_kernel writes, the helper
    makes the host tensors by ggml_new_tensor_1d in the scratch's ggml_context (while the
    caller runs the rules): the same tensors as on one thread, and ggml CPU's bytes."""
    guest, remote = big
    lib = guest.ctx._library
    monkeypatch.setattr(hg, "_kernel_layout", lambda tensor, rpc, max_src: None)
    where = []
    make = hg._create_tensors
    monkeypatch.setattr(hg, "_create_tensors", lambda *a: where.append(threading.get_ident()) or make(*a))
    beside = build_outcome(lib, parse(lib, remote.wire))
    assert remote.compute() == (0, 0, remote.expect)
    monkeypatch.setattr(build_helper, "enabled", False)
    alone = build_outcome(lib, parse(lib, remote.wire))
    assert beside[0] == "built" and beside == alone
    assert where[0] != threading.get_ident() and where[1] != threading.get_ident()
    assert where[2] == threading.get_ident()


@needs_two_cpus
def test_records_in_doubt_on_the_helper_are_checked_and_made_by_the_caller(big, monkeypatch):
    """The helper's record checks in doubt (None: the caller checks one by one): the helper
    makes no host tensors, the caller makes them after its own checks, the same tensors."""
    guest, remote = big
    lib = guest.ctx._library
    want = build_outcome(lib, parse(lib, remote.wire))
    checked, made = [], []
    make = hg._create_tensors
    monkeypatch.setattr(hg, "_check_records", lambda *a: checked.append(threading.get_ident()))
    monkeypatch.setattr(hg, "_create_tensors", lambda *a: made.append(threading.get_ident()) or make(*a))
    assert build_outcome(lib, parse(lib, remote.wire)) == want
    assert checked[0] != threading.get_ident() and made == [threading.get_ident()]
    assert build_outcome(lib, _refused_at_the_end(lib, remote.wire))[0] == "Refused"
    assert len(made) == 1


@needs_two_cpus
@pytest.mark.parametrize("kernel_layout", [True, False])
def test_a_helper_that_did_not_start_leaves_no_job_behind(big, kernel_layout, monkeypatch):
    """The helper thread fails to start (RuntimeError "can't start new thread": the process
    out of threads or memory). ThreadPoolExecutor.submit starts its thread after it queued
    the job, so a caller's job could stay queued, to run in some later build on a scratch
    its caller no longer owns (a cache entry's). beside starts the thread on a job of its
    own first: the caller builds alone with nothing queued, and the next build's job is the
    only one the helper runs; the entry's host tensors stay as built."""
    guest, remote = big
    lib = guest.ctx._library
    if not kernel_layout:
        monkeypatch.setattr(hg, "_kernel_layout", lambda tensor, rpc, max_src: None)
    monkeypatch.setattr(build_helper, "_pool", None)  # (a pool of its own, whose thread does not start)
    start, failed = threading.Thread.start, []

    def no_thread(self):
        if self.name.startswith("apir-build-helper") and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    jobs = []
    job = hg._records_then_tensors

    def traced(*args):
        jobs.append(threading.current_thread().name)
        return job(*args)

    monkeypatch.setattr(hg, "_records_then_tensors", traced)
    entry = dispatch_backend.prepare_graph(lib, parse(lib, remote.wire), None)
    try:
        assert failed and jobs == []  # (built alone)
        built = hg.BuiltGraph(entry.graph, entry.host, entry.infos, entry.src_rows, {})
        before = block_tensors(lib, built)
        again = build_outcome(lib, parse(lib, remote.wire))  # (starts the thread)
        assert again[0] == "built" and block_tensors(lib, built) == before
        assert len(jobs) == 1 and jobs[0].startswith("apir-build-helper"), jobs
    finally:
        entry.close()


def test_a_scratch_is_freed_only_after_the_helper_wrote_it(big):
    """Scratch.close waits while another thread holds `writing` (the helper writing the host
    tensors), and the helper's part finds a scratch closed before it started (a caller that
    left without waiting) and writes nothing: the last guard against writes into freed
    memory, whatever made the caller leave."""
    guest, remote = big
    lib = guest.ctx._library
    parsed = parse(lib, remote.wire)
    scratch = graph_scratch(lib, parsed)
    holding, release = threading.Event(), threading.Event()

    def writer():
        with scratch.writing:
            holding.set()
            release.wait(60)

    th = threading.Thread(target=writer)
    th.start()
    assert holding.wait(60)
    closer = threading.Thread(target=scratch.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and not scratch.closed  # (waits for the writer)
    release.set()
    closer.join(60)
    th.join(60)
    assert scratch.closed
    records = hg.Future()
    assert hg._records_then_tensors(lib, parsed, scratch, records) is None  # (closed: nothing written)
    assert records.result() is not None  # (the record checks ran: they write no scratch)


# --- the same decision with the helper and on one thread --------------------------------------


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


@needs_two_cpus
def test_lies_are_refused_alike_with_the_helper_and_on_one_thread(big, monkeypatch):
    """One to three lies in random fields of random records of a 2,200-tensor graph: the
    build with its record checks and host tensors on the helper and the build on one thread
    refuse with the same error and message, or make the same host tensors."""
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
        monkeypatch.setattr(build_helper, "enabled", True)
        beside = build_outcome(lib, parsed[0])
        monkeypatch.setattr(build_helper, "enabled", False)
        alone = build_outcome(lib, parsed[1])
        assert beside == alone, (case, beside[:1], beside[1] if beside[0] != "built" else "", alone[1])
        seen.add(beside[0] if beside[0] == "built" else beside[1].split(":")[0].split()[0])
    assert "built" in seen and len(seen) >= 3, seen


# --- two guests, one helper -------------------------------------------------------------------


@needs_two_cpus
def test_two_guests_build_large_graphs_at_once_on_the_one_helper(ggml):
    """Two contexts (two guests) on two threads each compute their own 2,200-tensor graph
    again and again, every one a first build (their graph caches emptied), a refused build
    (a lie in the last node) between: both helper jobs queue on the one worker. Nobody hangs,
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


# --- fork and interpreter shutdown -----------------------------------------------------------

# A child: builds the large graph with the helper; then, while another thread keeps building
# it, forks three times (each grandchild builds it with a helper of its own, and must make the
# same host tensors); then the main thread leaves while that thread still builds: the
# interpreter's shutdown stops the helper, and the builds left run on their thread, alike.
_FORK_AND_EXIT = r"""
import os, signal, sys, threading
import apir.ggml
from apir.host.graph import build as hg
import tests.host.largekit as t

g = apir.ggml.load()
guest = t.one_thread_guest()
remote = t.LargeRemote(guest, g)
lib = guest.ctx._library
want = t.build_outcome(lib, t.parse(lib, remote.wire))
assert want[0] == "built"
where = []
make = hg._create_tensors
on_helper = lambda: threading.current_thread().name.startswith("apir-build-helper")  # noqa: E731
hg._create_tensors = lambda *a: where.append(on_helper()) or make(*a)
assert t.build_outcome(lib, t.parse(lib, remote.wire)) == want and where == [True]
running, forked = threading.Event(), threading.Event()


def loop():
    for i in range(100000):
        if t.build_outcome(lib, t.parse(lib, remote.wire)) != want:
            print("a build on the thread differs", flush=True)
            os._exit(5)
        running.set()
        if forked.is_set() and not where[-1]:  # (a build on this thread: the helper stopped)
            break
    print("thread builds:", i + 1, "on the helper:", sum(where), flush=True)
    print("at shutdown on the thread:", not where[-1], flush=True)


th = threading.Thread(target=loop)
th.start()
running.wait(60)
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)
        del where[:]
        ok = t.build_outcome(lib, t.parse(lib, remote.wire)) == want and where == [True]
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        print("forked child:", os.waitstatus_to_exitcode(status), flush=True)
        os._exit(4)
forked.set()
print("main leaves", flush=True)
"""


@needs_two_cpus
def test_fork_with_a_build_in_flight_and_shutdown_with_builds_on_a_thread():
    """A fork while another thread builds on the helper: the child builds with its own helper
    (the same host tensors). The interpreter's shutdown (the main thread gone) while a
    non-main thread still builds large graphs: its builds go on, on its own thread once the
    helper is stopped, alike, and the process exits (no job left waiting on a stopped
    helper)."""
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    done = subprocess.run([sys.executable, "-c", _FORK_AND_EXIT], env=env, cwd=_ROOT, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    assert "main leaves" in done.stdout and "at shutdown on the thread: True" in done.stdout, done.stdout


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
