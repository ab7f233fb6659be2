"""The guest's client test suite (tests/guest/test_client.py) over the local transports: an
embedded host (a thread of this process) and a separate `apir host serve` process, both
serving the real HostContext over the CPU backend of libggml-python."""

import threading

import pytest

from apir.guest.client import ApirClient
from apir.local.embedded import EmbeddedDevice
from apir.guest.local import LocalDevice
from tests.local.hostproc import HostProcess

guest_suite = pytest.importorskip("tests.guest.test_client")
WINDOW = guest_suite.WINDOW  # the guest suite's small data window: transfers get chunked


@pytest.fixture(scope="module", params=["embedded", "socket"])
def client(request, tmp_path_factory):
    host = None
    if request.param == "embedded":
        device = EmbeddedDevice()
    else:
        host = HostProcess(tmp_path_factory.mktemp("host") / "apir.sock")
        device = LocalDevice(host.path)
    c = ApirClient.connect(device, data_size=WINDOW, handshake_timeout_s=60)  # (a fresh host process)
    yield c
    c.close()
    if host is not None:
        host.stop()


@pytest.fixture(scope="module")
def is_c_host():
    return False  # both transports serve apir.host's HostContext


g = guest_suite.g
buffer = guest_suite.buffer

# The client-path tests of the guest suite, unchanged; they take `client` from here.
test_device_functions_match_the_cpu_backend = guest_suite.test_device_functions_match_the_cpu_backend
test_buffer_type_functions = guest_suite.test_buffer_type_functions
test_inline_tensors_supports_op_and_alloc_size = guest_suite.test_inline_tensors_supports_op_and_alloc_size
test_set_get_chunked_roundtrip_and_base = guest_suite.test_set_get_chunked_roundtrip_and_base
test_cpy_clear_and_graph_compute = guest_suite.test_cpy_clear_and_graph_compute
test_graph_larger_than_the_window_uses_a_temporary_blob = \
    guest_suite.test_graph_larger_than_the_window_uses_a_temporary_blob
test_buffer_clear = guest_suite.test_buffer_clear
test_buffer_from_ptr_is_zero_copy = guest_suite.test_buffer_from_ptr_is_zero_copy


def test_handshake_over_the_transport(client):
    assert client.host_version == (0, 2)
    assert client.remote.capset_id == 10


def test_eight_threads_of_mixed_calls(client, g, buffer):
    """The guest suite's eight-thread test over the transport. It counts the commands the
    device ran (`device.submitted`, which its test device keeps): here the client's device
    counts its execbuffer calls through a wrapper, for the length of the test."""
    device = client.remote.device
    execbuffer, lock = device.execbuffer, threading.Lock()

    def counted(*args, **kwargs):
        with lock:
            device.submitted += 1
        return execbuffer(*args, **kwargs)

    device.submitted = 0
    device.execbuffer = counted
    try:
        guest_suite.test_eight_threads_of_mixed_calls(client, g, buffer)
    finally:
        del device.execbuffer, device.submitted
