"""apir.accel: with Numba and llvmlite impossible to import, the codec, the guest and the host
still import (the plain path), a graph serializes and parses, `apir info` runs, a graph
computes guest -> host to ggml CPU's bytes, and Numba stays unloaded."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]  # run from here: this checkout's apir is imported

_BLOCKED = textwrap.dedent(
    """
    import sys

    class NoNumba:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("numba", "llvmlite"):
                raise ImportError(f"{name} is blocked")
            return None

    sys.meta_path.insert(0, NoNumba())
    """
)


def run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


def run_blocked(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python where importing numba or llvmlite raises ImportError."""
    return run(_BLOCKED + textwrap.dedent(code))


@pytest.mark.parametrize(
    "module",
    [
        "apir.codec",
        "apir.codec.graph",
        "apir.codec.atomics",
        "apir.codec.copy",
        "apir.guest.client",
        "apir.guest.remote",
        "apir.guest.local",
        "apir.host.component.context",
        "apir.local.embedded",
        "apir.local.exec_ring",
        "apir.host.backend.compute_abort",
        "apir.host",
        "apir.host.backend.dispatcher",
        "apir.host.backend.library",
        "apir.host.graph.build",
        "apir.host.graph.cache",
        "apir.host.local.server",
        "apir.host.vhost_user.server",
        "apir.devices",
        "apir.cli",
    ],
)
def test_imports_without_numba(module):
    res = run_blocked(
        f"""
        import importlib
        from apir import accel
        importlib.import_module({module!r})
        assert not accel.enabled()
        assert "numba" not in sys.modules and "llvmlite" not in sys.modules, "Numba was loaded"
        """
    )
    assert res.returncode == 0, res.stderr[-3000:]


def test_graph_serializes_and_parses_without_numba():
    """The guest's serializer and the host's parse, on a real ggml graph, with Numba blocked."""
    res = run_blocked(
        """
        import apir.ggml
        from apir.codec.graph import BufferTable, parse_graph, serialize_graph
        from apir.ggml import InitParams

        g = apir.ggml.load()
        ctx = g.ggml_init(InitParams(64 * g.ggml_tensor_overhead() + 4 * g.ggml_graph_overhead(), None, True))
        a = g.ggml_new_tensor_2d(ctx, g.types["F32"], 4, 3)
        b = g.ggml_new_tensor_2d(ctx, g.types["F32"], 4, 3)
        out = g.ggml_mul(ctx, g.ggml_add(ctx, a, b), g.ggml_view_2d(ctx, a, 4, 3, 16, 0))
        cgraph = g.ggml_new_graph(ctx)
        g.ggml_build_forward_expand(cgraph, out)
        raw = serialize_graph(g, cgraph, BufferTable())
        p = parse_graph(raw, op_count=g.op_count, type_valid=g.valid_types, limits=g.limits)
        assert (p.n_nodes, p.n_tensors, p.size) == (3, 5, len(raw))  # add, view, mul; a, b and those
        assert [int(i) for i in p.tensors["id"]][-1] == out and list(p.order) == list(range(5))
        g.ggml_free(ctx)
        assert "numba" not in sys.modules
        """
    )
    assert res.returncode == 0, res.stderr[-3000:]


def test_switch_off_by_environment():
    """APIR_ACCEL=0 with Numba installed: the plain path, and Numba not even imported."""
    code = "import sys; from apir import accel; import apir.codec.graph, apir.codec.atomics, apir.codec.copy, apir.guest.client; print(accel.enabled(), 'numba' in sys.modules)"
    res = run(code, APIR_ACCEL="0")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]


def test_apir_info_runs_without_numba():
    """`apir info` (guest -> embedded host on ggml CPU: HandShake, LoadLibrary, device calls)."""
    res = run_blocked(
        """
        from apir.cli import entry
        sys.argv = ["apir", "info"]
        try:
            entry()
        except SystemExit as exc:
            assert not exc.code, exc.code
        assert "numba" not in sys.modules and "llvmlite" not in sys.modules, "Numba was loaded"
        """
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "guest 0.2, host 0.2" in res.stdout and "buffer type:        CPU" in res.stdout, res.stdout


def test_graph_computes_through_apir_without_numba():
    """A graph placed in remote buffers and computed by the embedded host equals ggml CPU's
    local result, byte for byte, with Numba blocked on both halves."""
    res = run_blocked(
        """
        import numpy as np
        import apir.ggml
        from apir.ggml.lib import InitParams
        from apir.guest.backend import ApirBackend, tensor_get, tensor_set
        from apir.guest.client import ApirClient
        from apir.local.embedded import EmbeddedDevice

        g = apir.ggml.load()
        f32 = g.types["F32"]
        rng = np.random.default_rng(5)
        xa, xb = rng.standard_normal((2, 3, 8), dtype=np.float32), rng.standard_normal((3, 8), dtype=np.float32)

        def run(buft, compute):
            ctx = g.ggml_init(InitParams(16 * g.ggml_tensor_overhead() + g.ggml_graph_overhead(), None, True))
            a, b = g.ggml_new_tensor_3d(ctx, f32, 8, 3, 2), g.ggml_new_tensor_2d(ctx, f32, 8, 3)
            out = g.ggml_soft_max(ctx, g.ggml_mul(ctx, g.ggml_add(ctx, a, b), a))
            gf = g.ggml_new_graph(ctx)
            g.ggml_build_forward_expand(gf, out)
            buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
            tensor_set(g, a, xa)
            tensor_set(g, b, xb)
            compute(gf)
            result = tensor_get(g, out)
            g.ggml_backend_buffer_free(buf)
            g.ggml_free(ctx)
            return result

        cpu = g.ggml_backend_cpu_init()
        local = run(g.ggml_backend_cpu_buffer_type(), lambda gf: g.ggml_backend_graph_compute(cpu, gf))
        g.ggml_backend_free(cpu)
        client = ApirClient.connect(EmbeddedDevice())
        with ApirBackend(client, g) as backend:
            remote = run(backend.buffer_type, backend.graph_compute)
        client.close()
        assert remote.shape == (2, 3, 8) and np.isfinite(local).all()
        assert remote.tobytes() == local.tobytes()
        assert "numba" not in sys.modules and "llvmlite" not in sys.modules, "Numba was loaded"
        """
    )
    assert res.returncode == 0, res.stderr[-3000:]
