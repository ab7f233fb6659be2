"""tests/host/shapes: one test file per rule module of apir.host.graph.shapes. A run is *complete*
when it holds tests of every file here and none of them was deselected; then
test_checked_ops.py's coverage check, moved to the end of the run, checks what the other
tests recorded (tests/host/shapekit.py's COVERAGE)."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent
COVERAGE_CHECK = "test_every_checked_op_has_an_accepted_and_a_refused_case"
RUN = {"complete": False, "deselected": False}


def _here(item) -> bool:
    return Path(str(item.fspath)).parent == HERE


def pytest_deselected(items):
    if any(_here(i) for i in items):
        RUN["deselected"] = True


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """After every selection (-k, -m, --lf): notes whether the run is complete, and moves the
    coverage check after every other test."""
    ours = {Path(str(i.fspath)).name for i in items if _here(i)}
    files = {p.name for p in HERE.glob("test_*.py")}
    RUN["complete"] = ours == files and not RUN["deselected"]
    last = [i for i in items if _here(i) and i.originalname == COVERAGE_CHECK]
    items[:] = [i for i in items if i not in last] + last
