import os
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
