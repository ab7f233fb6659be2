"""apir.api, the Python API: `apir.open` on each transport, graphs computed through it equal
numpy's, errors name the accepted forms, devices close, `apir.embed` goes through APIR and
equals the local CPU's embeddings; `import apir` stays light."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import apir
from apir.models.backends import BackendUnavailable

REPO = Path(__file__).resolve().parents[1]
SENTENCES = ["A man is eating food.", "The sky is blue today.", "A cheetah is running behind its prey."]


def _matmul_add(dev, a, b, c):
    """ggml_add(ggml_mul_mat(a, b), c) computed on `dev`: numpy's b @ a.T + c."""
    g = dev.ggml
    f32 = g.types["F32"]
    with dev.context() as ctx:
        ta = g.ggml_new_tensor_2d(ctx, f32, a.shape[1], a.shape[0])
        tb = g.ggml_new_tensor_2d(ctx, f32, b.shape[1], b.shape[0])
        tc = g.ggml_new_tensor_2d(ctx, f32, c.shape[1], c.shape[0])
        out = g.ggml_add(ctx, g.ggml_mul_mat(ctx, ta, tb), tc)
        graph = g.ggml_new_graph(ctx)
        g.ggml_build_forward_expand(graph, out)
        dev.alloc_tensors(ctx)
        for t, arr in ((ta, a), (tb, b), (tc, c)):
            dev.set(t, arr)
        dev.compute(graph)
        return dev.get(out)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    a = rng.integers(-8, 8, (5, 7)).astype(np.float32)  # small integers: exact in float32
    b = rng.integers(-8, 8, (3, 7)).astype(np.float32)
    c = rng.integers(-8, 8, (3, 5)).astype(np.float32)
    return a, b, c


def test_import_apir_loads_neither_numpy_nor_numba():
    code = "import sys, apir; print(sorted(m for m in ('numpy', 'numba') if m in sys.modules), apir.open.__module__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "apir.api"]


def test_graph_on_the_embedded_device_equals_numpy():
    a, b, c = _inputs()
    with apir.open("embedded") as dev:
        assert dev.kind == "embedded" and "through APIR" in dev.description
        assert dev.host_version >= (0, 1)
        result = _matmul_add(dev, a, b, c)
    assert result.shape == (3, 5)
    assert np.array_equal(result, b @ a.T + c)


def test_graph_on_a_socket_host_equals_numpy(tmp_path):
    from apir.host.local.server import LocalServer

    a, b, c = _inputs(1)
    with LocalServer(str(tmp_path / "h.sock")).start() as srv:
        with apir.open(f"unix:{tmp_path / 'h.sock'}") as dev:
            assert dev.kind == "socket"
            result = _matmul_add(dev, a, b, c)
            assert srv.stats().contexts == 1  # the host behind the socket served it
    assert np.array_equal(result, b @ a.T + c)


def test_embedded_backend_and_config_reach_the_host():
    with apir.open("embedded", backend="cpu", config={"apir.host.n_threads": "1"}) as dev:
        assert np.array_equal(_matmul_add(dev, *_inputs(2)), _inputs(2)[1] @ _inputs(2)[0].T + _inputs(2)[2])


@pytest.mark.parametrize("spec, why", [("vulkan:0", "unknown device 'vulkan:0'"), ("", "unknown device ''"),
                                       ("unix", "needs a path"), ("embedded:x", "takes no argument")])
def test_a_bad_device_string_names_the_accepted_forms(spec, why):
    with pytest.raises(apir.DeviceError, match=why) as info:
        apir.open(spec)
    assert "embedded, unix:PATH, drm[:PATH]" in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, apir.ApirError)


def test_host_options_only_for_an_embedded_host_and_known_keys():
    with pytest.raises(apir.DeviceError, match="configure an embedded host"):
        apir.open("unix:/nonexistent/apir.sock", backend="cpu")
    with pytest.raises(apir.DeviceError, match=r"'apir.host.bogus': not a host configuration key \(known: .*n_threads"):
        apir.open("embedded", config={"apir.host.bogus": "1"})


def test_a_backend_the_build_cannot_serve_is_refused_naming_what_is_missing():
    import apir.ggml

    with pytest.raises(apir.DeviceError, match=r"backend 'nosuch': 'nosuch': this ggml has no backend 'nosuch'"):
        apir.open("embedded", backend="nosuch")
    if apir.ggml.load().ggml_backend_reg_by_name(b"Vulkan"):
        return
    with pytest.raises(apir.DeviceError, match=r"no vulkan device: scripts/build-ggml-backends.sh .*docs/gpu.md"):
        apir.open("embedded", backend="vulkan:0")


@pytest.mark.parametrize("spec", ["unix:/nonexistent/apir.sock", "drm:/nonexistent/renderD128"])
def test_an_unreachable_device_raises_not_falls_back(spec):
    with pytest.raises(BackendUnavailable, match="cannot open the APIR"):
        apir.open(spec)


def test_close_frees_the_buffers_and_the_device_refuses_use():
    with apir.open() as dev:
        _matmul_add(dev, *_inputs())
        backend = dev._apir
        assert backend.live_buffers == 1
    assert dev.closed and backend.closed and backend.live_buffers == 0
    dev.close()  # idempotent
    with pytest.raises(apir.DeviceError, match="closed"):
        dev.compute(0)
    assert "closed" in repr(dev)


@pytest.fixture(scope="module")
def local_cpu_embeddings():
    from apir.models.assets import ModelNotInstalled
    from apir.models.minilm import embed

    try:
        return embed(SENTENCES)  # backend None: ggml CPU in this process, not through APIR
    except ModelNotInstalled as exc:
        pytest.skip(str(exc))


def test_embed_through_apir_equals_local_cpu(local_cpu_embeddings):
    vectors = apir.embed(SENTENCES)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(vectors, local_cpu_embeddings, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_embed_on_an_open_device_leaves_it_open(local_cpu_embeddings, tmp_path):
    from apir.host.local.server import LocalServer

    with LocalServer(str(tmp_path / "h.sock")).start() as srv, apir.open(f"unix:{tmp_path / 'h.sock'}") as dev:
        vectors = apir.embed(SENTENCES[:2], device=dev)
        assert srv.stats().contexts == 1 and not dev.closed
        assert np.array_equal(_matmul_add(dev, *_inputs()), _inputs()[1] @ _inputs()[0].T + _inputs()[2])
    np.testing.assert_allclose(vectors, local_cpu_embeddings[:2], atol=1e-5)


def test_embed_goes_to_the_device_named(local_cpu_embeddings):
    with pytest.raises(BackendUnavailable):
        apir.embed(SENTENCES, device="unix:/nonexistent/apir.sock")
    with pytest.raises(TypeError, match="sequence of sentences"):
        apir.embed("one string")
