"""apir.host.shapes (the package: CHECKED_OPS, the merge of the rule modules' RULES): every
op the host checks, in the loaded ggml, has an accepted case (computed through the host to
ggml CPU's bytes) and a case refused by its own rule, in the test file of its rule module
(tests/host/shapes/test_<module>.py). The cases record themselves as they pass
(tests/host/shapekit.py's COVERAGE); this check runs last, in a complete run of this folder
(conftest.py), once per ggml the suite runs with (APIR_GGML_LIB_DIR selects another)."""

from pathlib import Path

import pytest

from apir.host.shapes import CHECKED_OPS, op_enums
from tests.host.shapekit import COVERAGE

from tests.host.shapes.conftest import RUN

HERE = Path(__file__).parent


def _module(op: str) -> str:
    return CHECKED_OPS[op].__module__.rsplit(".", 1)[-1]


def test_every_checked_op_has_an_accepted_and_a_refused_case(ggml):
    if not RUN["complete"]:
        pytest.skip("needs a run of the whole of tests/host/shapes (the other tests record their cases)")
    version = ".".join(map(str, op_enums(ggml).version))
    missing = []
    for op in sorted(CHECKED_OPS):
        if op not in ggml.ops:  # (a rule for an op of another ggml version)
            continue
        if not (HERE / f"test_{_module(op)}.py").exists():
            continue  # (its module's tests are not moved here yet: test_every_rule_module_has_a_test_file)
        lacks = [kind for kind in ("accepted", "refused") if op not in COVERAGE[kind]]
        if lacks:
            missing.append(f"{op} ({_module(op)}): no {' and no '.join(lacks)} case")
    assert not missing, f"ggml {version}: " + "; ".join(missing)


# Rule modules whose tests still live in tests/host/test_shapes_*.py (issue 18 item 6, being
# moved here one module at a time): their test file's absence is expected, strictly.
_NOT_MOVED_YET = {"conv", "elementwise", "layout", "matrix", "tensor_ops"}
RULE_MODULES = sorted({_module(op) for op in CHECKED_OPS})


@pytest.mark.parametrize("module", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason="not moved yet")) if m in _NOT_MOVED_YET else m
    for m in RULE_MODULES])
def test_every_rule_module_has_a_test_file(module):
    assert (HERE / f"test_{module}.py").exists(), f"apir.host.shapes.{module} has no tests/host/shapes/test_{module}.py"
