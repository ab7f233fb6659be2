"""Issue 13, class 4, machine-checked: what the rule modules' test files share to list every
GGML_ASSERT of each op's CPU kernel (ggml 0.20 and 0.10) in a `KERNEL_ASSERTS` table, with
either a graph that violates it (`V`: edits of a valid case's records) or the reason no guest
graph reaches it (`Why`: another test shows it, or ggml itself keeps it).

Each test_<module>.py with such a table runs three tests on it: the table lists exactly the
asserts of the kernels in the C sources (`missing_asserts`, where the C reference sources are
present: `cpu_sources`), its ops are the module's, and each `V` graph is refused by the op's
own rule before compute, the host then serving the next graph (`violation_refusal`). The
op-by-op audit is docs/rule-audit.md."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.host.shapekit import Remote, assert_refused_by_rule, refusal


@dataclass(frozen=True)
class V:
    """A violation: `edits` of (field, role, index, value) on case `case` of the op (its
    n-th case in the module's CASES); field is ne, nb (index a dimension), type (value a type
    name) or param (index an op_params slot); role is dst, src0, src1 or src2."""

    edits: tuple[tuple, ...]
    case: int = 0
    since: tuple = (0, 0, 0)  # the ggml version whose kernel has the assert


@dataclass(frozen=True)
class Why:
    """An assert no edit of the records reaches, and what keeps it (a test, or ggml)."""

    reason: str


Cover = V | Why
I32 = "I32"


def v(*edits, case=0, since=(0, 0, 0)) -> V:
    return V(tuple(edits), case, since)


def cpu_sources():
    """pytest params (version, folder of ggml-cpu's ops.cpp and ggml-cpu.c) of the C reference
    builds present; one skipped param when there is none."""
    cache = Path(os.environ.get("APIR_CREF_CACHE", Path.home() / ".cache" / "apir" / "cref"))
    found = []
    for version, sub in (("0.20", "0.20/src/ggml"), ("0.10", "0.10/src/vendor/ggml")):
        folder = cache / sub / "src" / "ggml-cpu"
        if (folder / "ops.cpp").exists() and (folder / "ggml-cpu.c").exists():
            found.append(pytest.param(version, folder, id=f"ggml-{version}"))
    return found or [pytest.param(None, None, marks=pytest.mark.skip(
        reason="no C reference sources (tests/cref.py builds them)"))]


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


def missing_asserts(folder: Path, functions: dict, table: dict, plan_ops=()) -> dict:
    """op -> the asserts of its kernel functions (and, for `plan_ops`, its case in
    ggml_graph_plan) in the C sources of `folder` that `table` lacks."""
    bodies = _bodies(folder)
    missing = {}
    for op, names in functions.items():
        found = [a for n in names for a in _asserts(bodies.get(n, ""))]
        if op in plan_ops:
            found += _plan_asserts(bodies["ggml_graph_plan"], op)
        gone = [a for a in found if a not in table[op]]
        if gone:
            missing[op] = gone
    return missing


def found_any(folder: Path, names) -> bool:
    """Whether the parser found any assert in the functions `names` (it works at all)."""
    bodies = _bodies(folder)
    return any(_asserts(bodies.get(n, "")) for n in names)


def violations(table: dict):
    """pytest params (op, text, cover) of the table's `V` rows, ids `OP-assert text`."""
    return [pytest.param(op, text, cover, id=f"{op}-{text[:40]}")
            for op, asserts in table.items() for text, cover in asserts.items() if isinstance(cover, V)]


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


def violation_refusal(guest, ggml, case, op: str, text: str, cover: V) -> None:
    """`case` edited by `cover` (a graph against the kernel's assert `text`): refused by the
    op's own rule for the case's node, and the host serves the unedited graph next."""
    r = Remote(guest, ggml, case)
    try:
        recs = r.recs.copy()
        _apply(ggml, r, recs, cover)
        assert_refused_by_rule(refusal(r, recs), op, r.index(r.out))
    finally:
        r.close()
