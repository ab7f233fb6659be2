"""Loading libggml through ctypes, and what apir reads from it at start-up.

Theory of operation: apir never hard-codes what differs between ggml builds. `load()` opens
the three shared libraries (libggml-base, libggml-cpu, libggml) of one ggml build, parses
the `ggml.h` that came with it for the op and type enums and the GGML_MAX_* sizes, checks
those against the library itself (`ggml_op_name`, `ggml_type_name`, `ggml_tensor_overhead`,
a real tensor's field offsets, see `apir.ggml.layout`), and returns one `Ggml` object with
the functions declared.

Which build: `APIR_GGML_LIB_DIR` (a folder with the .so files) and `APIR_GGML_INCLUDE_DIR`
(a folder with ggml.h) select another build; by default the pinned libggml-python wheel's
`libggml/lib64` and `libggml/include`. The build-c-reference.sh outputs work as they are.

Errors: `GgmlLoadError` names the file or the symbol that is missing or disagrees.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np

from apir.codec.records import GgmlLimits
from apir.errors import ApirError

__all__ = ["Ggml", "GgmlLoadError", "load", "default_paths", "SIGNATURES", "SIGNATURE_LETTERS", "InitParams"]

ENV_LIB_DIR = "APIR_GGML_LIB_DIR"
ENV_INCLUDE_DIR = "APIR_GGML_INCLUDE_DIR"


class GgmlLoadError(ApirError, RuntimeError):
    """The ggml build cannot be used: a library, header, symbol or layout is missing or off."""


class InitParams(ctypes.Structure):
    """`struct ggml_init_params` (ggml.h), passed by value to `ggml_init`."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_P = ctypes.c_void_p
# Signature letters: one for the result, then one per argument ("v", void, as a result only).
# The one table: apir.guest.backend.abi types ggml's interface callbacks with it too.
SIGNATURE_LETTERS: Dict[str, Any] = {
    "v": None,
    "p": ctypes.c_void_p,
    "s": ctypes.c_char_p,
    "z": ctypes.c_size_t,
    "i": ctypes.c_int,
    "I": ctypes.c_int64,
    "u": ctypes.c_uint32,
    "b": ctypes.c_bool,
    "f": ctypes.c_float,
    "B": ctypes.c_uint8,
    "P": InitParams,
}

