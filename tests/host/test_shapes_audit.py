"""Issue 13's audit of the attention, element-wise, layout, rope and backward rules against
ggml-cpu's kernels (docs/rule-audit.md): each fault found, refused by the op's rule, the host
serving the next command.

Inputs that hang or abort the host without the rule run it in a child process
(tests/host/childkit.py): a regression is then a test failure, not a dead pytest. Inputs
whose kernel would only read out of bounds run in this process. The `int` bounds need
tensors of gigabytes; they are shown on the rules themselves (`node_refusal`)."""

import logging
import pathlib
import re

import numpy as np
import pytest

from apir.host.shapes import TensorInfo, attention, backward, elementwise, layout, node_refusal, op_enums, rope
from tests.host.childkit import compute_mutated, run_in_child
from tests.host.shapekit import ERROR, Case, Remote, _in

INT32_MAX = 2**31 - 1
OK = 0


def _group_norm(g, ctx):
    """4 channels, 256 in ne[3]: a 4 KiB tensor."""
    a = _in(g, ctx, "F32", 1, 1, 4, 256)
    return g.ggml_group_norm(ctx, a, 2, 1e-6), [a]


def _cont(g, ctx):
    a = _in(g, ctx, "F32", 64, 2)
    return g.ggml_cont(ctx, a), [a]


def _diag_mask_zero(g, ctx):
    """Two 8 x 3 matrices in ne[2]."""
    a = _in(g, ctx, "F32", 8, 3, 2)
    return g.ggml_diag_mask_zero(ctx, a, 1), [a]


# Cases the child builds (module-level: the child imports them by name)
CONT = Case("CONT", _cont)
DIAG_MASK_ZERO = Case("DIAG_MASK_ZERO", _diag_mask_zero)
GROUP_NORM = Case("GROUP_NORM", _group_norm)


def _in_child(case_name, edits, op):
    """The case's graph with `edits`, computed by a host in a child process: refused by the
    op's own rule, and the next (unedited) graph computed."""
    got = run_in_child(compute_mutated, (__name__, case_name), edits)
    assert got.rc == ERROR, got
    assert f"({op})" in got.log, got.log
    assert (got.next_rc, got.next_status) == (OK, OK), got
    return got.log


# --- class 3: loop counts from op_params (hangs) ---------------------------------------------
@pytest.mark.parametrize("n_groups", [INT32_MAX, 5])
def test_group_norm_group_count_is_bounded(ggml, n_groups):
    """(ne[2] + n_groups - 1) / n_groups in C int: INT32_MAX wraps and the kernel loops 2^31
    groups per ne[3] (a hang); more groups than the 4 channels is refused too."""
    log = _in_child("GROUP_NORM", [(-1, "op_params", 0, n_groups, np.int32)], "GROUP_NORM")
    assert "n_groups" in log


# --- class 4: the kernel's GGML_ASSERTs (aborts) ---------------------------------------------
def test_cont_into_another_type_is_refused(ggml):
    """CONT F32 -> Q8_0 (ggml_cont keeps the type): the kernel (dup_to_q) converts each row
    in a work buffer that ggml_graph_plan never sizes for CONT: a write through NULL."""
    q8 = [34, 68, 136, 136]  # two rows of two Q8_0 blocks, inside the F32 result's 512 bytes
    edits = [(-1, "type", 0, "Q8_0", None)] + [(-1, "nb", i, q8[i], np.int64) for i in range(4)]
    log = _in_child("CONT", edits, "CONT")
    assert "keeps its type" in log


def test_diag_mask_matrices_not_packed_are_refused(ggml):
    """Found by the fuzz campaign (tests/fuzz/reproducers/diag_mask_zero-sigsegv-*.json):
    source and result laid out [8, 3, 1, 2] with nb [4, 32, 192, 96] are contiguous for
    ggml_is_contiguous (a dimension of 1 has any stride) and fit their extents, but
    ggml_compute_forward_diag_mask_f32 walks the ne[2]*ne[3] matrices as k * nb[2]: the
    second one written 96 bytes past the result (past the buffer, in the campaign)."""
    edits = [(w, f, i, v, np.int64) for w in (0, -1) for f, i, v in
             (("ne", 2, 1), ("ne", 3, 2), ("nb", 2, 192), ("nb", 3, 96))]
    log = _in_child("DIAG_MASK_ZERO", edits, "DIAG_MASK_ZERO")
    assert "nb[2]" in log


