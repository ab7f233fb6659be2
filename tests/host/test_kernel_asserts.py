"""Issue 13, class 4, machine-checked for the ops of apir.host.shapes.conv, .matrix and
.tensor_ops: every GGML_ASSERT of each op's CPU kernel (ggml 0.20 and 0.10) is in
`KERNEL_ASSERTS`, with either a graph that violates it (`V`: edits of a valid case's records)
or the reason no guest graph reaches it (`Why`: another test shows it, or ggml itself keeps
it). Three tests: the table lists exactly the asserts of the kernels in the C sources (where
the C reference sources are present), each `V` graph is refused by the op's own rule before
compute, and the host then serves the next graph. The op-by-op audit is docs/rule-audit.md."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import tests.host.test_shapes_conv as conv
import tests.host.test_shapes_matrix as matrix
import tests.host.test_shapes_tensor_ops as tensor_ops
from tests.host.shapekit import ERROR, Remote


@dataclass(frozen=True)
class V:
    """A violation: `edits` of (field, role, index, value) on case `case` of the op (its
    n-th case in the shape tests); field is ne, nb (index a dimension), type (value a type
    name) or param (index an op_params slot); role is dst, src0, src1 or src2."""

    edits: tuple[tuple, ...]
    case: int = 0
    since: tuple = (0, 0, 0)  # the ggml version whose kernel has the assert


@dataclass(frozen=True)
class Why:
    """An assert no edit of the records reaches, and what keeps it (a test, or ggml)."""

    reason: str


Cover = V | Why


def v(*edits, case=0, since=(0, 0, 0)) -> V:
    return V(tuple(edits), case, since)


I32 = "I32"
_IDS = Why("row id in range: base.row_ids reads the ids before compute (test_shapes_matrix.py::test_row_ids_out_of_range)")
_WORK = Why("conv._conv_work bounds one patch by GGML_IM2COL_WORK_SIZE "
            "(test_shapes_conv.py::test_conv_2d_work_buffer_overflow_is_refused)")
_F16_010 = Why("ggml 0.10's F16 kernel: the rule asks an F16 src0 with nb[0] 2 below 0.20 "
               "(test_shapes_conv.py::test_op_matches_ggml_cpu F16 cases under APIR_GGML_LIB_DIR=0.10)")

# op -> {assert text as in the C source (whitespace collapsed): how it is covered}
KERNEL_ASSERTS: dict[str, dict[str, Cover]] = {
    "ADD_ID": {
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "src2->type == GGML_TYPE_I32": v(("type", "src2", 0, "F32")),
        "src0->nb[0] == sizeof(float)": v(("nb", "src0", 0, 2)),
        "src1->nb[0] == sizeof(float)": v(("nb", "src1", 0, 2)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        "i11 >= 0 && i11 < ne11": _IDS,
    },
    "ACC": {
        "ggml_are_same_shape(src0, dst)": v(("ne", "src0", 2, 1)),
        "ggml_is_contiguous(dst) && ggml_is_contiguous(src0)": v(("nb", "src0", 0, 2)),
        "offset + (ne10 == 0 ? 0 : ne10-1)*nb0 + (ne11 == 0 ? 0 : ne11-1)*nb1 + (ne12 == 0 ? 0 : ne12-1)*nb2 "
        "+ (ne13 == 0 ? 0 : ne13-1)*nb3 < ggml_nbytes(dst)": v(("param", "dst", 3, 600)),
        "offset + (ne10 == 0 ? 0 : ne10-1)*nb00 + (ne11 == 0 ? 0 : ne11-1)*nb01 + (ne12 == 0 ? 0 : ne12-1)*nb02 "
        "+ (ne13 == 0 ? 0 : ne13-1)*nb03 < ggml_nbytes(src0)": v(("param", "dst", 0, 200)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
    },
    "SET": {
        "ggml_are_same_shape(src0, dst)": v(("ne", "src0", 2, 1)),
        "ggml_is_contiguous(dst) && ggml_is_contiguous(src0)": v(("nb", "dst", 0, 2)),
        "offset + im0*nb0 + im1*nb1 + im2*nb2 + im3*nb3 <= ggml_nbytes(dst)": v(("param", "dst", 3, 560)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        "nb10 == sizeof(int32_t)": v(("nb", "src1", 0, 2)),  # set_i32: the rule is the same
    },
    "CUMSUM": {
        "src0->nb[0] == sizeof(float)": v(("nb", "src0", 0, 2)),
        "dst->nb[0] == sizeof(float)": v(("nb", "dst", 0, 2)),
        "ne0 == ne00": v(("ne", "dst", 0, 12)),
        "ne1 == ne01": v(("ne", "dst", 1, 4)),
        "ne2 == ne02": v(("ne", "dst", 2, 2)),
        "ne3 == ne03": v(("ne", "dst", 2, 1), ("ne", "dst", 3, 3), ("nb", "dst", 3, 260)),
    },
    "FILL": {},
    "DIAG": {
        "ne00 == ne0": v(("ne", "dst", 0, 6)),
        "ne00 == ne1": v(("ne", "dst", 1, 6)),
        "ne01 == 1": v(("ne", "src0", 1, 2), ("ne", "src0", 3, 1)),
        "ne02 == ne2": v(("ne", "dst", 2, 2)),
        "ne03 == ne3": v(("ne", "dst", 3, 1)),
        "nb00 == sizeof(float)": v(("nb", "src0", 0, 2)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
    },
    "TRI": {
        "ggml_is_contiguous(src0)": v(("nb", "src0", 0, 2)),
    },
    "SOLVE_TRI": {
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "ne00 == ne01": v(("ne", "src0", 0, 5)),
        "ne0 == ne10": v(("ne", "dst", 0, 3)),
        "ne1 == ne11": v(("ne", "dst", 1, 5)),
        "ne02 == ne12 && ne12 == ne2": v(("ne", "src0", 2, 1)),
        "ne03 == ne13 && ne13 == ne3": v(("ne", "dst", 2, 1), ("ne", "dst", 3, 2), ("nb", "dst", 3, 96)),
    },
    "OUT_PROD": {
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "ne0 == ne00": v(("ne", "dst", 0, 7)),
        "ne1 == ne10": v(("ne", "dst", 1, 4)),
        "ne2 == ne12": v(("ne", "dst", 2, 1)),
        "ne3 == ne13": v(("ne", "dst", 2, 1), ("ne", "dst", 3, 2), ("nb", "dst", 3, 160)),
        "ne2 % ne02 == 0": v(("ne", "src1", 2, 1), ("ne", "dst", 2, 1)),
        "ne3 % ne03 == 0": v(("ne", "src0", 2, 1), ("ne", "src0", 3, 2), ("nb", "src0", 3, 192)),
        "nb00 == sizeof(float)": v(("nb", "src0", 0, 2)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
        # the quantized (case 2: Q8_0) and F16 (case 3, ggml 0.20) kernels
        "ne02 == ne12": v(("ne", "src1", 2, 1), ("ne", "dst", 2, 1), case=2),
        "ne03 == ne13": v(("ne", "src1", 2, 1), ("ne", "src1", 3, 2), ("ne", "dst", 2, 1), ("ne", "dst", 3, 2),
                          ("nb", "dst", 3, 640), case=2),
        "nb00 == ggml_type_size(type)": v(("nb", "src0", 0, 17), case=2),
        "ne2 == ne02": v(("ne", "src0", 2, 1), case=2),
        "ne3 == ne03": v(("ne", "src0", 2, 1), ("ne", "src0", 3, 2), case=2),
        "src0->type == GGML_TYPE_F16": v(("type", "src0", 0, "BF16"), case=3),
        "nb00 == sizeof(ggml_fp16_t)": v(("nb", "src0", 0, 1), case=3),
    },
    "GET_ROWS": {
        "i01 >= 0 && i01 < ne01": _IDS,
    },
    "SET_ROWS": {
        "src0->type == GGML_TYPE_F32 || src0->type == GGML_TYPE_F16": v(("type", "src0", 0, I32)),
        "i1 >= 0 && i1 < ne1": _IDS,
    },
    "GET_ROWS_BACK": {
        "ggml_is_contiguous(dst)": v(("nb", "dst", 0, 2)),
        "dst->ne[0] == nc": v(("ne", "dst", 0, 7)),
        "src0->nb[0] == sizeof(ggml_fp16_t)": v(("nb", "src0", 0, 2)),  # the F16 kernel: the same rule
        "src0->nb[0] == sizeof(float)": v(("nb", "src0", 0, 2)),
        "r >= 0 && r < dst->ne[1]": _IDS,  # ggml 0.25 (the F16 and F32 kernels)
    },
    "MUL_MAT": {
        "ne0 == ne01": v(("ne", "dst", 0, 4)),
        "ne1 == ne11": v(("ne", "dst", 1, 2)),
        "ne2 == ne12": v(("ne", "dst", 2, 3)),
        "ne3 == ne13": v(("ne", "dst", 2, 2), ("ne", "dst", 3, 2), ("nb", "dst", 3, 120)),
        "nb00 == ggml_type_size(src0->type)": v(("nb", "src0", 0, 2)),
        "nb10 == ggml_type_size(src1->type)": v(("nb", "src1", 0, 2)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
        "nb0 <= nb1": v(("nb", "dst", 1, 2)),
        "nb1 <= nb2": v(("nb", "dst", 2, 16)),
        "nb2 <= nb3": v(("nb", "dst", 3, 50)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        # ggml 0.25 widens F16 / BF16 src1 for an F32 vec_dot_type (case 6: Q4_0 src0)
        "!widen || vec_dot_type == GGML_TYPE_F32": v(("type", "src1", 0, "F16"), ("nb", "src1", 1, 128), case=6,
                                                     since=(0, 25, 0)),
        "!widen || src1->type == GGML_TYPE_F16 || src1->type == GGML_TYPE_BF16": v(("type", "src1", 0, I32),
                                                                                   since=(0, 25, 0)),
        # ggml_compute_forward_fwht (op_params[1] = GGML_HINT_SRC0_IS_HADAMARD, ggml 0.20)
        "dst->type == GGML_TYPE_F32": v(("param", "dst", 1, 1), ("type", "dst", 0, I32)),
        "(n & (n - 1)) == 0": v(("param", "dst", 1, 1), ("ne", "src0", 0, 48), ("ne", "src1", 0, 48),
                                since=(0, 20, 0)),
        # ggml 0.25's fwht_impl<float or ggml_fp16_t>
        "src1->type == (std::is_same_v<src_t, float> ? GGML_TYPE_F32 : GGML_TYPE_F16)": v(
            ("param", "dst", 1, 1), ("type", "src1", 0, I32), since=(0, 25, 0)),
    },
    "MUL_MAT_ID": {
        "nb00 == ggml_type_size(type)": v(("nb", "src0", 0, 2)),
        "nb10 == ggml_type_size(src1->type)": v(("nb", "src1", 0, 2)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
        "nb0 <= nb1": v(("nb", "dst", 1, 2)),
        "nb1 <= nb2": v(("nb", "dst", 2, 16)),
        "nb2 <= nb3": v(("nb", "dst", 3, 30)),
        "params->wsize >= (size_t)((char *) wdata_cur - (char *) params->wdata)":
            Why("ggml_graph_plan sizes the work buffer with this formula; apir.host.work_plan bounds the plan"),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
    },
    "CONV_TRANSPOSE_1D": {
        "src0->type == GGML_TYPE_F16": v(("type", "src0", 0, I32)),
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "nb00 == sizeof(ggml_fp16_t)": v(("nb", "src0", 0, 2)),
        "nb00 == sizeof(float)": v(("nb", "src0", 0, 2)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        # ggml_graph_plan's own (planned for every node, even an empty one)
        "node->src[0]->ne[3] == 1": v(("ne", "src0", 2, 2), ("ne", "src0", 3, 2)),
        "node->src[1]->ne[2] == 1": v(("ne", "src1", 1, 2), ("ne", "src1", 2, 2)),
        "node->src[1]->ne[3] == 1": v(("ne", "src1", 1, 2), ("ne", "src1", 3, 2)),
    },
    "IM2COL": {
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        "src1->type == GGML_TYPE_F16 || src1->type == GGML_TYPE_F32": v(("type", "src1", 0, "BF16"), case=1),
        "dst->type == GGML_TYPE_F16": v(("type", "dst", 0, "BF16"), case=1),
        "nb10 == ggml_type_size(src1->type)": v(("nb", "src1", 0, 1), case=1),
        "src0->type == GGML_TYPE_F16": _F16_010,
        "nb00 == sizeof(ggml_fp16_t)": _F16_010,
    },
    "IM2COL_BACK": {
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "src1->type == GGML_TYPE_F32 || src1->type == GGML_TYPE_F16": v(("type", "src1", 0, I32)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),  # ggml 0.10
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
    },
    "IM2COL_3D": {
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "dst->type == GGML_TYPE_F16": v(("type", "dst", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        "src0->type == GGML_TYPE_F16": _F16_010,
    },
    "COL2IM_1D": {
        "ggml_is_contiguous(src)": v(("nb", "src0", 0, 2)),
        "ggml_is_contiguous(dst)": v(("nb", "dst", 0, 2)),
    },
    "CONV_2D": {
        "ggml_is_contiguous(kernel)": v(("nb", "src0", 0, 2)),
        "kernel_type == GGML_TYPE_F16 || kernel_type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "kernel->type == kernel_type": v(("type", "src0", 0, I32)),
        "c_in == kernel->ne[2]": v(("ne", "src0", 2, 2)),
        "patches_per_batch > 0 && batch_size >= 1": _WORK,
        "gemm_output + patch_n * c_out <= (float*)tmp + params->wsize": _WORK,
    },
    "CONV_3D": {
        "ggml_is_contiguous(kernel)": v(("nb", "src0", 0, 2)),
        "kernel_type == GGML_TYPE_F16 || kernel_type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "kernel->type == kernel_type": v(("type", "src0", 0, I32)),
        "patches_per_batch > 0 && batch_size >= 1": _WORK,
    },
    "CONV_TRANSPOSE_2D": {
        "src0->type == GGML_TYPE_F16 || src0->type == GGML_TYPE_F32": v(("type", "src0", 0, "BF16")),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "nb00 == ggml_type_size(src0->type)": v(("nb", "src0", 0, 1)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        # ggml_graph_plan's own
        "node->src[0]->type == GGML_TYPE_F16 || node->src[0]->type == GGML_TYPE_F32": v(("type", "src0", 0, "BF16")),
        "node->src[1]->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
    },
    "CONV_2D_DW": {
        "kernel->type == GGML_TYPE_F32 || kernel->type == GGML_TYPE_F16": v(("type", "src0", 0, I32)),
        "kernel->ne[3] == p.channels": v(("ne", "src0", 3, 3)),
        "dst->ne[3] == p.batch": v(("ne", "dst", 3, 1)),
        "kernel->nb[0] >= kernel->nb[2] && kernel->nb[1] >= kernel->nb[0]":
            v(("nb", "src0", 0, 4), ("nb", "src0", 1, 12), ("nb", "src0", 2, 36), ("nb", "src0", 3, 36), case=1),
    },
    "POOL_1D": {},
    "POOL_2D": {},
    "POOL_2D_BACK": {
        "params->ith == 0": Why("POOL_2D_BACK runs as one task (ggml_get_n_tasks)"),
        "false": v(("param", "dst", 0, 2)),  # the pool op switch's default
    },
    "UPSCALE": {
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
    },
    "PAD_REFLECT_1D": {
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
    },
    "ROLL": {},
    "WIN_PART": {},
    "WIN_UNPART": {},
    "GET_REL_POS": {},
    "ADD_REL_POS": {},
}

# op -> the kernel functions (ggml_compute_forward_<name>) whose asserts it can reach
KERNEL_FUNCTIONS = {
    "ADD_ID": ["add_id_f32", "add_id"], "ACC": ["acc_f32", "acc"], "SET": ["set_f32", "set_i32", "set"],
    "CUMSUM": ["cumsum_f32", "cumsum"], "FILL": ["fill_f32", "fill_f16", "fill"], "DIAG": ["diag_f32", "diag"],
    "TRI": ["tri_f32", "tri"], "SOLVE_TRI": ["solve_tri_f32", "solve_tri"],
    "OUT_PROD": ["out_prod_f32", "out_prod_q_f32", "out_prod_f16_f32", "out_prod"],
    "GET_ROWS": ["get_rows_q", "get_rows_f16", "get_rows_bf16", "get_rows_f32", "get_rows"],
    "SET_ROWS": ["set_rows_impl", "set_rows"],
    "GET_ROWS_BACK": ["get_rows_back_f32_f16", "get_rows_back_f32", "get_rows_back"],
    "MUL_MAT": ["mul_mat_one_chunk", "mul_mat", "fwht_f32", "fwht_impl", "fwht"],
    "MUL_MAT_ID": ["mul_mat_id_one_chunk", "mul_mat_id"],
    "CONV_TRANSPOSE_1D": ["conv_transpose_1d_f16_f32", "conv_transpose_1d_f32", "conv_transpose_1d"],
    "IM2COL": ["im2col_f32", "im2col_f16", "im2col"], "IM2COL_BACK": ["im2col_back_f32"],
    "IM2COL_3D": ["im2col_3d_f16", "im2col_3d_f32", "im2col_3d"], "COL2IM_1D": ["col2im_1d_impl", "col2im_1d"],
    "CONV_2D": ["conv_2d_impl", "conv_2d"], "CONV_3D": ["conv_3d_impl", "conv_3d"],
    "CONV_TRANSPOSE_2D": ["conv_transpose_2d_impl", "conv_transpose_2d"],
    "CONV_2D_DW": ["conv_2d_dw_cwhn", "conv_2d_dw_whcn", "conv_2d_dw"],
    "POOL_1D": ["pool_1d_ksp", "pool_1d"], "POOL_2D": ["pool_2d"], "POOL_2D_BACK": ["pool_2d_back"],
    "UPSCALE": ["upscale_f32", "upscale"], "PAD_REFLECT_1D": ["pad_reflect_1d"], "ROLL": ["roll_f32", "roll"],
    "WIN_PART": ["win_part_f32", "win_part"], "WIN_UNPART": ["win_unpart_f32", "win_unpart"],
    "GET_REL_POS": ["get_rel_pos_f16", "get_rel_pos"], "ADD_REL_POS": ["add_rel_pos_f32", "add_rel_pos"],
}
# ggml_graph_plan's asserts, by the op whose `case` holds them
PLAN_OPS = ("CONV_TRANSPOSE_1D", "CONV_TRANSPOSE_2D")


def _cpu_sources():
    """(version, folder of ggml-cpu's ops.cpp and ggml-cpu.c) of the C reference builds, and of
    ggml 0.25 in llama.cpp's tree (scripts/build-llama-cpp.sh, tests/llama/build.py)."""
    from tests.llama.build import build_dir

    cache = Path(os.environ.get("APIR_CREF_CACHE", Path.home() / ".cache" / "apir" / "cref"))
    for version, root in (
        ("0.20", cache / "0.20/src/ggml"),
        ("0.10", cache / "0.10/src/vendor/ggml"),
        ("0.25", build_dir() / "src/vendor/llama.cpp/ggml"),
    ):
        folder = root / "src" / "ggml-cpu"
        if (folder / "ops.cpp").exists() and (folder / "ggml-cpu.c").exists():
            yield version, folder


def _bodies(folder: Path) -> dict[str, str]:
    """ggml_compute_forward_<name> -> its body (and `ggml_graph_plan` -> its own), with
    comments removed."""
    out = {}
    for name in ("ops.cpp", "ggml-cpu.c"):
        src = (folder / name).read_text()
        src = re.sub(r"/\*.*?\*/", "", src, flags=re.DOTALL)
        src = re.sub(r"//[^\n]*", "", src)
        for m in re.finditer(r"^(?:static )?(?:inline )?(?:void|struct ggml_cplan) (ggml_compute_forward_\w+|ggml_graph_plan)\s*\(",
                             src, re.MULTILINE):
            i = src.index("{", m.end())
            depth, j = 0, i
            while True:
                depth += {"{": 1, "}": -1}.get(src[j], 0)
                if depth == 0:
                    break
                j += 1
            out[m.group(1).replace("ggml_compute_forward_", "")] = src[i:j]
    return out


def _asserts(body: str):
    return [" ".join(a.split()) for a in re.findall(r"GGML_ASSERT\((.*?)\);", body, re.DOTALL)]


def _plan_asserts(plan: str, op: str):
    m = re.search(rf"case GGML_OP_{op}:(.*?)\bbreak;", plan, re.DOTALL)
    return _asserts(m.group(1)) if m else []


@pytest.mark.parametrize("version, folder", list(_cpu_sources()) or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no C reference sources (tests/cref.py builds them)"))])
def test_every_kernel_assert_is_in_the_table(version, folder):
    bodies = _bodies(folder)
    missing = {}
    for op, names in KERNEL_FUNCTIONS.items():
        found = [a for n in names for a in _asserts(bodies.get(n, ""))]
        if op in PLAN_OPS:
            found += _plan_asserts(bodies["ggml_graph_plan"], op)
        gone = [a for a in found if a not in KERNEL_ASSERTS[op]]
        if gone:
            missing[op] = gone
    assert not missing, f"ggml {version}: kernel asserts without a rule in KERNEL_ASSERTS: {missing}"
    assert any(_asserts(bodies.get(n, "")) for n in KERNEL_FUNCTIONS["MUL_MAT"])  # the parser found some


def test_table_covers_the_modules_ops():
    from apir.host.shapes import conv as c
    from apir.host.shapes import matrix as m
    from apir.host.shapes import tensor_ops as t

    assert set(KERNEL_ASSERTS) == set(c.RULES) | set(m.RULES) | set(t.RULES) == set(KERNEL_FUNCTIONS)


def _cases(op):
    return [c for c in tensor_ops.CASES + matrix.ALL + conv.CASES if c.op == op]


VIOLATIONS = [(op, text, cover) for op, table in KERNEL_ASSERTS.items() for text, cover in table.items()
              if isinstance(cover, V)]


def _apply(ggml, r, recs, cover: V) -> None:
    o = r.index(r.out)
    ids = {int(x): k for k, x in enumerate(recs["id"])}
    src = [ids[int(x)] if int(x) else -1 for x in recs[o]["src"]]
    for field, role, i, value in cover.edits:
        k = o if role == "dst" else src[int(role[3:])]
        if field == "type":
            recs["type"][k] = ggml.types[value]
        elif field == "param":
            recs["op_params"][k][i] = value
        else:
            recs[field][k][i] = value


@pytest.mark.parametrize("op, text, cover", VIOLATIONS, ids=[f"{op}: {text[:40]}" for op, text, _ in VIOLATIONS])
def test_violating_graph_is_refused_by_the_rule(guest, ggml, caplog, op, text, cover):
    from apir.host.shapes import op_enums

    if op_enums(ggml).version < cover.since:
        pytest.skip(f"ggml {op_enums(ggml).version} has no such kernel")
    cases = _cases(op)
    if cover.case >= len(cases) or (cases[cover.case] in matrix.CASES_020 and matrix._too_old(ggml, cases[cover.case])):
        pytest.skip("this ggml has no such case")
    r = Remote(guest, ggml, cases[cover.case])
    try:
        recs = r.recs.copy()
        _apply(ggml, r, recs, cover)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="apir.host"):
            rc, _ = r.compute(recs)
        assert rc == ERROR, f"{op}: a graph against `{text}` was accepted"
        assert f"({op})" in caplog.text, caplog.text  # refused by the op's own rule
        rc, dec = r.compute()  # the host serves the next graph
        assert rc == 0 and dec.i32() == 0
    finally:
        r.close()
