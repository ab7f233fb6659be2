"""tests/prereq.py, the one skip-or-fail of system tests (tests/ggml_backends.py, tests/vm,
tests/llama use it): a missing prerequisite skips the test with its reason, and fails it when
APIR_REQUIRE_SYSTEM_TESTS=1 (CI)."""

import pytest

from tests import prereq


@pytest.mark.parametrize("value", [None, "", "0"])
def test_missing_skips_unless_required(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(prereq.ENV_REQUIRE, raising=False)
    else:
        monkeypatch.setenv(prereq.ENV_REQUIRE, value)
    with pytest.raises(pytest.skip.Exception, match="no debootstrap"):
        prereq.missing("no debootstrap")


def test_missing_fails_when_required(monkeypatch):
    monkeypatch.setenv(prereq.ENV_REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception, match="no debootstrap .*APIR_REQUIRE_SYSTEM_TESTS=1"):
        prereq.missing("no debootstrap")
