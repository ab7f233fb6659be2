"""What the host shape-rule tests (tests/host/shapes/, one file per rule module of
apir.host.graph.shapes) share: a `Case` (an op built with ggml's own constructor, named for the test
id `OP-name`), `Remote` (its graph laid out in a host buffer and computed through the host),
`direct` (the same graph on ggml CPU), and the assertions every rule test makes:

- `assert_matches_ggml_cpu(guest, g, case)`: through the host the case computes to ggml CPU's
  bytes (an *accepted* case of `case.op`);
- `refusal(remote, recs)`: the records refused (BACKEND_RC_ERROR), the host's `Refused` (its
  fields: node, op, reason, rule), and the host serving the next command;
  `assert_refused_by_rule(refusal, op, node, ...)` checks those fields (a *refused* case of
  `op` when its own rule refused it); `lie_refusal(guest, g, case)` does both for the case's
  lie about one ne;
- `rule_check(...)`: the rules' view without compute, for bounds that need tensors larger
  than a test can allocate.

The accepted and refused ops are recorded (`COVERAGE`): tests/host/shapes/test_checked_ops.py
checks, at the end of a run of the whole folder, that every op of CHECKED_OPS in the loaded
ggml has both."""

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.ggml.features import Feature
from apir.host.errors import Refused
from apir.host.graph.shapes import CHECKED_OPS
from apir.host.graph.shapes.base import rule_name
from tests.host.hostkit import DATA_RES, GgmlScratch, RemoteGraph, cpu_compute

ERROR = 1  # BACKEND_RC_ERROR


@dataclass
class Case:
    """`build(g, ctx) -> (out, inputs)`; `lie` = (input index or -1 for the node, dim,
    delta) applied to ne (None: no lie); `data` fills input i (else standard normal of its
    type); `name` says what the case is (its test id is `OP-name`); `feature`: the
    apir.ggml.features.Feature the case needs (its tests are skipped on a ggml without it)."""

    op: str
    build: Callable
    lie: Optional[Tuple[int, int, int]] = (-1, 0, -1)
    data: Optional[Dict[int, Callable]] = None
    name: str = ""
    feature: Optional[Feature] = None

    @property
    def id(self) -> str:
        return f"{self.op}-{self.name}" if self.name else self.op


def case_id(case) -> str:
    """pytest id of a parametrized `Case` (`OP-name`); other values get pytest's own."""
    return case.id if isinstance(case, Case) else None  # type: ignore[return-value]


def needs(g, feature: Optional[Feature]) -> None:
    """Skips the test where the loaded ggml lacks `feature` (None: needs nothing)."""
    if feature is not None and feature not in g.features:
        pytest.skip(f"ggml {g.version} lacks {feature.name}: {feature.value}")


def _in(g, ctx, type_name, *ne):
    t = getattr(g, f"ggml_new_tensor_{len(ne)}d")(ctx, g.types[type_name], *ne)
    g.ggml_set_input(t)
    return t


def g_nb(g, t, i):
    from apir.ggml.layout import tensor_record

    return int(tensor_record(t, g.tensor_dtype)["nb"][i])


def _ints(hi, dtype=np.int32):
    return lambda n, rng: rng.permutation(hi)[:n].astype(dtype) if n <= hi else rng.integers(0, hi, n).astype(dtype)


