"""APIR end to end through the fake front-end: apir's guest client over a virtio-gpu driver
stand-in (tests/vhost_user/guest_driver.py), the device, and the real HostContext on the CPU
backend of libggml-python. The guest client suite's tests run unchanged on top."""

import pytest

from apir.guest.client import ApirClient

from .frontend import FakeFrontend
from .guest_driver import FrontendDriver

guest_suite = pytest.importorskip("tests.guest.test_client")
WINDOW = guest_suite.WINDOW


@pytest.fixture(scope="module")
def vhost(tmp_path_factory):
    from apir.host.vhost_user import VhostUserServer

    path = tmp_path_factory.mktemp("vhost") / "vgpu.sock"
    srv = VhostUserServer(str(path), shm_size=64 << 20).start()
    fe = FakeFrontend.connect(srv.path)
    yield srv, fe
    fe.close()
    srv.close()


@pytest.fixture(scope="module")
def client(vhost):
    srv, fe = vhost
    c = ApirClient.connect(FrontendDriver(fe), data_size=WINDOW, handshake_timeout_s=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def is_c_host():
    return False


g = guest_suite.g
buffer = guest_suite.buffer

test_device_functions_match_the_cpu_backend = guest_suite.test_device_functions_match_the_cpu_backend
test_set_get_chunked_roundtrip_and_base = guest_suite.test_set_get_chunked_roundtrip_and_base
test_cpy_clear_and_graph_compute = guest_suite.test_cpy_clear_and_graph_compute
test_graph_larger_than_the_window_uses_a_temporary_blob = (
    guest_suite.test_graph_larger_than_the_window_uses_a_temporary_blob
)


def test_handshake_through_the_device(client, vhost):
    srv, _ = vhost
    assert client.host_version == (0, 2)
    assert client.remote.capset_id == 10
    c = srv.counts()
    assert c.contexts == 1 and c.blobs >= 2  # the reply and data blobs


def test_closing_the_client_frees_its_context_blobs_and_buffers(vhost):
    srv, fe = vhost
    before = srv.counts()
    c = ApirClient.connect(
        FrontendDriver(fe, ctx_id=50, first_res_id=5000, bar_base=32 << 20), data_size=WINDOW, handshake_timeout_s=60
    )
    buft = c.device_get_buffer_type()
    c.buffer_type_alloc_buffer(buft, 1 << 20)
    during = srv.counts()
    assert during.contexts == before.contexts + 1 and during.ggml_buffers == before.ggml_buffers + 1
    c.close()
    after = srv.counts()
    assert (after.contexts, after.blobs, after.blob_bytes, after.ggml_buffers) == (
        before.contexts,
        before.blobs,
        before.blob_bytes,
        before.ggml_buffers,
    )
