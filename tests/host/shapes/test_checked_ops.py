"""apir.host.graph.shapes (the package: CHECKED_OPS, the merge of the rule modules' RULES): every
op the host checks, in the loaded ggml, has an accepted case (computed through the host to
ggml CPU's bytes) and a case refused by its own rule, in the test file of its rule module
(tests/host/shapes/test_<module>.py). The cases record themselves as they pass
(tests/host/shapekit.py's COVERAGE); this check runs last, in a complete run of this folder
(conftest.py), once per ggml the suite runs with (APIR_GGML_LIB_DIR selects another)."""

import re
from pathlib import Path

import pytest

from apir.host.graph.shapes import CHECKED_OPS, attention, backward, elementwise, layout, op_enums, rope
from tests.host.shapekit import COVERAGE
from tests.host.shapes.conftest import RUN

HERE = Path(__file__).parent


def _module(op: str) -> str:
    return CHECKED_OPS[op].__module__.rsplit(".", 1)[-1]


# Checked ops whose rule refuses nothing (what its node can lie about is the tensor checks'):
# no refused case can exist (test_layout.py::test_a_param_node_is_computed_as_nothing_...).
REFUSES_NOTHING = {"NONE"}


def test_every_checked_op_has_an_accepted_and_a_refused_case(ggml):
    if not RUN["complete"]:
        pytest.skip("needs a run of the whole of tests/host/shapes (the other tests record their cases)")
    version = ".".join(map(str, op_enums(ggml).version))
    missing = []
    for op in sorted(CHECKED_OPS):
        if op not in ggml.ops:  # (a rule for an op of another ggml version)
            continue
        lacks = [kind for kind in ("accepted", "refused") if (op, f"test_{_module(op)}.py") not in COVERAGE[kind]]
        if op in REFUSES_NOTHING and lacks == ["refused"]:
            continue
        if lacks:
            missing.append(f"{op}: no {' and no '.join(lacks)} case in test_{_module(op)}.py")
    assert not missing, f"ggml {version}: " + "; ".join(missing)


RULE_MODULES = sorted({_module(op) for op in CHECKED_OPS})


@pytest.mark.parametrize("module", RULE_MODULES)
def test_every_rule_module_has_a_test_file(module):
    assert (HERE / f"test_{module}.py").exists(), f"apir.host.graph.shapes.{module} has no tests/host/shapes/test_{module}.py"


def test_audit_table_has_a_row_per_op():
    """docs/rule-audit.md's section of these five modules has a row for each op they rule
    (from test_shapes_audit.py)."""
    doc = (HERE.parents[2] / "docs" / "rule-audit.md").read_text()
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