# name -> "R:ARGS" in the letters above. Pointers to ggml objects are plain `p`.
# Add what a module needs here, so every declaration lives in one place.
SIGNATURES: Dict[str, str] = {
    # ggml.h: context, tensors, types, ops
    "ggml_version": "s:",
    "ggml_commit": "s:",
    "ggml_init": "p:P",
    "ggml_free": "v:p",
    "ggml_tensor_overhead": "z:",
    "ggml_graph_overhead": "z:",
    "ggml_graph_overhead_custom": "z:zb",
    "ggml_type_name": "s:i",
    "ggml_op_name": "s:i",
    "ggml_op_desc": "s:p",
    "ggml_type_size": "z:i",
    "ggml_blck_size": "I:i",
    "ggml_row_size": "z:iI",
    "ggml_is_quantized": "b:i",
    "ggml_nbytes": "z:p",
    "ggml_nelements": "I:p",
    "ggml_new_tensor": "p:piip",
    "ggml_new_tensor_1d": "p:piI",
    "ggml_new_tensor_2d": "p:piII",
    "ggml_new_tensor_3d": "p:piIII",
    "ggml_new_tensor_4d": "p:piIIII",
    "ggml_set_name": "p:ps",
    "ggml_get_name": "s:p",
    "ggml_set_input": "v:p",
    "ggml_set_output": "v:p",
    "ggml_get_first_tensor": "p:p",
    "ggml_get_next_tensor": "p:pp",
    "ggml_new_graph": "p:p",
    "ggml_new_graph_custom": "p:pzb",
    "ggml_build_forward_expand": "v:pp",
    "ggml_graph_n_nodes": "i:p",
    "ggml_graph_node": "p:pi",
    "ggml_graph_nodes": "p:p",
    "ggml_graph_size": "i:p",
    "ggml_graph_add_node": "v:pp",
    "ggml_graph_clear": "v:p",
    "ggml_validate_row_data": "b:ipz",
    # ggml.h: ops used by apir's graphs and tests (more can be added as needed)
    "ggml_add": "p:ppp",
    "ggml_mul": "p:ppp",
    "ggml_sub": "p:ppp",
    "ggml_div": "p:ppp",
    "ggml_mul_mat": "p:ppp",
    "ggml_scale": "p:ppf",
    "ggml_soft_max": "p:pp",
    "ggml_soft_max_ext": "p:pppff",
    "ggml_rms_norm": "p:ppf",
    "ggml_norm": "p:ppf",
    "ggml_gelu": "p:pp",
    "ggml_gelu_erf": "p:pp",
    "ggml_silu": "p:pp",
    "ggml_relu": "p:pp",
    "ggml_tanh": "p:pp",
    "ggml_get_rows": "p:ppp",
    "ggml_cont": "p:pp",
    "ggml_cpy": "p:ppp",
    "ggml_dup": "p:pp",
    "ggml_reshape_2d": "p:ppII",
    "ggml_reshape_3d": "p:ppIII",
    "ggml_reshape_4d": "p:ppIIII",
    "ggml_view_1d": "p:ppIz",
    "ggml_view_2d": "p:ppIIzz",
    "ggml_view_3d": "p:ppIIIzzz",
    "ggml_permute": "p:ppiiii",
    "ggml_transpose": "p:pp",
    "ggml_sum_rows": "p:pp",
    "ggml_mean": "p:pp",
    "ggml_rope": "p:pppii",
    "ggml_sqr": "p:pp",
    "ggml_sqrt": "p:pp",
    # ggml-backend.h
    "ggml_backend_buft_name": "s:p",
    "ggml_backend_buft_alloc_buffer": "p:pz",
    "ggml_backend_buft_get_alignment": "z:p",
    "ggml_backend_buft_get_max_size": "z:p",
    "ggml_backend_buft_get_alloc_size": "z:pp",
    "ggml_backend_buft_is_host": "b:p",
    "ggml_backend_buft_get_device": "p:p",
    "ggml_backend_buffer_name": "s:p",
    "ggml_backend_buffer_free": "v:p",
    "ggml_backend_buffer_get_base": "p:p",
    "ggml_backend_buffer_get_size": "z:p",
    "ggml_backend_buffer_init_tensor": "i:pp",
    "ggml_backend_buffer_get_alignment": "z:p",
    "ggml_backend_buffer_get_alloc_size": "z:pp",
    "ggml_backend_buffer_clear": "v:pB",
    "ggml_backend_buffer_is_host": "b:p",
    "ggml_backend_buffer_set_usage": "v:pi",
    "ggml_backend_buffer_get_type": "p:p",
    "ggml_backend_tensor_copy": "v:pp",
    "ggml_backend_tensor_set": "v:ppzz",
    "ggml_backend_tensor_get": "v:ppzz",
    "ggml_backend_tensor_memset": "v:pBzz",
    "ggml_backend_tensor_alloc": "i:ppp",
    "ggml_backend_view_init": "i:p",
    "ggml_backend_name": "s:p",
    "ggml_backend_free": "v:p",
    "ggml_backend_get_default_buffer_type": "p:p",
    "ggml_backend_synchronize": "v:p",
    "ggml_backend_graph_compute": "i:pp",
    "ggml_backend_supports_op": "b:pp",
    "ggml_backend_get_device": "p:p",
    "ggml_backend_dev_name": "s:p",
    "ggml_backend_dev_description": "s:p",
    "ggml_backend_dev_memory": "v:ppp",
    "ggml_backend_dev_type": "i:p",
    "ggml_backend_dev_get_props": "v:pp",
    "ggml_backend_dev_backend_reg": "p:p",
    "ggml_backend_dev_init": "p:ps",
    "ggml_backend_dev_buffer_type": "p:p",
    "ggml_backend_dev_buffer_from_host_ptr": "p:ppzz",
    "ggml_backend_dev_supports_op": "b:pp",
    "ggml_backend_dev_supports_buft": "b:pp",
    "ggml_backend_reg_name": "s:p",
    "ggml_backend_reg_dev_count": "z:p",
    "ggml_backend_reg_dev_get": "p:pz",
    "ggml_backend_reg_get_proc_address": "p:ps",
    "ggml_backend_register": "v:p",
    "ggml_backend_reg_count": "z:",
    "ggml_backend_reg_get": "p:z",
    "ggml_backend_reg_by_name": "p:s",
    "ggml_backend_dev_count": "z:",
    "ggml_backend_dev_get": "p:z",
    "ggml_backend_dev_by_name": "p:s",
    "ggml_backend_dev_by_type": "p:i",
    "ggml_backend_init_by_name": "p:ss",
    "ggml_backend_load": "p:s",
    "ggml_backend_cpu_buffer_from_ptr": "p:pz",
    "ggml_backend_cpu_buffer_type": "p:",
    "ggml_backend_alloc_ctx_tensors_from_buft": "p:pp",
    # ggml-cpu.h
    "ggml_backend_cpu_init": "p:",
    "ggml_backend_cpu_set_n_threads": "v:pi",
    "ggml_backend_is_cpu": "b:p",
    # ggml-alloc.h
    "ggml_gallocr_new": "p:p",
    "ggml_gallocr_free": "v:p",
    "ggml_gallocr_alloc_graph": "b:pp",
    "ggml_gallocr_reserve": "b:pp",
    "ggml_gallocr_get_buffer_size": "z:pi",
    # --- host (apir/host): shape checks, buffer copies, device props, status names ---
    "ggml_can_repeat": "b:pp",
    "ggml_are_same_shape": "b:pp",
    "ggml_is_contiguous": "b:p",
    "ggml_is_contiguous_rows": "b:p",
    "ggml_get_unary_op": "i:p",
    "ggml_unary_op_name": "s:i",
    "ggml_backend_buffer_copy_tensor": "b:pp",
    "ggml_backend_dev_host_buffer_type": "p:p",
    "ggml_status_to_string": "s:i",
    "ggml_backend_cpu_reg": "p:",
    # models (apir.models: the all-MiniLM-L6-v2 graph)
    "ggml_l2_norm": "p:ppf",
    # guest ggml backend (apir/guest/backend) and its numpy helpers
    "ggml_n_dims": "i:p",
    # host shape rules (apir/host/shapes/ tests): ops built with ggml's own constructors
    "ggml_log": "p:pp",
    "ggml_sin": "p:pp",
    "ggml_cos": "p:pp",
    "ggml_clamp": "p:ppff",
    "ggml_leaky_relu": "p:ppfb",
    "ggml_group_norm": "p:ppif",
    "ggml_add1": "p:ppp",
    "ggml_diag_mask_inf": "p:ppi",
    "ggml_diag_mask_zero": "p:ppi",
    "ggml_soft_max_add_sinks": "v:pp",
    "ggml_glu": "p:ppib",
    "ggml_glu_split": "p:pppi",
    "ggml_sum": "p:pp",
    "ggml_argmax": "p:pp",
    "ggml_count_equal": "p:ppp",
    "ggml_repeat": "p:ppp",
    "ggml_repeat_back": "p:ppp",
    "ggml_concat": "p:pppi",
    "ggml_pad_ext": "p:ppiiiiiiii",
    "ggml_arange": "p:pfff",
    "ggml_timestep_embedding": "p:ppii",
    "ggml_argsort": "p:ppi",
    "ggml_top_k": "p:ppi",
    "ggml_set_rows": "p:pppp",
    "ggml_rope_ext": "p:ppppiiiffffff",
    "ggml_rope_multi": "p:ppppipiiffffff",
    # host shape rules of the training ops (apir/host/shapes/backward.py, rope.py tests)
    "ggml_silu_back": "p:ppp",
    "ggml_rms_norm_back": "p:pppf",
    "ggml_soft_max_ext_back": "p:pppff",
    "ggml_cross_entropy_loss": "p:ppp",
    "ggml_cross_entropy_loss_back": "p:pppp",
    "ggml_opt_step_adamw": "p:pppppp",
    "ggml_opt_step_sgd": "p:pppp",
    "ggml_set_param": "v:p",
    "ggml_rope_ext_back": "p:ppppiiiffffff",
    "ggml_rope_multi_back": "p:ppppipiiffffff",
    "ggml_rope_ext_inplace": "p:ppppiiiffffff",
    "ggml_mul_mat_id": "p:pppp",
    "ggml_out_prod": "p:ppp",
    "ggml_add_id": "p:pppp",
    "ggml_get_rows_back": "p:pppp",
    "ggml_view_4d": "p:ppIIIIzzzz",
    "ggml_mul_mat_set_hint": "v:pi",
    # host shape rules of the attention, convolution and tensor ops (their tests); a
    # constructor this build lacks is simply not declared and its cases are skipped
    "ggml_flash_attn_ext": "p:pppppfff",
    "ggml_flash_attn_ext_add_sinks": "v:pp",
    "ggml_flash_attn_ext_set_prec": "v:pi",
    "ggml_ssm_conv": "p:ppp",
    "ggml_ssm_scan": "p:ppppppppI",
    "ggml_rwkv_wkv6": "p:ppppppp",
    "ggml_rwkv_wkv7": "p:pppppppp",
    "ggml_lightning_indexer": "p:ppppp",
    "ggml_dsv4_hc_comb": "p:ppppfi",
    "ggml_dsv4_hc_pre": "p:ppp",
    "ggml_dsv4_hc_post": "p:ppppp",
    "ggml_gated_linear_attn": "p:ppppppf",
    "ggml_gated_delta_net": "p:pppppppI",
    "ggml_im2col": "p:pppiiiiiibi",
    "ggml_im2col_back": "p:ppppiiiiiib",
    "ggml_im2col_3d": "p:pppIiiiiiiiiii",
    "ggml_col2im_1d": "p:ppiii",
    "ggml_conv_2d_direct": "p:pppiiiiii",
    "ggml_conv_3d_direct": "p:pppiiiiiiiiiiii",
    "ggml_conv_2d_dw_direct": "p:pppiiiiii",
    "ggml_conv_transpose_1d": "p:pppiii",
    "ggml_conv_transpose_2d_p0": "p:pppi",
    "ggml_pool_1d": "p:ppiiii",
    "ggml_pool_2d": "p:ppiiiiiff",
    "ggml_pool_2d_back": "p:pppiiiiiff",
    "ggml_interpolate": "p:ppIIIIu",
    "ggml_pad_reflect_1d": "p:ppii",
    "ggml_roll": "p:ppiiii",
    "ggml_win_part": "p:ppi",
    "ggml_win_unpart": "p:ppiii",
    "ggml_get_rel_pos": "p:ppii",
    "ggml_add_rel_pos": "p:pppp",
    "ggml_acc": "p:pppzzzz",
    "ggml_acc_inplace": "p:pppzzzz",
    "ggml_set": "p:pppzzzz",
    "ggml_set_inplace": "p:pppzzzz",
    "ggml_set_1d": "p:pppz",
    "ggml_set_2d_inplace": "p:pppzz",
    "ggml_cumsum": "p:pp",
    "ggml_fill": "p:ppf",
    "ggml_fill_inplace": "p:ppf",
    "ggml_diag": "p:pp",
    "ggml_tri": "p:ppi",
    "ggml_solve_tri": "p:pppbbb",
    "ggml_unary": "p:ppi",
    "ggml_unary_inplace": "p:ppi",
    "ggml_xielu": "p:ppffff",
    "ggml_add_inplace": "p:ppp",
    "ggml_mul_inplace": "p:ppp",
    "ggml_add_cast": "p:pppi",
    # host shape rules (apir/host/shapes/): which types the CPU can quantize into (from_float)
    "ggml_get_type_traits_cpu": "p:i",
    "ggml_get_type_traits": "p:i",
}


