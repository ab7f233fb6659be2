import pytest

from tests import cref


@pytest.fixture(scope="session")
def ggml():
    """The pinned libggml (libggml-python 0.20.2.post1), loaded and layout-checked."""
    import apir.ggml

    return apir.ggml.load()


@pytest.fixture(scope="session")
def cref_020():
    """paths.env of the C reference built from libggml-python 0.20.2.post1 (APIR 0.2)."""
    return cref.build("0.20")


@pytest.fixture(scope="session")
def cref_010():
    """paths.env of the C reference built from ggml-py 0.10.1 (APIR 0.1)."""
    return cref.build("0.10")
