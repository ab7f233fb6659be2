import pytest

from tests.host.hostkit import Guest


@pytest.fixture
def guest(ggml):
    g = Guest()
    yield g
    g.close()
