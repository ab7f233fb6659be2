"""tests/ggml_backends.py: whether the ggml Vulkan/RPC build is there, without building it
(what the benchmarks ask before starting ggml-rpc's rpc-server as apir's peer)."""

from tests import ggml_backends


def test_is_built_needs_the_finished_marker_and_paths_env(monkeypatch, tmp_path):
    monkeypatch.setenv("APIR_CACHE_DIR", str(tmp_path))
    out = tmp_path / "ggml-backends" / ggml_backends.SDIST_VERSION
    assert ggml_backends.cache_dir() == out
    assert not ggml_backends.is_built()
    out.mkdir(parents=True)
    (out / "paths.env").write_text(f"RPC_SERVER={out}/build/bin/rpc-server\nGGML_LIB_DIR={out}/build/src\n")
    assert not ggml_backends.is_built()  # a build that stopped half-way has paths.env but no .complete
    (out / ".complete").touch()
    assert ggml_backends.is_built()
    assert ggml_backends.read_build() == {"RPC_SERVER": f"{out}/build/bin/rpc-server",
                                          "GGML_LIB_DIR": f"{out}/build/src"}
