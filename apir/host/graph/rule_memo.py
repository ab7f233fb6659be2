"""Each shape rule run once per distinct set of inputs in a graph being built.

Theory of operation: a transformer's graph repeats one layer's nodes for every layer (a
10,000-node graph may hold 30 distinct nodes), and `check_node` costs microseconds in Python.
`rule_groups` groups the tensors whose rules would see equal inputs: the same type, op, ne, nb
and op_params (all a `TensorInfo` holds but where its data lies), the same of each source, and
the same pattern of absent sources, sources equal to the node and sources listed twice (exact
comparisons: `_groups_plain`, or its kernel `apir.host.graph.kernels.rule_group_kernel`). A
group's first tensor is checked with its `TensorInfo`s behind `Sealed` proxies, which let a
rule read only those fields; a rule being a function of what it reads, when it passes without
touching anything else every member of its group passes too, unchecked.

Anything else a rule touches makes the group impure, and each member is checked on its own:
`index`, `address` or `room` (where its data lies), the row ids (`snapshot`, `fetch`,
`read_by`, `id_bounds`), or setting any attribute (`one_thread`). So does any exception of the
sealed run, a refusal included: the representative is checked again unsealed, which raises the
refusal with its own message (the sealed proxy hides `index`, which every message names).

Errors: what `check_node` raises, for the first refused tensor in index order.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Sequence

import numpy as np

from apir import accel
from apir.errors import ApirError
from apir.host.graph.shapes import OpEnums, TensorInfo, check_node, node_sources

if accel.enabled():  # (the plain path imports no Numba)
    from apir.host.graph.kernels import TABLE_KEY, group_sizes_kernel, rule_group_kernel

__all__ = ["rule_groups", "check_nodes", "Sealed", "Impure"]

# What a rule may read of a sealed TensorInfo: the fields rule_groups compares (type_size and
# blck_size follow from the type) and the methods computed from them alone.
_OPEN = frozenset(
    ("type_name", "ne", "nb", "op_name", "op_params", "type_size", "blck_size")
    + ("nelements", "rows_contiguous", "rows_packed", "is_scalar", "nrows", "contiguous")
)
# The record fields those are read from (rule_groups' mask).
_COMPARED_FIELDS = ("type", "op", "ne", "nb", "op_params")


class Impure(ApirError):
    """A rule touched what `Sealed` hides (the attribute's name)."""


class Sealed(TensorInfo):
    """A `TensorInfo` whose rule reads only the fields `rule_groups` compares: any other
    field read, and every attribute set, raises `Impure` (an attribute that is no field
    raises AttributeError, which counts as impure too). A subclass rather than a proxy:
    rules read the open fields as plain attributes (each read through a proxy's
    `__getattr__` cost a Python call, 300 per 10k-node build)."""

    def __init__(self, info: TensorInfo):  # (not the dataclass' __init__)
        self.__dict__.update({name: getattr(info, name) for name in _OPEN_FIELDS})

    def __setattr__(self, name: str, value) -> None:
        raise Impure(name)


def _hidden(name: str) -> property:
    def read(self):
        raise Impure(name)

    return property(read)


_OPEN_FIELDS = tuple(f.name for f in dataclasses.fields(TensorInfo) if f.name in _OPEN)
for _field in dataclasses.fields(TensorInfo):  # every other field: a property that raises
    if _field.name not in _OPEN:
        setattr(Sealed, _field.name, _hidden(_field.name))


def _mask(dtype: np.dtype) -> Optional[np.ndarray]:
    """rule_group_kernel's mask of an rpc record dtype (int64 words of all-ones over the
    compared fields); None when the record is not a whole number of words."""
    if dtype.itemsize % 8:
        return None
    mask = np.zeros(dtype.itemsize, np.uint8)
    fields: Mapping[str, tuple] = dtype.fields or {}
    for name in _COMPARED_FIELDS:
        sub, at = fields[name][:2]
        mask[at : at + sub.itemsize] = 0xFF
    return mask.view(np.int64)


def rule_groups(parsed) -> np.ndarray:
    """int32[n_tensors]: for each tensor of `parsed` (apir.codec.graph.ParsedGraph) the first
    tensor whose rule sees equal inputs (itself when none before it does)."""
    t = parsed.tensors
    n = len(t)
    rep = np.arange(n, dtype=np.int32)
    mask = _mask(t.dtype)
    if n == 0 or mask is None:
        return rep
    src = np.ascontiguousarray(parsed.src_index, np.int32)
    if not accel.enabled():
        return _groups_plain(np.ascontiguousarray(t).view(np.int64).reshape(n, -1) & mask, src)
    words = np.ascontiguousarray(t).view(np.int64).reshape(n, -1)  # (in place: no copy)
    keep = np.flatnonzero(mask)  # the words holding compared bytes (14 of 38 in ggml 0.20)
    rule_group_kernel(words, keep, mask[keep], src, rep, TABLE_KEY)
    return rep


def _groups_plain(compared: np.ndarray, src_index: np.ndarray) -> np.ndarray:
    """`rule_groups` of the records' compared bytes (`compared`: one row per tensor) and
    their sources (`src_index`). A tensor's class is the first tensor with its compared
    bytes; its group, the first tensor of its class whose source slots hold the same: none
    (-1), the tensor itself (-2), the source of an earlier slot (that slot), or a source of
    the same class."""
    first_of_class: Dict[bytes, int] = {}
    cls = [first_of_class.setdefault(row.tobytes(), i) for i, row in enumerate(compared)]
    first_of_group: Dict[tuple, int] = {}
    rep = np.empty(len(cls), np.int32)
    for i, srcs in enumerate(src_index.tolist()):
        slots = []
        for s in srcs:
            code = -1 if s < 0 else -2 if s == i else srcs.index(s)
            slots.append((code, cls[s] if code >= 0 else -1))
        rep[i] = first_of_group.setdefault((cls[i], tuple(slots)), i)
    return rep


def _check_sealed(node: TensorInfo, srcs: Sequence[Optional[TensorInfo]], enums: OpEnums, rules) -> bool:
    """Whether `node` passes check_node with every info sealed (True) or the run touched
    something else or raised (False: nothing is concluded)."""
    proxies: Dict[int, Sealed] = {id(node): Sealed(node)}
    sealed = [None if s is None else proxies.setdefault(id(s), Sealed(s)) for s in srcs]
    try:
        check_node(proxies[id(node)], sealed, enums, rules)
    except Exception:
        return False
    return True


def check_nodes(
    infos: Sequence[TensorInfo],
    src_index: np.ndarray,
    enums: OpEnums,
    rules: Optional[Mapping] = None,
    groups: Optional[np.ndarray] = None,
) -> int:
    """`check_node` of every tensor (its sources from `src_index`, int32[n, max_src], -1
    none; trailing absent ones left out), but a group's members are skipped when their
    representative passed sealed (`groups`: rule_groups' answer; None checks every tensor).
    First every representative of a group of more than one runs sealed (no side effects),
    then every other tensor that needs its own check runs unsealed, in index order: the first
    refusal is that of the lowest refused index, as checking one by one would raise. Returns
    how many rules ran; raises Refused."""
    n = len(infos)
    if groups is None:
        groups = np.arange(n, dtype=np.int32)
    if accel.enabled():
        reps, sizes = np.empty(n, np.int32), np.zeros(n, np.int32)
        reps = reps[: group_sizes_kernel(groups, reps, sizes)]
    else:  # the representatives (each the first of its group), and each group's size
        reps = np.flatnonzero(groups == np.arange(n)).astype(np.int32)
        sizes = np.bincount(groups, minlength=n).astype(np.int32)
    shared = reps[sizes[reps] > 1]
    impure = [
        i
        for i in shared.tolist()
        if not _check_sealed(infos[i], node_sources(src_index[i].tolist(), infos.__getitem__), enums, rules)
    ]
    if impure:  # each member of their groups on its own (found in one pass over the graph)
        pure = np.zeros(n, np.bool_)
        pure[shared] = True
        pure[impure] = False
        alone = np.flatnonzero(~pure[groups]).tolist()
    else:  # (each shared group passed: the groups of one are left, found without a pass)
        alone = reps[sizes[reps] == 1].tolist()
    for i in alone:
        check_node(infos[i], node_sources(src_index[i].tolist(), infos.__getitem__), enums, rules)
    return len(shared) + len(alone)
