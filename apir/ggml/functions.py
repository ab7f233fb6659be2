"""The C functions apir calls in libggml, declared once: `GgmlFunctions`, one typed field per
function with its signature.

Theory of operation: every ggml function apir (and its tests) calls is a field of
`GgmlFunctions` below, with its C signature in letters (`sig("R:ARGS")`: one letter for the
result, then one per argument, from `SIGNATURE_LETTERS`). `declare(cdlls, where)` looks each
one up in a build's libraries and gives it its ctypes `restype` / `argtypes`; a function the
build lacks becomes a `MissingFunction`, which is falsy and raises `GgmlLoadError` when
called (test with `Ggml.has(name)`). A function not declared here is not an attribute at
all, so mypy and `hasattr` see exactly this list. Pointers to ggml objects are plain `p`.

To call a new ggml function: add its field here, under the comment of its header.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Sequence

from apir.ggml.errors import GgmlLoadError

__all__ = ["GgmlFunctions", "MissingFunction", "SIGNATURES", "SIGNATURE_LETTERS", "InitParams", "Cplan", "declare"]


class InitParams(ctypes.Structure):
    """`struct ggml_init_params` (ggml.h), passed by value to `ggml_init`."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Cplan(ctypes.Structure):
    """`struct ggml_cplan` (ggml-cpu.h, the same in ggml 0.10 and 0.20), returned by value by
    `ggml_graph_plan`; apir reads only `work_size` (apir.host.graph.work_plan)."""

    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


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
    "C": Cplan,
}

# A declared ggml function: a ctypes function pointer (or a MissingFunction).
Fn = Callable[..., Any]


def sig(letters: str) -> Any:
    """The dataclass field of one ggml function with C signature `letters` ("R:ARGS")."""
    return dataclasses.field(metadata={"sig": letters})


class MissingFunction:
    """A function of `GgmlFunctions` that this ggml build does not export: falsy, and
    calling it raises GgmlLoadError naming the function and the build."""

    def __init__(self, name: str, where: Path):
        self.name = name
        self.where = where

    def __bool__(self) -> bool:
        return False

    def __call__(self, *args: Any) -> Any:
        raise GgmlLoadError(f"{self.name}: not in this ggml build ({self.where})")

    def __repr__(self) -> str:
        return f"MissingFunction({self.name!r})"


