import pytest

from tests.codec import cbuild


@pytest.fixture(scope="session")
def codec_ref(cref_020, ggml, tmp_path_factory):
    """ggml-virtgpu's C codec (tests/codec/c/codec_ref.cpp), built once per session."""
    path = cbuild.build(cref_020, tmp_path_factory.mktemp("codec_ref"))
    return cbuild.load(path)
