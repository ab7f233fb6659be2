"""A graph compute has a time limit and stops when its context goes away.

The graph is a chain of N_NODES in-place ADDs of a broadcast 1.0 to a zeroed 16 MiB tensor: its
final value counts the nodes that ran (N_NODES when it ran to the end, several seconds), so a
test sees from the bytes, not from a clock, that ggml stopped it early. ggml looks at its abort
callback between nodes: at least the first node always runs. Each test runs twice
(`bound_by`): with ggml CPU's abort callback, and as on a backend without one (ggml-vulkan,
ggml-rpc: the proc address not found), where the host computes the graph in ranges of nodes
and looks at the flag between them (apir.host.backend.compute_abort.compute_graph)."""

import socket
import threading

import numpy as np
import pytest

from apir.codec.constants import (
    ApirBackendCommandType as Cmd,
)
from apir.guest.client import ApirClient
from apir.guest.errors import DeviceError
from apir.guest.local import HostConnectionLost, LocalDevice
from apir.host import HostContext
from apir.host.local.server import LocalServer
from tests.host.hostkit import DATA_RES, GgmlScratch, Guest, RemoteGraph, graph_status_recorder
from tests.local.localkit import wait_for

N_ELEMENTS = 1 << 22  # 16 MiB of F32: each node touches all of it
N_NODES = 2000  # far longer than any limit below: seconds of compute
BOUND_S = 20.0  # liveness bound on a loaded machine


def add_chain(g, ctx, n_nodes=N_NODES):
    """(graph, [acc, one], out): out = acc + n_nodes * one, each ADD in place into acc."""
    f32 = g.types["F32"]
    acc = g.ggml_new_tensor_1d(ctx, f32, N_ELEMENTS)
    one = g.ggml_new_tensor_1d(ctx, f32, 1)
    for t, name in ((acc, b"acc"), (one, b"one")):
        g.ggml_set_name(t, name)
        g.ggml_set_input(t)
    y = acc
    for _ in range(n_nodes):
        y = g.ggml_add_inplace(ctx, y, one)
    g.ggml_set_output(y)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph, (acc, one), y


class ChainOnHost:
    """The add chain laid out in a host buffer through `guest` (a hostkit Guest), inputs set."""

    def __init__(self, guest, g, n_nodes=N_NODES):
        self.guest, self.g = guest, g
        self.scratch = GgmlScratch(g, n_nodes + 8)
        graph, (acc, one), self.out = add_chain(g, self.scratch.ctx, n_nodes)
        self.remote = RemoteGraph(guest, g, self.scratch.ctx, graph)
        assert guest.set_tensor(self.remote.handle, self.remote.rpc(one), np.float32(1.0).tobytes()) == 0
        self.acc_rpc = self.remote.rpc(acc)
        self.reset()

    def reset(self):
        zeros = bytes(1 << 20)
        for offset in range(0, 4 * N_ELEMENTS, len(zeros)):
            assert self.guest.set_tensor(self.remote.handle, self.acc_rpc, zeros, offset) == 0

    def compute_status(self):
        """The ggml status of the graph's compute."""
        wire = self.remote.wire
        self.guest.data[: len(wire)] = wire
        rc, dec = self.guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
        assert rc == 0
        return dec.i32()

    def compute(self):
        """(ggml status, nodes that ran)."""
        status = self.compute_status()
        return status, self.nodes_run()

    def nodes_run(self):
        rc, first = self.guest.get_tensor(self.remote.handle, self.remote.rpc(self.out), 4)
        assert rc == 0
        return int(np.frombuffer(first, np.float32)[0])

    def close(self):
        self.remote.close()
        self.scratch.close()


CHUNK_NODES = 64


