import pytest

from tests.host.hostkit import Guest


def pytest_collection_modifyitems(config, items):
    """`slow` tests here run only when asked for (`-m slow`): the project's pytest settings
    select no marker by default."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords and "tests/host/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def guest(ggml):
    g = Guest()
    yield g
    g.close()
