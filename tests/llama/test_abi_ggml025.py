"""apir.guest.backend.abi's ggml 0.25.3 entry (graph_optimize takes a third argument) against
the C compiler's view of the llama.cpp build's ggml-backend-impl.h, as
tests/guest_backend/test_abi.py checks 0.20 and 0.10."""

from types import SimpleNamespace

from apir.guest.backend import abi as abi_mod
from tests.guest_backend.abikit import c_layout, py_layout


def test_struct_layouts_match_the_c_header(llama_paths, tmp_path):
    a = abi_mod.abi_for(SimpleNamespace(version="0.25.3"))
    paths = {"GGML_INCLUDE": llama_paths["GGML_INCLUDE"], "GGML_SRC": llama_paths["GGML_SRC"]}
    c, py = c_layout(paths, a, tmp_path), py_layout(a)
    assert set(c) == set(py)
    assert {k: (py[k], c[k]) for k in c if py[k] != c[k]} == {}
    # the one difference from 0.20: graph_optimize(backend, cgraph, params)
    assert a.protos["ggml_backend_i"]["graph_optimize"]._argtypes_ == (
        abi_mod.ctypes.c_void_p, abi_mod.ctypes.c_void_p, abi_mod.ctypes.c_void_p)