@pytest.fixture(params=["callback", "ranges"])
def bound_by(request, monkeypatch):
    """How the host stops a graph: ggml's abort callback, or ranges of CHUNK_NODES nodes."""
    if request.param == "ranges":
        import apir.host.backend.compute_abort as compute_abort

        monkeypatch.setattr(compute_abort, "SET_ABORT_CALLBACK", b"apir_test_no_such_proc")
        monkeypatch.setenv("APIR_HOST_GRAPH_CHUNK_NODES", str(CHUNK_NODES))
    return request.param


def _stopped_at(bound_by, nodes):
    """Whether `nodes` that ran is where `bound_by` stops a graph: between nodes, or ranges."""
    return 1 <= nodes < N_NODES and (bound_by == "callback" or nodes % CHUNK_NODES == 0)


def test_a_graph_over_its_time_limit_is_aborted_and_the_next_one_runs(ggml, bound_by):
    aborted = ggml.statuses["ABORTED"]
    # a limit the 3-node graph below (48 MiB of ADDs) fits in even on a loaded machine, and the
    # 2000-node chain, seconds of compute, still overruns
    guest = Guest(HostContext(7, {"apir.host.graph_time_limit_s": "1.5"}), data_size=1 << 20)
    chain = ChainOnHost(guest, ggml)
    try:
        status, nodes = chain.compute()
        assert status == aborted
        assert _stopped_at(bound_by, nodes), nodes  # stopped between two nodes, well before the end
        assert guest.ctx._library.abort.chunked == (bound_by == "ranges")
        # the limit is per graph: a graph within it runs to its end on the same context
        short = ChainOnHost(guest, ggml, n_nodes=3)
        assert short.compute() == (ggml.statuses["SUCCESS"], 3)
        short.close()
    finally:
        chain.close()
        guest.close()


def test_the_time_limit_is_configured_by_the_environment_too(ggml, monkeypatch, bound_by):
    monkeypatch.setenv("APIR_HOST_GRAPH_TIME_LIMIT_S", "0.2")
    guest = Guest(HostContext(7), data_size=1 << 20)
    chain = ChainOnHost(guest, ggml)
    try:
        status, nodes = chain.compute()
        assert (status, _stopped_at(bound_by, nodes)) == (ggml.statuses["ABORTED"], True)
    finally:
        chain.close()
        guest.close()


@pytest.fixture
def compute_started(ggml, monkeypatch):
    """An Event set when the host calls ggml_backend_graph_compute (so a test acts on a compute
    in flight)."""
    started = threading.Event()
    compute = ggml.ggml_backend_graph_compute

    def watched(backend, graph):
        started.set()
        return compute(backend, graph)

    monkeypatch.setattr(ggml, "ggml_backend_graph_compute", watched)
    return started


def test_closing_the_context_cancels_its_compute(ggml, compute_started, bound_by):
    guest = Guest(HostContext(7, {"apir.host.graph_time_limit_s": "0"}), data_size=1 << 20)
    chain = ChainOnHost(guest, ggml)
    outcome = {}

    def compute():
        outcome["status"] = chain.compute_status()

    t = threading.Thread(target=compute, daemon=True)
    t.start()
    assert compute_started.wait(BOUND_S)
    guest.ctx.close()  # from another thread: must not wait for the graph
    t.join(BOUND_S)
    assert not t.is_alive()
    assert outcome["status"] == ggml.statuses["ABORTED"]
    chain.scratch.close()
    chain.remote.g.ggml_backend_buffer_free(chain.remote.local)


class _ClientGuest:
    """hostkit's Guest interface (alloc, set_tensor) over an ApirClient, for RemoteGraph."""

    def __init__(self, client):
        self.client = client

    def alloc(self, size):
        return self.client.buffer_type_alloc_buffer(self.client.device_get_buffer_type(), size)