def random_blocks(block_bytes, blck=32):
    """Data of a quantized input: random bytes, `block_bytes` per block of `blck` elements."""
    return lambda n, rng: rng.integers(0, 256, n // blck * block_bytes).astype(np.uint8)


def zero_blocks(block_bytes, blck=32):
    """Data of a quantized input: zero bytes, `block_bytes` per block of `blck` elements."""
    return lambda n, rng: np.zeros(n // blck * block_bytes, np.uint8)


def _data(g, case, inputs, seed=3):
    rng = np.random.default_rng(seed)
    out = []
    for i, t in enumerate(inputs):
        n = g.ggml_nelements(t)
        type_name = g.type_names[int(np.frombuffer(ctypes.string_at(t, 4), np.uint32)[0])]
        if case.data and i in case.data:
            arr = case.data[i](n, rng)
        else:
            arr = rng.standard_normal(n).astype(np.float16 if type_name == "F16" else np.float32)
        out.append(arr.tobytes())
    return out


def _graph(g, ctx, case):
    out, inputs = case.build(g, ctx)
    g.ggml_set_output(out)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, out)
    return graph, out, inputs


def _direct(g, case):
    needs(g, case.feature)
    s = GgmlScratch(g)
    graph, out, inputs = _graph(g, s.ctx, case)
    data = _data(g, case, inputs)
    got = cpu_compute(g, s.ctx, graph, zip(inputs, data), out)
    s.close()
    return got


class Remote:
    """The case's graph laid out in a host buffer, its inputs written there."""

    def __init__(self, guest, g, case):
        needs(g, case.feature)
        self.s = GgmlScratch(g)
        graph, self.out, inputs = _graph(g, self.s.ctx, case)
        self.remote = RemoteGraph(guest, g, self.s.ctx, graph)
        for t, d in zip(inputs, _data(g, case, inputs)):
            assert guest.set_tensor(self.remote.handle, self.remote.rpc(t), d) == 0
        self.inputs, self.g, self.guest = inputs, g, guest
        n_nodes = int(np.frombuffer(self.remote.wire, "<u4", 1)[0])
        self.head = 4 + 8 * n_nodes + 4
        self.recs = np.frombuffer(self.remote.wire[self.head:], self._dtype()).copy()

    def _dtype(self):
        from apir.codec.records import rpc_tensor_dtype

        return rpc_tensor_dtype(self.g.limits)

    def index(self, t):
        return int(np.nonzero(self.recs["id"] == t)[0][0])

    def compute(self, recs=None):
        wire = self.remote.wire if recs is None else self.remote.wire[: self.head] + recs.tobytes()
        self.guest.data[: len(wire)] = wire
        return self.guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))

    def result(self):
        rc, got = self.guest.get_tensor(self.remote.handle, self.remote.rpc(self.out), self.g.ggml_nbytes(self.out))
        assert rc == 0
        return got

    def close(self):
        self.remote.close()
        self.s.close()


# (op, test file) seen accepted (computed through the host to ggml CPU's bytes) and refused
# by the op's own rule in this process, for test_checked_ops.py.
COVERAGE: Dict[str, set] = {"accepted": set(), "refused": set()}


def _record(kind: str, op: str) -> None:
    # pytest names the running test in PYTEST_CURRENT_TEST: "path/test_x.py::test_y[id] (call)"
    where = os.environ.get("PYTEST_CURRENT_TEST", "").split("::", 1)[0].rsplit("/", 1)[-1]
    COVERAGE[kind].add((op, where))


def assert_computes_like_cpu(guest, g, case):
    """`case` through the host: accepted, and its result is ggml CPU's bytes."""
    r = Remote(guest, g, case)
    try:
        rc, dec = r.compute()
        assert rc == 0 and dec.i32() == 0
        assert r.result() == _direct(g, case)
    finally:
        r.close()
    _record("accepted", case.op)


def assert_matches_ggml_cpu(guest, g, case):
    """`case` through the host: accepted, and its result is ggml CPU's bytes, not an untouched
    buffer (more than one distinct byte)."""
    r = Remote(guest, g, case)  # (skips the test where this ggml lacks the case's constructor)
    try:
        assert case.op in g.ops
        rc, dec = r.compute()
        assert rc == 0 and dec.i32() == 0
        got, expect = r.result(), _direct(g, case)
    finally:
        r.close()
    assert got == expect
    assert len(set(got)) > 1  # not an untouched buffer
    _record("accepted", case.op)


