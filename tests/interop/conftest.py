from pathlib import Path

import pytest

from tests import cref

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    # Every test here drives ggml's C code against apir; tox runs them in one Python only.
    for item in items:
        if item.path.parent == HERE:
            item.add_marker(pytest.mark.interop)


@pytest.fixture(scope="session", params=["0.20", "0.10"], ids=["apir0.2-ggml0.20", "apir0.1-ggml0.10"])
def cref_paths(request):
    """paths.env of each C reference build (APIR 0.2 / ggml 0.20.2 and APIR 0.1 / ggml 0.10.1)."""
    return cref.build(request.param)