# --- class 1: empty auxiliary sources the kernel indexes by other tensors' shapes ------------
def _refused(guest, ggml, caplog, case, which, dim, op):
    """`case` with ne[dim] of input `which` set to 0 (its extent 0 bytes, so unchecked) is
    refused by the op's rule or the empty-source check, and the host serves on."""
    r = Remote(guest, ggml, case)
    recs = r.recs.copy()
    recs["ne"][r.index(r.inputs[which])][dim] = 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute(recs)
    assert rc == ERROR
    assert f"({op})" in caplog.text, caplog.text
    rc, dec = r.compute()
    assert rc == OK and dec.i32() == 0
    r.close()


def test_timestep_embedding_empty_timesteps(guest, ggml, caplog):
    """timesteps [5, 0]: the kernel still reads 5 floats (one per row of the result)."""
    case = Case("TIMESTEP_EMBEDDING", lambda g, c: (lambda t: (g.ggml_timestep_embedding(c, t, 7, 1000), [t]))(
        _in(g, c, "F32", 5)))
    _refused(guest, ggml, caplog, case, 0, 1, "TIMESTEP_EMBEDDING")


# --- class 3: C int counts and indices (shown on the rules: the tensors are gigabytes) --------
def _info(index, type_name, ne, op="NONE", op_params=(), type_size=4, blck_size=1, nb=None):
    if nb is None:
        nb = [type_size]
        for n in ne[:-1]:
            nb.append(nb[-1] * n)
    params = np.zeros(16, np.int32)
    params[: len(op_params)] = op_params
    return TensorInfo(index=index, type_name=type_name, ne=list(ne), nb=list(nb), op_name=op,
                      op_params=params, type_size=type_size, blck_size=blck_size, address=None)


def test_rows_past_int_are_refused(ggml):
    """ggml-cpu's kernels count rows in `int` (`const int nr = ggml_nrows(src0)`): 2^31 rows
    of one float (8 GiB) would wrap. The same node with 2^30 rows is accepted."""
    enums = op_enums(ggml)
    for rows, refused in ((2**31, True), (2**30, False)):
        a = _info(0, "F32", [1, rows, 1, 1])
        node = _info(1, "F32", [1, rows, 1, 1], op="SQR")
        why = node_refusal(node, [a], enums)
        assert (why is not None and "int counts" in why) == refused, why


def test_concat_dimension_past_int_is_refused(ggml):
    """concat's loops are `for (int i3 = 0; i3 < ne3; i3++)`: ne[3] = 2^31 (2 GiB of I8)."""
    enums = op_enums(ggml)
    a, b = _info(0, "F32", [1, 1, 1, 2**30]), _info(1, "F32", [1, 1, 1, 2**30])
    node = _info(2, "F32", [1, 1, 1, 2**31], op="CONCAT", op_params=[3])
    why = node_refusal(node, [a, b], enums)
    assert why is not None and "int counts" in why, why


def test_cpy_from_quantized_past_uint32_index_is_refused(ggml):
    """ggml_compute_forward_dup_from_q keeps each block's flat element index in a uint32_t."""
    enums = op_enums(ggml)
    q = _info(0, "Q8_0", [2**16, 2**16 + 64, 1, 1], type_size=34, blck_size=32,
              nb=[34, 34 * 2**11, 34 * 2**11 * (2**16 + 64), 34 * 2**11 * (2**16 + 64)])
    dst = _info(1, "F32", [2**16, 2**16 + 64, 1, 1])
    node = _info(2, "F32", dst.ne, op="CPY", nb=dst.nb)
    why = node_refusal(node, [q, dst], enums)
    assert why is not None and "32-bit element index" in why, why


def test_audit_table_has_a_row_per_op():
    """docs/rule-audit.md's section of these five modules has a row for each op they rule."""
    doc = (pathlib.Path(__file__).parents[2] / "docs" / "rule-audit.md").read_text()
    section = doc.split("## attention, elementwise, layout, rope, backward", 1)[1].split("\n## ", 1)[0]
    rows = set()
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| op "):
            cell = line.split("|")[1]
            rows |= {re.sub(r"\s*\(0\.\d+\)", "", op).strip() for op in cell.split(",")}
    ruled = set()
    for module in (attention, elementwise, layout, rope, backward):
        ruled |= module.RULES.keys()
    assert ruled <= rows, sorted(ruled - rows)
