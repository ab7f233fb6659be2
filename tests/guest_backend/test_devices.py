"""Several host devices behind one guest (the devices extension): a host serving
`apir.host.backend=cpu,cpu`, one ApirBackend per device (`client.on_device(i)`), and ggml's
own scheduler splitting a graph over the two by where its weights live. The split computes
what the same graph computes on ggml's CPU backend here, byte for byte, twice (the second
time the guest replays each split's graph by id), with no device_select between the splits.
tests/backends/test_vulkan_devices.py: the same over CPU + lavapipe Vulkan."""

import pytest

from apir.codec.constants import ApirExtension
from apir.guest.backend import ApirBackend
from apir.guest.client import ApirClient
from apir.local.embedded import EmbeddedDevice
from tests.guest_backend.deviceskit import split_compute, values


@pytest.fixture()
def client():
    c = ApirClient.connect(EmbeddedDevice(config={"apir.host.backend": "cpu,cpu"}))
    yield c
    c.close()


def test_a_graph_split_over_two_host_devices_equals_local_cpu(ggml, client):
    g = ggml
    assert client.extensions & ApirExtension.DEVICES and client.device_count == 2
    data = values()
    cpu = g.ggml_backend_cpu_init()
    try:
        cpu_buft = g.ggml_backend_cpu_buffer_type()
        (local,), _, _ = split_compute(g, [cpu_buft, cpu_buft], [cpu], data, times=1)
        dev0, dev1 = ApirBackend(client.on_device(0), g), ApirBackend(client.on_device(1), g)
        try:
            before = client.selected_device
            outs, n_splits, placed = split_compute(
                g, [dev0.buffer_type, dev1.buffer_type], [dev0.backend, dev1.backend, cpu], data
            )
            assert client.selected_device == before  # graphs go to their buffers' device
        finally:
            dev0.close()
            dev1.close()
    finally:
        g.ggml_backend_free(cpu)
    assert n_splits >= 2 and {dev0.backend, dev1.backend} <= placed
    assert local.any() and all(out.tobytes() == local.tobytes() for out in outs)
    libs = client.remote.device.kernel.ctx._library.devices
    assert len(libs) == 2 and all(lib.graph_cache.misses for lib in libs)  # each built its split
