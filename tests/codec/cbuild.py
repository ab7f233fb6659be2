"""Builds and loads tests/codec/c/codec_ref.cpp: ggml-virtgpu's C codec (apir_cs.h helpers,
apir_serialize_graph, and the C host's apir_deserialize_graph) behind a few extern "C"
functions, for the tests and the benchmark.

The shared library is compiled against the C reference's headers (the `cref_020` paths)
together with the C guest's apir_cs_ggml-rpc-front.cpp, and linked against nothing: its
ggml symbols (ggml_abort, ggml_log_internal) resolve against the libggml that
`apir.ggml.load()` opened with RTLD_GLOBAL, so load that first.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

SOURCE = Path(__file__).parent / "c" / "codec_ref.cpp"

# ctypes declarations of codec_ref.cpp's functions: name -> (restype, argtypes)
_P, _Z, _U64, _I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int
_FUNCS = {
    "ref_new_buffer": (_P, [_U64, _P]),
    "ref_free_buffer": (None, [_P]),
    "ref_serialize_graph": (_Z, [_P, _P, _Z]),
    "ref_time_serialize_graph": (ctypes.c_double, [_P, _I]),
    "ref_serialize_tensor": (_Z, [_P, _P]),
    "ref_encode_all": (_Z, [_P, _Z]),
    "ref_decode_all": (_I, [_P, _Z, _P]),
    "ref_layout": (_I, [_P]),
    "ref_track_buffer": (None, [_P]),
    "ref_untrack_buffer": (None, [_P]),
    "ref_time_deserialize_graph": (ctypes.c_double, [_P, _Z, _I]),
}


def build(paths: dict, outdir: Path) -> Path:
    """Compiles codec_ref.so into `outdir` (about 3 s); returns its path. `paths` is the C
    reference's paths.env (GGML_SRC, GGML_INCLUDE, VIRTGPU_DRM_INCLUDE)."""
    src = Path(paths["GGML_SRC"])
    virtgpu = src / "src" / "ggml-virtgpu"
    out = Path(outdir) / "codec_ref.so"
    flags = ["-std=c++17", "-O2", "-DNDEBUG", "-fPIC", "-w",
             "-I", paths["GGML_INCLUDE"], "-I", str(src / "src"), "-I", str(virtgpu),
             "-I", str(virtgpu / "include"), "-I", "/usr/include/libdrm",
             "-I", paths["VIRTGPU_DRM_INCLUDE"]]
    # the C host's deserializer, its ggml_init renamed so the harness sees (and frees) the context
    back = Path(outdir) / "apir_cs_ggml-rpc-back.o"
    steps = [["g++", *flags, "-Dggml_init=ref_tracked_ggml_init", "-c",
              str(virtgpu / "backend" / "apir_cs_ggml-rpc-back.cpp"), "-o", str(back)],
             ["g++", *flags, "-shared", str(SOURCE), str(virtgpu / "apir_cs_ggml-rpc-front.cpp"), str(back),
              "-o", str(out)]]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {out.name} failed:\n{done.stderr[-4000:]}")
    return out


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (res, args) in _FUNCS.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib
