import os
import threading
import time

import pytest

from apir.host.vhost_user import VhostUserServer

from .frontend import FakeFrontend

SHM_SIZE = 64 << 20


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def make_server(tmp_path):
    servers = []

    def make(name="vgpu.sock", **kwargs):
        kwargs.setdefault("shm_size", SHM_SIZE)
        srv = VhostUserServer(os.fspath(tmp_path / name), **kwargs).start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.close()


@pytest.fixture
def server(make_server):
    return make_server()


@pytest.fixture
def fe(server):
    f = FakeFrontend.connect(server.path)
    yield f
    f.close()


class BusyContext:
    """A HostContext stand-in whose SUBMIT_3D runs until `release` is set (or 30 s)."""

    def __init__(self):
        self.release = threading.Event()
        self.busy = threading.Event()
        self.resources = {}

    def add_resource(self, res_id, memory):
        self.resources[res_id] = memory

    def remove_resource(self, res_id):
        self.resources.pop(res_id, None)

    def submit(self, command):
        self.busy.set()
        self.release.wait(30)

    def cancel_compute(self, reason):
        self.release.set()

    def close(self):
        pass


@pytest.fixture
def busy(make_server):
    contexts = {}

    def factory(ctx_id, capset_id, config):
        contexts[ctx_id] = BusyContext()
        return contexts[ctx_id]

    srv = make_server(context_factory=factory)
    fe = FakeFrontend.connect(srv.path)
    yield srv, fe, contexts
    for c in contexts.values():
        c.release.set()
    fe.close()
