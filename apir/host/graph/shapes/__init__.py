"""Per-op shape checks: what ggml's constructors and CPU kernels assume, checked first.

Theory of operation: a graph node's ne/nb/type come from the guest. ggml's constructors
(`ggml_add`, `ggml_mul_mat`, ...) would derive them from the sources, and its CPU kernels
trust that they did: a lying shape walks a kernel out of its tensors, and a violated
GGML_ASSERT aborts the whole host. So before compute, every node goes through the rule of
its op here, which re-derives the node's shape from its sources (the constructor's
arithmetic) and checks the constructor's and kernel's assertions on types and strides.
An op with no rule here is refused: the host computes only what it can check.

Each rule takes the node and its sources as `TensorInfo` (and the build's enum sizes,
`OpEnums`) and raises Refused. Rules are keyed by op name: an op this ggml build lacks simply
has no rule. Every tensor's extent is checked against its buffer first, so a rule proves that
the kernel walks each tensor only within its own ne and nb; row ids and empty tensors are
checked apart from the shapes (`base.row_ids`, `base.check_empty_sources`). docs/security.md
says how, and when a rule is stricter than ggml.

Rules live in one module per family of ops, each with a `RULES` table; this package merges
them into `CHECKED_OPS`.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence

from apir.host.errors import Refused
from apir.host.graph.shapes import attention, backward, conv, elementwise, layout, matrix, rope, tensor_ops
from apir.host.graph.shapes.base import (
    OpEnums,
    Rule,
    TensorInfo,
    allows_empty_sources,
    check_empty_sources,
    op_enums,
    rule_name,
)

__all__ = ["TensorInfo", "OpEnums", "Rule", "op_enums", "check_node", "node_sources", "node_refusal", "CHECKED_OPS"]

CHECKED_OPS: Dict[str, Rule] = {}
for _family in (elementwise, layout, matrix, rope, backward, tensor_ops, conv, attention):
    if CHECKED_OPS.keys() & _family.RULES.keys():  # two rules for one op: a merge mistake
        raise RuntimeError(f"{_family.__name__} redefines {CHECKED_OPS.keys() & _family.RULES.keys()}")
    CHECKED_OPS.update(_family.RULES)


def check_node(
    node: TensorInfo,
    srcs: Sequence[Optional[TensorInfo]],
    enums: OpEnums,
    rules: Optional[Mapping[str, Rule]] = None,
) -> None:
    """Raises Refused unless `node` is what ggml would build from `srcs`. First, for every op,
    `base.check_empty_sources` (a result with elements from a source without, unless the
    rule is marked `base.empty_sources_ok`), then the op's rule from `rules` (a backend
    profile's table, apir.host.graph.profiles; default `CHECKED_OPS`, the CPU's)."""
    rule = (CHECKED_OPS if rules is None else rules).get(node.op_name)
    if rule is None:
        raise Refused(
            f"node {node.index}: op {node.op_name} has no shape check on this host",
            node=node.index,
            op=node.op_name,
            reason="no shape check on this host",
            rule=rule_name(check_node),
        )
    check_empty_sources(node, srcs, allows_empty_sources(rule))
    try:
        rule(node, srcs, enums)
    except Refused as exc:
        if exc.rule is None:  # raised by the op's own rule (or a helper it called)
            exc.rule = rule_name(rule)
        raise


def node_sources(src_row: Sequence[int], info: Callable[[int], TensorInfo]) -> List[Optional[TensorInfo]]:
    """The `srcs` check_node takes for a node whose sources are the tensor indices `src_row`
    (-1: none; the trailing absent ones left out, as ggml's src array ends), each tensor's
    info from `info(index)`."""
    row = list(src_row)
    k = len(row)
    while k and row[k - 1] < 0:
        k -= 1
    return [info(j) if j >= 0 else None for j in row[:k]]


def node_refusal(
    node: TensorInfo,
    srcs: Sequence[Optional[TensorInfo]],
    enums: OpEnums,
    rules: Optional[Mapping[str, Rule]] = None,
) -> Optional[str]:
    """Why check_node would refuse `node`, or None: device_supports_op's view of the rules
    (with `address=None` infos the checks of row ids' values are skipped)."""
    try:
        check_node(node, srcs, enums, rules)
    except Refused as exc:
        return str(exc)
    return None
