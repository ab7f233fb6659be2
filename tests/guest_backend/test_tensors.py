"""apir.guest.backend.tensors on ggml's CPU backend (the helpers work on any backend)."""

import numpy as np
import pytest

from apir.ggml.lib import InitParams
from apir.guest.backend import numpy_dtype, tensor_get, tensor_set, tensor_shape


@pytest.fixture
def cpu_ctx(ggml):
    g = ggml
    ctx = g.ggml_init(InitParams(16 * g.ggml_tensor_overhead(), None, True))
    made = []

    def alloc():
        buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, g.ggml_backend_cpu_buffer_type())
        made.append(buf)
        return buf

    yield ctx, alloc
    for buf in made:
        g.ggml_backend_buffer_free(buf)
    g.ggml_free(ctx)


def test_dtypes_and_shapes(ggml, cpu_ctx):
    g = ggml
    ctx, alloc = cpu_ctx
    assert numpy_dtype(g, g.types["F32"]) == np.float32
    assert numpy_dtype(g, g.types["F16"]) == np.float16
    assert numpy_dtype(g, g.types["I32"]) == np.int32
    assert numpy_dtype(g, g.types["Q4_0"]) == np.uint8
    with pytest.raises(ValueError, match="does not exist"):
        numpy_dtype(g, 10_000)
    a = g.ggml_new_tensor_3d(ctx, g.types["F32"], 4, 3, 2)
    q = g.ggml_new_tensor_2d(ctx, g.types["Q4_0"], 64, 2)
    s = g.ggml_new_tensor_1d(ctx, g.types["I8"], 1)
    assert tensor_shape(g, a) == (2, 3, 4)
    assert tensor_shape(g, q) == (2 * 2 * 18,)  # two blocks of 18 bytes per row
    assert tensor_shape(g, s) == (1,)


def test_round_trip_and_errors(ggml, cpu_ctx):
    g = ggml
    ctx, alloc = cpu_ctx
    a = g.ggml_new_tensor_2d(ctx, g.types["F32"], 4, 3)
    q = g.ggml_new_tensor_2d(ctx, g.types["Q8_0"], 32, 1)
    with pytest.raises(ValueError, match="no data"):
        tensor_get(g, a)
    alloc()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensor_set(g, a, x)
    np.testing.assert_array_equal(tensor_get(g, a), x)
    tensor_set(g, a, x.T.copy().T)  # any layout of the same values: made contiguous first
    np.testing.assert_array_equal(tensor_get(g, a), x)
    raw = np.arange(34, dtype=np.uint8)
    tensor_set(g, q, raw)
    assert tensor_get(g, q).tobytes() == raw.tobytes()
    with pytest.raises(ValueError, match="dtype"):
        tensor_set(g, a, x.astype(np.float64))
    with pytest.raises(ValueError, match="bytes"):
        tensor_set(g, a, x[:2])
    t = g.ggml_transpose(ctx, a)
    with pytest.raises(ValueError, match="not contiguous"):
        tensor_get(g, t)
