import pytest

from apir.host.local.server import LocalServer
from tests.local.localkit import EchoContext


@pytest.fixture
def server(tmp_path):
    """A socket host (LocalServer) in this process whose contexts echo (localkit.EchoContext)."""
    srv = LocalServer(str(tmp_path / "s.sock"), context_factory=EchoContext).start()
    yield srv
    srv.close()
