"""A host in a child process, for inputs that would abort or hang the host: a regression then
fails the test (the child's exit signal, or its timeout) instead of killing or stalling
pytest.

`compute_mutated(case_ref, edits)` runs in the child (spawned, so it imports this worktree's
`apir` afresh): it lays out the graph of a shapekit `Case` in a host buffer (`Remote`), applies
`edits` to its tensor records, sends it with BACKEND_GRAPH_COMPUTE, then sends the unedited
graph again. `run_in_child` starts it and returns its `ChildResult`; `refusal_in_child` does
both and returns the host's `Refused` of the edited graph.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import queue
import time
from typing import List, NamedTuple, Sequence, Tuple

import numpy as np

# (tensor: an input index of the case or -1 for its result, field of the apir_rpc_tensor
# record: "ne", "nb", "type" (a type name) or "op_params" (one int32 word), index in the field,
# value, numpy dtype the value is written as (op_params: its bytes become the word))
Edit = Tuple[int, str, int, object, type]


class ChildResult(NamedTuple):
    rc: int  # backend rc of the edited graph's compute
    log: str  # apir.host's warnings during it
    next_rc: int  # backend rc and ggml status of the unedited graph sent next
    next_status: int
    refusals: List  # the apir.host.errors.Refused objects logged for the edited graph
    out_node: int  # the case's result's index in the graph's tensor records


def compute_mutated(case_ref: Tuple[str, str], edits: Sequence[Edit]) -> ChildResult:
    """In the child: `case_ref` = (module, name) of a module-level shapekit `Case`."""
    import apir.ggml
    from tests.host.hostkit import Guest
    from tests.host.shapekit import Remote

    case = getattr(importlib.import_module(case_ref[0]), case_ref[1])
    g = apir.ggml.load()
    guest = Guest()
    r = Remote(guest, g, case)
    recs = r.recs.copy()
    for which, field, index, value, dtype in edits:
        i = r.index(r.out if which < 0 else r.inputs[which])
        if field == "op_params":
            recs["op_params"][i][index] = np.array([value]).astype(dtype).view(np.int32)[0]
        elif field == "type":
            recs["type"][i] = g.types[value]
        else:
            recs[field][i][index] = value
    lines, refusals = [], []

    def emit(record):
        lines.append(record.getMessage())
        if getattr(record, "refusal", None) is not None:
            refusals.append(record.refusal)

    handler = logging.Handler(logging.WARNING)
    handler.emit = emit  # type: ignore[method-assign]
    log = logging.getLogger("apir.host")
    log.addHandler(handler)
    try:
        rc, _ = r.compute(recs)
    finally:
        log.removeHandler(handler)
    next_rc, dec = r.compute()
    next_status = dec.i32() if next_rc == 0 else -1
    r.close()
    guest.close()
    return ChildResult(rc, "\n".join(lines), next_rc, next_status, refusals, r.index(r.out))


def refusal_in_child(case_ref: Tuple[str, str], edits: Sequence[Edit]):
    """The case's graph with `edits`, computed by a host in a child process: refused (one
    `Refused`, returned with the index of the case's result: `(refused, out_node)`), and the
    unedited graph sent next computed (the host served on)."""
    got = run_in_child(compute_mutated, case_ref, edits)
    assert got.rc == 1, got  # BACKEND_RC_ERROR
    assert len(got.refusals) == 1, got
    assert (got.next_rc, got.next_status) == (0, 0), got
    return got.refusals[0], got.out_node


def _main(out, fn, args):
    out.put(fn(*args))


def run_in_child(fn, *args, timeout: float = 120.0):
    """`fn(*args)` in a spawned child process; its return value. Fails the test when the child
    dies (an abort: SIGABRT's exit code) or is still running after `timeout` seconds (it is
    then killed)."""
    import pytest

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_main, args=(out, fn, args), daemon=True)
    child.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                result = out.get(timeout=0.2)
                break
            except queue.Empty:
                if not child.is_alive():
                    pytest.fail(f"the host process died (exit code {child.exitcode})")
                if time.monotonic() > deadline:
                    pytest.fail(f"the host process still computed after {timeout} s (a hang)")
    finally:
        if child.is_alive():
            child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join()
    return result