def _declare(cdll_list, name: str, sig: str):
    res, _, args = sig.partition(":")
    for cdll in cdll_list:
        try:
            fn = getattr(cdll, name)
        except AttributeError:
            continue
        fn.restype = SIGNATURE_LETTERS[res]
        fn.argtypes = [SIGNATURE_LETTERS[c] for c in args]
        return fn
    return None


@dataclass
class _HeaderFacts:
    ops: Dict[str, int]
    types: Dict[str, int]
    limits: GgmlLimits
    tensor_flags: Dict[str, int]


def _parse_enum(text: str, enum_name: str, prefix: str) -> Dict[str, int]:
    m = re.search(r"enum\s+%s\s*\{(.*?)\};" % re.escape(enum_name), text, re.S)
    if not m:
        raise GgmlLoadError(f"ggml.h: enum {enum_name} not found")
    body = re.sub(r"//[^\n]*|/\*.*?\*/", "", m.group(1), flags=re.S)
    out: Dict[str, int] = {}
    value = -1
    for item in body.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, expr = item.partition("=")
        name = name.strip()
        value = int(expr.strip(), 0) if expr.strip() else value + 1
        if name.startswith(prefix):
            out[name[len(prefix) :]] = value
    return out


def _parse_header(path: Path) -> _HeaderFacts:
    text = path.read_text()

    def define(name: str) -> int:
        m = re.search(r"#\s*define\s+%s\s+(\d+)" % name, text)
        if not m:
            raise GgmlLoadError(f"{path}: #define {name} not found")
        return int(m.group(1))

    limits = GgmlLimits(
        define("GGML_MAX_DIMS"), define("GGML_MAX_SRC"), define("GGML_MAX_OP_PARAMS"), define("GGML_MAX_NAME")
    )
    return _HeaderFacts(
        _parse_enum(text, "ggml_op", "GGML_OP_"),
        _parse_enum(text, "ggml_type", "GGML_TYPE_"),
        limits,
        _parse_enum(text, "ggml_tensor_flag", "GGML_TENSOR_FLAG_"),
    )