class _Refusals(logging.Handler):
    """The `Refused` objects on apir.host's records (apir.host.backend.dispatcher puts them there)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list = []

    def emit(self, record):
        if isinstance(getattr(record, "refusal", None), Refused):
            self.seen.append(record.refusal)


def refusal(remote, recs=None, serves_next=True) -> Refused:
    """`remote`'s graph (its records `recs`, default its own) through the host: refused
    (BACKEND_RC_ERROR), with exactly one `Refused`, which is returned; with `serves_next` the
    unedited graph is then computed (the host serves the next command)."""
    handler = _Refusals()
    log = logging.getLogger("apir.host")
    log.addHandler(handler)
    try:
        rc, _ = remote.compute(recs)
    finally:
        log.removeHandler(handler)
    assert rc == ERROR
    assert len(handler.seen) == 1, handler.seen
    if serves_next:
        rc, dec = remote.compute()
        assert rc == 0 and dec.i32() == 0
    return handler.seen[0]


def assert_refused_by_rule(refused: Optional[Refused], op: str, node: int, reason: str = "", rule=None):
    """`refused` names node `node` of op `op`, its reason starts with `reason`, and the check
    that refused it is `rule` (a function; default: `op`'s own rule in CHECKED_OPS, and then it
    counts as a refused case of `op`)."""
    assert refused is not None, f"{op}: not refused"
    own = rule is None
    want = rule_name(CHECKED_OPS[op] if own else rule)
    got = (refused.node, refused.op, refused.rule)
    assert got == (node, op, want), (got, str(refused))
    assert refused.reason.startswith(reason), refused.reason
    if own:
        _record("refused", op)


def lie_refusal(guest, g, case) -> Refused:
    """`case` with its lie (one ne of an input or of the node changed by a delta): refused by
    the op's own rule for the case's node, and the host serves the unedited graph next."""
    which, dim, delta = case.lie
    r = Remote(guest, g, case)
    try:
        recs = r.recs.copy()
        i = r.index(r.out if which < 0 else r.inputs[which])
        recs["ne"][i][dim] = int(recs["ne"][i][dim]) + delta
        got = refusal(r, recs)
        assert_refused_by_rule(got, case.op, r.index(r.out))
    finally:
        r.close()
    return got


def with_op_params(remote, slot, value, t=None):
    """A copy of `remote`'s records with op_params word `slot` of `t` (default: the result)
    set to `value` (a numpy float32 is written as its bits)."""
    recs = remote.recs.copy()
    i = remote.index(remote.out if t is None else t)
    dtype = np.float32 if isinstance(value, np.floating) else np.int32
    recs["op_params"][i][slot] = np.array([value]).astype(dtype).view(np.int32)[0]
    return recs


def ctor(g, name):
    """ggml's constructor `name` (a field of apir.ggml.functions.GgmlFunctions); the test is skipped
    where this ggml build lacks it."""
    if not g.has(name):
        pytest.skip(f"{name} is not in this ggml build")
    return getattr(g, name)


def rule_check(guest, r, recs, t=None) -> Optional[Refused]:
    """The `Refused` that `apir.host.graph.shapes.check_node` raises for node `t` (default: the
    case's result) of records `recs` (a `Remote`'s, edited), or None: the rules as
    device_supports_op sees them, without data (row ids are not read) and without the
    graph-level checks (extents, spans) that would refuse first through the host. For rules
    whose bound needs a tensor larger than a test can allocate."""
    from apir.host.graph.build import tensor_info
    from apir.host.graph.shapes import check_node

    lib = guest.ctx._library
    ids = {int(v): k for k, v in enumerate(recs["id"])}
    info = [tensor_info(lib, k, recs[k], None) for k in range(len(recs))]
    node = r.index(r.out if t is None else t)
    src = [int(v) for v in recs[node]["src"]]
    while src and not src[-1]:
        src.pop()
    try:
        check_node(info[node], [info[ids[v]] if v else None for v in src], lib.op_enums)
    except Refused as exc:
        return exc
    return None


def info(index, type_name, ne, op="NONE", op_params=(), type_size=4, blck_size=1, nb=None):
    """A `TensorInfo` as the rules see one (no data: `address` None), packed unless `nb` is
    given: for bounds whose tensors are gigabytes (shown on the rules, `infos_check`)."""
    from apir.host.graph.shapes import TensorInfo

    if nb is None:
        nb = [type_size]
        for n in ne[:-1]:
            nb.append(nb[-1] * n)
    params = np.zeros(16, np.int32)
    params[: len(op_params)] = op_params
    return TensorInfo(index=index, type_name=type_name, ne=list(ne), nb=list(nb), op_name=op,
                      op_params=params, type_size=type_size, blck_size=blck_size, address=None)


def infos_check(g, node, srcs) -> Optional[Refused]:
    """The `Refused` `apir.host.graph.shapes.check_node` raises for `node` (a TensorInfo) from
    `srcs`, or None."""
    from apir.host.graph.shapes import check_node, op_enums

    try:
        check_node(node, srcs, op_enums(g))
    except Refused as exc:
        return exc
    return None


def edited_refusal(guest, g, case, reason, edit=None, then=None) -> Refused:
    """`case` (its records edited by `edit(remote, recs)`, if given) refused by its op's own
    rule for its node, the reason containing `reason`; the host then computes the next graph:
    the unedited one, or case `then` (for a `case` ggml's constructor builds as it is refused)."""
    r = Remote(guest, g, case)
    try:
        recs = r.recs.copy()
        if edit is not None:
            edit(r, recs)
        got = refusal(r, recs, serves_next=then is None)
        assert_refused_by_rule(got, case.op, r.index(r.out))
        assert reason in got.reason, got.reason
    finally:
        r.close()
    if then is not None:
        assert_computes_like_cpu(guest, g, then)
    return got


def op_param_edit(i, value, t=None):
    """An `edit` for `edited_refusal`: op_params word `i` of `t` (default the result) := `value`."""
    def edit(r, recs):
        recs["op_params"][r.index(r.out if t is None else t)][i] = value
    return edit
