"""Skip-or-fail for system tests (VM, Vulkan, llama.cpp, ...) whose prerequisites may be
missing: a test skips with the reason, unless APIR_REQUIRE_SYSTEM_TESTS=1 (CI sets it), where a
missing prerequisite is a failure -- CI must not go green by skipping what it is meant to run."""

from __future__ import annotations

import os

import pytest

ENV_REQUIRE = "APIR_REQUIRE_SYSTEM_TESTS"


def required() -> bool:
    """Whether missing prerequisites fail instead of skipping ($APIR_REQUIRE_SYSTEM_TESTS=1)."""
    return os.environ.get(ENV_REQUIRE, "") not in ("", "0")


def missing(reason: str) -> None:
    """Skips the running test with `reason`, or fails it when `required()`."""
    if required():
        pytest.fail(f"{reason} ({ENV_REQUIRE}=1: a missing prerequisite is a failure)", pytrace=False)
    pytest.skip(reason)
