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


@pytest.fixture(params=["accel", "plain"])
def host_path(request, monkeypatch):
    """Runs a test on the host's accelerated path (Numba kernels) and on its plain one
    (apir.accel.enabled() False, as with APIR_ACCEL=0)."""
    from apir import accel

    if request.param == "accel" and not accel.enabled():
        pytest.skip("the kernels are off in this process (APIR_ACCEL=0 or no Numba)")
    if request.param == "plain":
        monkeypatch.setattr(accel, "enabled", lambda: False)
    return request.param