@dataclass(eq=False, kw_only=True, slots=True, repr=False)
class GgmlFunctions:
    """The ggml functions apir calls, each declared with its signature (see the module doc)."""

    # ggml.h: context, tensors, types, ops
    ggml_version: Fn = sig("s:")
    ggml_commit: Fn = sig("s:")
    ggml_init: Fn = sig("p:P")
    ggml_threadpool_params_init: Fn = sig("v:pi")
    ggml_free: Fn = sig("v:p")
    ggml_get_mem_size: Fn = sig("z:p")
    ggml_used_mem: Fn = sig("z:p")
    ggml_tensor_overhead: Fn = sig("z:")
    ggml_graph_overhead: Fn = sig("z:")
    ggml_graph_overhead_custom: Fn = sig("z:zb")
    ggml_type_name: Fn = sig("s:i")
    ggml_op_name: Fn = sig("s:i")
    ggml_op_desc: Fn = sig("s:p")
    ggml_type_size: Fn = sig("z:i")
    ggml_blck_size: Fn = sig("I:i")
    ggml_row_size: Fn = sig("z:iI")
    ggml_is_quantized: Fn = sig("b:i")
    ggml_nbytes: Fn = sig("z:p")
    ggml_nelements: Fn = sig("I:p")
    ggml_new_tensor: Fn = sig("p:piip")
    ggml_new_tensor_1d: Fn = sig("p:piI")
    ggml_new_tensor_2d: Fn = sig("p:piII")
    ggml_new_tensor_3d: Fn = sig("p:piIII")
    ggml_new_tensor_4d: Fn = sig("p:piIIII")
    ggml_set_name: Fn = sig("p:ps")
    ggml_get_name: Fn = sig("s:p")
    ggml_set_input: Fn = sig("v:p")
    ggml_set_output: Fn = sig("v:p")
    ggml_get_first_tensor: Fn = sig("p:p")
    ggml_get_next_tensor: Fn = sig("p:pp")
    ggml_new_graph: Fn = sig("p:p")
    ggml_new_graph_custom: Fn = sig("p:pzb")
    ggml_build_forward_expand: Fn = sig("v:pp")
    ggml_graph_n_nodes: Fn = sig("i:p")
    ggml_graph_node: Fn = sig("p:pi")
    ggml_graph_nodes: Fn = sig("p:p")
    ggml_graph_size: Fn = sig("i:p")
    ggml_graph_add_node: Fn = sig("v:pp")
    ggml_graph_clear: Fn = sig("v:p")
    ggml_validate_row_data: Fn = sig("b:ipz")
    # ggml.h: ops used by apir's graphs and tests (more can be added as needed)
    ggml_add: Fn = sig("p:ppp")
    ggml_mul: Fn = sig("p:ppp")
    ggml_sub: Fn = sig("p:ppp")
    ggml_div: Fn = sig("p:ppp")
    ggml_mul_mat: Fn = sig("p:ppp")
    ggml_scale: Fn = sig("p:ppf")
    ggml_soft_max: Fn = sig("p:pp")
    ggml_soft_max_ext: Fn = sig("p:pppff")
    ggml_rms_norm: Fn = sig("p:ppf")
    ggml_norm: Fn = sig("p:ppf")
    ggml_gelu: Fn = sig("p:pp")
    ggml_gelu_erf: Fn = sig("p:pp")
    ggml_silu: Fn = sig("p:pp")
    ggml_relu: Fn = sig("p:pp")
    ggml_tanh: Fn = sig("p:pp")
    ggml_get_rows: Fn = sig("p:ppp")
    ggml_cont: Fn = sig("p:pp")
    ggml_cpy: Fn = sig("p:ppp")
    ggml_dup: Fn = sig("p:pp")
    ggml_reshape_2d: Fn = sig("p:ppII")
    ggml_reshape_3d: Fn = sig("p:ppIII")
    ggml_reshape_4d: Fn = sig("p:ppIIII")
    ggml_view_1d: Fn = sig("p:ppIz")
    ggml_view_2d: Fn = sig("p:ppIIzz")
    ggml_view_3d: Fn = sig("p:ppIIIzzz")
    ggml_permute: Fn = sig("p:ppiiii")
    ggml_transpose: Fn = sig("p:pp")
    ggml_sum_rows: Fn = sig("p:pp")
    ggml_mean: Fn = sig("p:pp")
    ggml_rope: Fn = sig("p:pppii")
    ggml_sqr: Fn = sig("p:pp")
    ggml_sqrt: Fn = sig("p:pp")
    # ggml-backend.h
    ggml_backend_buft_name: Fn = sig("s:p")
    ggml_backend_buft_alloc_buffer: Fn = sig("p:pz")
    ggml_backend_buft_get_alignment: Fn = sig("z:p")
    ggml_backend_buft_get_max_size: Fn = sig("z:p")
    ggml_backend_buft_get_alloc_size: Fn = sig("z:pp")
    ggml_backend_buft_is_host: Fn = sig("b:p")
    ggml_backend_buft_get_device: Fn = sig("p:p")
    ggml_backend_buffer_name: Fn = sig("s:p")
    ggml_backend_buffer_free: Fn = sig("v:p")
    ggml_backend_buffer_get_base: Fn = sig("p:p")
    ggml_backend_buffer_get_size: Fn = sig("z:p")
    ggml_backend_buffer_init_tensor: Fn = sig("i:pp")
    ggml_backend_buffer_get_alignment: Fn = sig("z:p")
    ggml_backend_buffer_get_alloc_size: Fn = sig("z:pp")
    ggml_backend_buffer_clear: Fn = sig("v:pB")
    ggml_backend_buffer_is_host: Fn = sig("b:p")
    ggml_backend_buffer_set_usage: Fn = sig("v:pi")
    ggml_backend_buffer_get_type: Fn = sig("p:p")
    ggml_backend_tensor_copy: Fn = sig("v:pp")
    ggml_backend_tensor_set: Fn = sig("v:ppzz")
    ggml_backend_tensor_get: Fn = sig("v:ppzz")
    ggml_backend_tensor_set_async: Fn = sig("v:pppzz")
    ggml_backend_tensor_get_async: Fn = sig("v:pppzz")
    ggml_backend_tensor_memset: Fn = sig("v:pBzz")
    ggml_backend_tensor_alloc: Fn = sig("i:ppp")
    ggml_backend_view_init: Fn = sig("i:p")
    ggml_backend_name: Fn = sig("s:p")
    ggml_backend_free: Fn = sig("v:p")
    ggml_backend_get_default_buffer_type: Fn = sig("p:p")
    ggml_backend_synchronize: Fn = sig("v:p")
    ggml_backend_tensor_copy_async: Fn = sig("v:pppp")
    ggml_backend_event_new: Fn = sig("p:p")
    ggml_backend_event_free: Fn = sig("v:p")
    ggml_backend_event_record: Fn = sig("v:pp")
    ggml_backend_event_synchronize: Fn = sig("v:p")
    ggml_backend_event_wait: Fn = sig("v:pp")
    ggml_backend_graph_compute: Fn = sig("i:pp")
    ggml_backend_supports_op: Fn = sig("b:pp")
    ggml_backend_get_device: Fn = sig("p:p")
    ggml_backend_dev_name: Fn = sig("s:p")
    ggml_backend_dev_description: Fn = sig("s:p")
    ggml_backend_dev_memory: Fn = sig("v:ppp")
    ggml_backend_dev_type: Fn = sig("i:p")
    ggml_backend_dev_get_props: Fn = sig("v:pp")
    ggml_backend_dev_backend_reg: Fn = sig("p:p")
    ggml_backend_dev_init: Fn = sig("p:ps")
    ggml_backend_dev_buffer_type: Fn = sig("p:p")
    ggml_backend_dev_buffer_from_host_ptr: Fn = sig("p:ppzz")
    ggml_backend_dev_supports_op: Fn = sig("b:pp")
    ggml_backend_dev_supports_buft: Fn = sig("b:pp")
    ggml_backend_reg_name: Fn = sig("s:p")
    ggml_backend_reg_dev_count: Fn = sig("z:p")
    ggml_backend_reg_dev_get: Fn = sig("p:pz")
    ggml_backend_reg_get_proc_address: Fn = sig("p:ps")
    ggml_backend_register: Fn = sig("v:p")
    ggml_backend_reg_count: Fn = sig("z:")
    ggml_backend_reg_get: Fn = sig("p:z")
    ggml_backend_reg_by_name: Fn = sig("p:s")
    ggml_backend_dev_count: Fn = sig("z:")
    ggml_backend_dev_get: Fn = sig("p:z")
    ggml_backend_dev_by_name: Fn = sig("p:s")
    ggml_backend_dev_by_type: Fn = sig("p:i")
    ggml_backend_init_by_name: Fn = sig("p:ss")
    ggml_backend_load: Fn = sig("p:s")
    ggml_backend_cpu_buffer_from_ptr: Fn = sig("p:pz")
    ggml_backend_cpu_buffer_type: Fn = sig("p:")
    ggml_backend_alloc_ctx_tensors_from_buft: Fn = sig("p:pp")
    # ggml-cpu.h
    ggml_backend_cpu_init: Fn = sig("p:")
    ggml_backend_cpu_set_n_threads: Fn = sig("v:pi")
    ggml_backend_is_cpu: Fn = sig("b:p")
    # ggml-alloc.h
    ggml_gallocr_new: Fn = sig("p:p")
    ggml_gallocr_free: Fn = sig("v:p")
    ggml_gallocr_alloc_graph: Fn = sig("b:pp")
    ggml_gallocr_reserve: Fn = sig("b:pp")
    ggml_gallocr_get_buffer_size: Fn = sig("z:pi")
    # --- host (apir/host): shape checks, buffer copies, device props, status names ---
    ggml_can_repeat: Fn = sig("b:pp")
    ggml_are_same_shape: Fn = sig("b:pp")
    ggml_is_contiguous: Fn = sig("b:p")
    ggml_is_contiguous_rows: Fn = sig("b:p")
    ggml_get_unary_op: Fn = sig("i:p")
    ggml_unary_op_name: Fn = sig("s:i")
    ggml_backend_buffer_copy_tensor: Fn = sig("b:pp")
    ggml_backend_dev_host_buffer_type: Fn = sig("p:p")
    ggml_status_to_string: Fn = sig("s:i")
    ggml_backend_cpu_reg: Fn = sig("p:")
    # models (apir.models: the all-MiniLM-L6-v2 graph)
    ggml_l2_norm: Fn = sig("p:ppf")
    # guest ggml backend (apir/guest/backend) and its numpy helpers
    ggml_n_dims: Fn = sig("i:p")
    # host shape rules (apir/host/graph/shapes/ tests): ops built with ggml's own constructors
    ggml_log: Fn = sig("p:pp")
    ggml_sin: Fn = sig("p:pp")
    ggml_cos: Fn = sig("p:pp")
    ggml_clamp: Fn = sig("p:ppff")
    ggml_leaky_relu: Fn = sig("p:ppfb")
    ggml_group_norm: Fn = sig("p:ppif")
    ggml_add1: Fn = sig("p:ppp")
    ggml_diag_mask_inf: Fn = sig("p:ppi")
    ggml_diag_mask_zero: Fn = sig("p:ppi")
    ggml_soft_max_add_sinks: Fn = sig("v:pp")
    ggml_glu: Fn = sig("p:ppib")
    ggml_glu_split: Fn = sig("p:pppi")
    ggml_sum: Fn = sig("p:pp")
    ggml_argmax: Fn = sig("p:pp")
    ggml_count_equal: Fn = sig("p:ppp")
    ggml_repeat: Fn = sig("p:ppp")
    ggml_repeat_back: Fn = sig("p:ppp")
    ggml_concat: Fn = sig("p:pppi")
    ggml_pad_ext: Fn = sig("p:ppiiiiiiii")
    ggml_arange: Fn = sig("p:pfff")
    ggml_timestep_embedding: Fn = sig("p:ppii")
    ggml_argsort: Fn = sig("p:ppi")
    ggml_top_k: Fn = sig("p:ppi")
    ggml_set_rows: Fn = sig("p:pppp")
    ggml_rope_ext: Fn = sig("p:ppppiiiffffff")
    ggml_rope_multi: Fn = sig("p:ppppipiiffffff")
    # host shape rules of the training ops (apir/host/graph/shapes/backward.py, rope.py tests)
    ggml_silu_back: Fn = sig("p:ppp")
    ggml_rms_norm_back: Fn = sig("p:pppf")
    ggml_soft_max_ext_back: Fn = sig("p:pppff")
    ggml_cross_entropy_loss: Fn = sig("p:ppp")
    ggml_cross_entropy_loss_back: Fn = sig("p:pppp")
    ggml_opt_step_adamw: Fn = sig("p:pppppp")
    ggml_opt_step_sgd: Fn = sig("p:pppp")
    ggml_set_param: Fn = sig("v:p")
    ggml_rope_ext_back: Fn = sig("p:ppppiiiffffff")
    ggml_rope_multi_back: Fn = sig("p:ppppipiiffffff")
    ggml_rope_ext_inplace: Fn = sig("p:ppppiiiffffff")
    ggml_mul_mat_id: Fn = sig("p:pppp")
    ggml_out_prod: Fn = sig("p:ppp")
    ggml_add_id: Fn = sig("p:pppp")
    ggml_get_rows_back: Fn = sig("p:pppp")
    ggml_view_4d: Fn = sig("p:ppIIIIzzzz")
    ggml_mul_mat_set_hint: Fn = sig("v:pi")
    # host shape rules of the attention, convolution and tensor ops (their tests); a
    # constructor this build lacks is simply not declared and its cases are skipped
    ggml_flash_attn_ext: Fn = sig("p:pppppfff")
    ggml_flash_attn_ext_add_sinks: Fn = sig("v:pp")
    ggml_flash_attn_ext_set_prec: Fn = sig("v:pi")
    ggml_ssm_conv: Fn = sig("p:ppp")
    ggml_ssm_scan: Fn = sig("p:ppppppppI")
    ggml_rwkv_wkv6: Fn = sig("p:ppppppp")
    ggml_rwkv_wkv7: Fn = sig("p:pppppppp")
    ggml_lightning_indexer: Fn = sig("p:ppppp")
    ggml_dsv4_hc_comb: Fn = sig("p:ppppfi")
    ggml_dsv4_hc_pre: Fn = sig("p:ppp")
    ggml_dsv4_hc_post: Fn = sig("p:ppppp")
    ggml_gated_linear_attn: Fn = sig("p:ppppppf")
    ggml_gated_delta_net: Fn = sig("p:pppppppI")
    ggml_im2col: Fn = sig("p:pppiiiiiibi")
    ggml_im2col_back: Fn = sig("p:ppppiiiiiib")
    ggml_im2col_3d: Fn = sig("p:pppIiiiiiiiiii")
    ggml_col2im_1d: Fn = sig("p:ppiii")
    ggml_conv_2d_direct: Fn = sig("p:pppiiiiii")
    ggml_conv_3d_direct: Fn = sig("p:pppiiiiiiiiiiii")
    ggml_conv_2d_dw_direct: Fn = sig("p:pppiiiiii")
    ggml_conv_transpose_1d: Fn = sig("p:pppiii")
    ggml_conv_transpose_2d_p0: Fn = sig("p:pppi")
    ggml_pool_1d: Fn = sig("p:ppiiii")
    ggml_pool_2d: Fn = sig("p:ppiiiiiff")
    ggml_pool_2d_back: Fn = sig("p:pppiiiiiff")
    ggml_interpolate: Fn = sig("p:ppIIIIu")
    ggml_pad_reflect_1d: Fn = sig("p:ppii")
    ggml_roll: Fn = sig("p:ppiiii")
    ggml_win_part: Fn = sig("p:ppi")
    ggml_win_unpart: Fn = sig("p:ppiii")
    ggml_get_rel_pos: Fn = sig("p:ppii")
    ggml_add_rel_pos: Fn = sig("p:pppp")
    ggml_acc: Fn = sig("p:pppzzzz")
    ggml_acc_inplace: Fn = sig("p:pppzzzz")
    ggml_set: Fn = sig("p:pppzzzz")
    ggml_set_inplace: Fn = sig("p:pppzzzz")
    ggml_set_1d: Fn = sig("p:pppz")
    ggml_set_2d_inplace: Fn = sig("p:pppzz")
    ggml_cumsum: Fn = sig("p:pp")
    ggml_fill: Fn = sig("p:ppf")
    ggml_fill_inplace: Fn = sig("p:ppf")
    ggml_diag: Fn = sig("p:pp")
    ggml_tri: Fn = sig("p:ppi")
    ggml_solve_tri: Fn = sig("p:pppbbb")
    ggml_unary: Fn = sig("p:ppi")
    ggml_unary_inplace: Fn = sig("p:ppi")
    ggml_xielu: Fn = sig("p:ppffff")
    ggml_add_inplace: Fn = sig("p:ppp")
    ggml_mul_inplace: Fn = sig("p:ppp")
    ggml_add_cast: Fn = sig("p:pppi")
    # host shape rules (apir/host/graph/shapes/): which types the CPU can quantize into (from_float)
    # host shape rules of what ggml 0.25 added (tests/host/shapes, cases needing a Feature of 0.25)
    ggml_swiglu_clamp: Fn = sig("p:pppf")
    ggml_rope_set_offset: Fn = sig("p:pi")
    ggml_dsv4_hc_pre_gated: Fn = sig("p:pppf")
    ggml_get_type_traits_cpu: Fn = sig("p:i")
    ggml_get_type_traits: Fn = sig("p:i")
    # host work-size bound (apir/host/graph/work_plan.py): struct ggml_cplan returned by value
    ggml_graph_plan: Fn = sig("C:pip")


# name -> "R:ARGS", read from the fields above (for tests and tools that list them).
SIGNATURES: Dict[str, str] = {f.name: f.metadata["sig"] for f in dataclasses.fields(GgmlFunctions)}


def _declare_one(cdlls: Sequence[ctypes.CDLL], name: str, letters: str, where: Path) -> Fn:
    res, _, args = letters.partition(":")
    for cdll in cdlls:
        try:
            fn = getattr(cdll, name)
        except AttributeError:
            continue
        fn.restype = SIGNATURE_LETTERS[res]
        fn.argtypes = [SIGNATURE_LETTERS[c] for c in args]
        return fn
    return MissingFunction(name, where)


def declare(cdlls: Sequence[ctypes.CDLL], where: Path) -> Dict[str, Fn]:
    """Every function of `GgmlFunctions` looked up in `cdlls` (first match wins) and
    declared: {name: function or MissingFunction}, the keyword arguments of a
    GgmlFunctions (or Ggml). `where` names the build in errors."""
    return {name: _declare_one(cdlls, name, letters, where) for name, letters in SIGNATURES.items()}
