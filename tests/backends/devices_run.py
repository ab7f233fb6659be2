"""Child process of tests/backends/test_vulkan_devices.py (the ggml Vulkan build on lavapipe)
and test_rpc_devices.py: a graph split by ggml's scheduler locally, then over the two devices
of an apir host serving argv[1] (default `cpu,vulkan:0`, split locally over ggml CPU and
Vulkan; two `rpc:` servers of ggml CPU are compared with ggml CPU alone); prints n_splits
and each output as hex."""

import sys

from apir.ggml import load
from apir.guest.backend import ApirBackend
from apir.guest.client import ApirClient
from apir.local.embedded import EmbeddedDevice
from tests.guest_backend.deviceskit import split_compute, values


def main():
    spec = sys.argv[1] if len(sys.argv) > 1 else "cpu,vulkan:0"
    g = load()
    data = values()
    cpu = g.ggml_backend_cpu_init()
    vk = None
    if "vulkan" in spec:
        vk_dev = g.ggml_backend_reg_dev_get(g.ggml_backend_reg_by_name(b"Vulkan"), 0)
        vk = g.ggml_backend_dev_init(vk_dev, None)
        bufts = [g.ggml_backend_cpu_buffer_type(), g.ggml_backend_dev_buffer_type(vk_dev)]
        (local,), n, _ = split_compute(g, bufts, [vk, cpu], data, times=1)
    else:
        cpu_buft = g.ggml_backend_cpu_buffer_type()
        (local,), n, _ = split_compute(g, [cpu_buft, cpu_buft], [cpu], data, times=1)
    print("local", n, local.tobytes().hex())
    client = ApirClient.connect(EmbeddedDevice(config={"apir.host.backend": spec}))
    dev0, dev1 = ApirBackend(client.on_device(0), g), ApirBackend(client.on_device(1), g)
    print("devices", client.device_count, g.ggml_backend_dev_description(dev1.device).decode())
    outs, n, _ = split_compute(g, [dev0.buffer_type, dev1.buffer_type], [dev1.backend, dev0.backend, cpu], data)
    for out in outs:
        print("apir", n, out.tobytes().hex())
    dev0.close()
    dev1.close()
    client.close()
    if vk:
        g.ggml_backend_free(vk)
    g.ggml_backend_free(cpu)


if __name__ == "__main__":
    main()