def test_a_guest_hanging_up_cancels_its_compute_on_the_socket_host(ggml, tmp_path, compute_started, bound_by):
    statuses: list = []
    config = {"apir.host.graph_time_limit_s": "0"}  # only the hang-up may stop it
    recorder = graph_status_recorder(statuses)
    with LocalServer(str(tmp_path / "s.sock"), config=config, context_factory=recorder).start() as srv:
        dev = LocalDevice(srv.path)
        client = ApirClient.connect(dev)
        scratch = GgmlScratch(ggml, N_NODES + 8)
        graph, (acc, one), _ = add_chain(ggml, scratch.ctx)
        remote = RemoteGraph(_ClientGuest(client), ggml, scratch.ctx, graph)
        client.buffer_clear(remote.handle, 0)  # acc: zeros
        client.buffer_set_tensor(remote.handle, remote.rpc(one), 0, np.float32(1.0).tobytes())
        outcome = {}

        def compute():
            try:
                outcome["status"] = client.backend_graph_compute(remote.wire)
            except HostConnectionLost as exc:
                outcome["error"] = exc

        t = threading.Thread(target=compute, daemon=True)
        t.start()
        assert compute_started.wait(BOUND_S)  # the graph is computing on the host
        dev.sock.shutdown(socket.SHUT_RDWR)  # the guest hangs up mid-compute
        t.join(BOUND_S)
        assert wait_for(lambda: srv.stats().contexts == 0, BOUND_S)
        # the host's graph stopped: aborted, not run to its end for nobody
        assert statuses == [ggml.statuses["ABORTED"]]
        remote.close()
        scratch.close()


@pytest.mark.parametrize("exec_wait_s", [0.0, 1.0])
def test_closing_an_embedded_device_cancels_its_compute(ggml, compute_started, exec_wait_s, bound_by):
    """Whether execbuffer returns at once or waits (where bounded commands run in the caller's
    thread), the graph computes on the host thread, and closing the device stops it."""
    from apir.local.embedded import EmbeddedDevice

    statuses: list = []
    threads: list = []
    recorder = graph_status_recorder(statuses, threads)
    config = {"apir.host.graph_time_limit_s": "0"}
    dev = EmbeddedDevice(config=config, context_factory=recorder, exec_wait_s=exec_wait_s)
    client = ApirClient.connect(dev)
    scratch = GgmlScratch(ggml, N_NODES + 8)
    graph, (acc, one), _ = add_chain(ggml, scratch.ctx)
    remote = RemoteGraph(_ClientGuest(client), ggml, scratch.ctx, graph)
    client.buffer_clear(remote.handle, 0)
    client.buffer_set_tensor(remote.handle, remote.rpc(one), 0, np.float32(1.0).tobytes())
    outcome = {}

    def compute():
        try:
            outcome["status"] = client.backend_graph_compute(remote.wire)
        except DeviceError as exc:
            outcome["error"] = exc

    t = threading.Thread(target=compute, daemon=True)
    t.start()
    assert compute_started.wait(BOUND_S)
    dev.close()  # the host thread stops after the graph's current node, not after the graph
    t.join(BOUND_S)
    assert not t.is_alive()
    assert statuses == [ggml.statuses["ABORTED"]]  # the host's compute stopped
    assert threads == ["apir-embedded-host"]
    # the call in flight ends with that status, or, when the closing device freed the reply
    # blob before the caller looked, with the device's error
    assert outcome.get("status") == ggml.statuses["ABORTED"] or "closed" in str(outcome.get("error")), outcome
    remote.close()
    scratch.close()


def test_a_watchdog_that_could_not_start_is_started_again(monkeypatch):
    from apir.host.backend import compute_abort

    watchdog = compute_abort._Watchdog()
    real_start, calls = threading.Thread.start, []

    def start_once_failing(thread):
        calls.append(thread.name)
        if len(calls) == 1:
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    expired = threading.Event()

    class Abort:
        def _expire(self):
            expired.set()

    with pytest.raises(RuntimeError):
        watchdog.arm(Abort(), 0.0)
    assert not watchdog._deadlines  # the failed arm left no deadline behind
    watchdog.arm(Abort(), 0.0)  # a deadline already past: the new thread expires it at once
    assert expired.wait(BOUND_S) and len(calls) == 2
