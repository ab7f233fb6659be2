"""Child process of tests/backends/test_vulkan_fusion.py (the ggml Vulkan build on lavapipe):
x -> rms_norm -> mul(w) -> add(x) computed locally on ggml Vulkan and through apir's embedded
host on the same device, with apir.host.use_counts as argv[1] ("on" / "off"). ggml-vulkan's
perf logger (GGML_VK_PERF_LOGGER, set by the parent) prints each dispatched op, fused ones
under their fused name ("RMS_NORM_MUL"); this prints a marker line between the two runs and
each run's output bytes as hex."""

import sys

import numpy as np

from apir.ggml import load
from apir.ggml.lib import InitParams
from apir.guest.backend import ApirBackend, tensor_get, tensor_set
from apir.guest.client import ApirClient
from apir.local.embedded import EmbeddedDevice


def run(g, buft, compute):
    ctx = g.ggml_init(InitParams(64 * g.ggml_tensor_overhead() + g.ggml_graph_overhead(), None, True))
    f32 = g.types["F32"]
    x = g.ggml_new_tensor_2d(ctx, f32, 256, 4)
    w = g.ggml_new_tensor_1d(ctx, f32, 256)
    y = g.ggml_add(ctx, g.ggml_mul(ctx, g.ggml_rms_norm(ctx, x, 1e-6), w), x)
    g.ggml_set_output(y)
    gf = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(gf, y)
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    rng = np.random.default_rng(2)
    tensor_set(g, x, rng.standard_normal((4, 256), dtype=np.float32))
    tensor_set(g, w, rng.standard_normal(256, dtype=np.float32))
    compute(gf)
    out = tensor_get(g, y)
    g.ggml_backend_buffer_free(buf)
    g.ggml_free(ctx)
    return out


def main():
    g = load()
    reg = g.ggml_backend_reg_by_name(b"Vulkan")
    dev = g.ggml_backend_reg_dev_get(reg, 0)
    backend = g.ggml_backend_dev_init(dev, None)
    local = run(g, g.ggml_backend_dev_buffer_type(dev), lambda gf: g.ggml_backend_graph_compute(backend, gf))
    g.ggml_backend_free(backend)  # (the perf logger prints as the backend goes)
    print("=== through apir", flush=True)
    sys.stderr.flush()
    config = {"apir.host.backend": "vulkan:0", "apir.host.use_counts": sys.argv[1]}
    client = ApirClient.connect(EmbeddedDevice(config=config))
    apir = ApirBackend(client, g)
    remote = run(g, apir.buffer_type, apir.graph_compute)
    apir.close()
    client.close()
    print("local", local.tobytes().hex())
    print("apir", remote.tobytes().hex())


if __name__ == "__main__":
    main()