def default_paths() -> tuple[Path, Path]:
    """(lib_dir, include_dir) from the environment, else the libggml-python wheel's."""
    lib_dir = os.environ.get(ENV_LIB_DIR)
    inc_dir = os.environ.get(ENV_INCLUDE_DIR)
    if lib_dir and inc_dir:
        return Path(lib_dir), Path(inc_dir)
    try:
        import libggml  # the libggml-python wheel: only data, no Python API
    except ImportError as exc:  # pragma: no cover - a broken install
        raise GgmlLoadError("libggml-python is not installed and APIR_GGML_LIB_DIR is not set") from exc
    root = Path(libggml.__file__).parent
    return Path(lib_dir or root / "lib64"), Path(inc_dir or root / "include")


class Ggml:
    """One loaded ggml build. Functions are attributes (`g.ggml_add(...)`), declared from
    `SIGNATURES`; `ops` / `types` map names (``"ADD"``, ``"F32"``) to enum values;
    `op_count` / `type_count` are GGML_OP_COUNT / GGML_TYPE_COUNT of this build."""

    def __init__(self, lib_dir: Path, include_dir: Path):
        self.lib_dir = Path(lib_dir)
        self.include_dir = Path(include_dir)
        self.cdlls = []
        for stem in ("libggml-base", "libggml-cpu", "libggml"):
            path = self.lib_dir / f"{stem}.so"
            if not path.exists():
                raise GgmlLoadError(f"{path}: not found (set {ENV_LIB_DIR} to a ggml build)")
            # RTLD_GLOBAL: the CPU backend and ggml resolve their symbols against ggml-base.
            self.cdlls.append(ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL))
        header = self.include_dir / "ggml.h"
        if not header.exists():
            raise GgmlLoadError(f"{header}: not found (set {ENV_INCLUDE_DIR})")
        facts = _parse_header(header)
        self.ops = facts.ops
        self.types = facts.types
        self.limits = facts.limits
        self.tensor_flags = facts.tensor_flags  # "COMPUTE" -> GGML_TENSOR_FLAG_COMPUTE, ...
        self.op_count = self.ops.pop("COUNT")
        self.type_count = self.types.pop("COUNT")
        self.op_names = {v: k for k, v in self.ops.items()}
        self.type_names = {v: k for k, v in self.types.items()}
        for name, sig in SIGNATURES.items():
            fn = _declare(self.cdlls, name, sig)
            if fn is not None:
                setattr(self, name, fn)
        self.version = self.ggml_version().decode()
        self._check_enums()

    def __getattr__(self, name):
        # Only reached for names not declared: a symbol this build lacks, or one not in SIGNATURES.
        if name.startswith("ggml_"):
            raise GgmlLoadError(f"{name}: not in this ggml build ({self.lib_dir}) or not in SIGNATURES")
        raise AttributeError(name)

    def _check_enums(self) -> None:
        # ggml_op_name(op) returns GGML_OP_NAME[op]: the header's names must match it.
        for name, value in self.ops.items():
            got = self.ggml_op_name(value).decode()
            if got != name:
                raise GgmlLoadError(f"ggml.h and {self.lib_dir} disagree: op {value} is {name} vs {got}")
        for name, value in self.types.items():
            got = self.ggml_type_name(value)
            if got is not None and got.decode().upper() != name:
                raise GgmlLoadError(f"ggml.h and {self.lib_dir} disagree: type {value} is {name} vs {got!r}")

    @functools.cached_property
    def valid_types(self) -> np.ndarray:
        """bool[GGML_TYPE_COUNT]: True for the types this build can hold data of, the one
        definition of a valid type: named in ggml.h's `enum ggml_type` (removed types are holes
        there) and with a block size and an element size (`ggml_blck_size`, `ggml_type_size`;
        ggml keeps placeholders of some removed types with neither). The `type_valid`
        argument of `apir.codec.graph.parse_graph`."""
        valid = np.zeros(self.type_count, dtype=np.bool_)
        for t in self.type_names:
            valid[t] = self.ggml_type_size(t) > 0 and self.ggml_blck_size(t) > 0
        return valid

    @functools.cached_property
    def statuses(self) -> Dict[str, int]:
        """`enum ggml_status` of this build's ggml.h without the prefix: {"ALLOC_FAILED": -2,
        "FAILED": -1, "SUCCESS": 0, "ABORTED": 1} in ggml 0.10 and 0.20."""
        return _parse_enum((self.include_dir / "ggml.h").read_text(), "ggml_status", "GGML_STATUS_")

    def valid_type(self, type_: int) -> bool:
        """Whether `type_` is a valid type of this build (`valid_types`)."""
        return 0 <= type_ < self.type_count and bool(self.valid_types[type_])


_loaded: Dict[tuple, Ggml] = {}
_lock = threading.Lock()


def load(lib_dir: Optional[os.PathLike] = None, include_dir: Optional[os.PathLike] = None) -> Ggml:
    """The ggml build at (`lib_dir`, `include_dir`), default `default_paths()`; loaded and
    checked once per process. Raises GgmlLoadError."""
    if lib_dir is None or include_dir is None:
        d_lib, d_inc = default_paths()
        lib_dir = lib_dir or d_lib
        include_dir = include_dir or d_inc
    key = (str(Path(lib_dir).resolve()), str(Path(include_dir).resolve()))
    with _lock:
        g = _loaded.get(key)
        if g is None:
            g = Ggml(Path(key[0]), Path(key[1]))
            from apir.ggml.layout import check_layout  # noqa: E402 - avoids an import cycle

            check_layout(g)
            _loaded[key] = g
        return g
