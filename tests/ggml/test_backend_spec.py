"""apir.ggml.backend_spec: backend specs parsed and resolved through ggml's registry."""

import socket

import pytest

from apir.ggml.backend_spec import BackendSpecError, parse_spec, resolve


@pytest.mark.parametrize(
    "spec,kind,name,index,endpoints",
    [
        ("cpu", "cpu", "CPU", 0, ()),
        ("CPU", "cpu", "CPU", 0, ()),
        ("vulkan", "reg", "vulkan", 0, ()),
        ("Vulkan:1", "reg", "Vulkan", 1, ()),
        ("rpc:127.0.0.1:50052", "rpc", "RPC", 0, ("127.0.0.1:50052",)),
        ("rpc:127.0.0.1:1,localhost:2", "rpc", "RPC", 0, ("127.0.0.1:1", "localhost:2")),
    ],
)
def test_parse(spec, kind, name, index, endpoints):
    p = parse_spec(spec)
    assert (p.kind, p.name, p.index, p.endpoints) == (kind, name, index, endpoints)


@pytest.mark.parametrize(
    "spec", ["", "vulkan:x", "vulkan:-1", "rpc", "rpc:", "rpc:host", "rpc:host:0", "rpc:host:70000", "/x/libggml.so"]
)
def test_parse_refuses(spec):
    with pytest.raises(BackendSpecError):
        parse_spec(spec)


def test_resolve_cpu(ggml):
    choice = resolve(ggml, "cpu")
    assert choice.devices == [ggml.ggml_backend_dev_by_type(0)]
    assert ggml.ggml_backend_reg_name(choice.regs[0]) == b"CPU"
    assert resolve(ggml, "CPU:0").devices == choice.devices  # the registration by name


def test_resolve_unknown_names_what_there_is(ggml):
    with pytest.raises(BackendSpecError, match="no backend 'nosuch'.*CPU"):
        resolve(ggml, "nosuch")
    with pytest.raises(BackendSpecError, match="has 1 device"):
        resolve(ggml, "cpu:1")


def test_rpc_server_not_reachable(ggml):
    """Nothing listens on the port: refused before ggml-rpc (which would abort the process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(BackendSpecError):
            resolve(ggml, f"rpc:127.0.0.1:{port}")


def test_backend_library_reads_the_process_map(ggml, tmp_path):
    from apir.ggml.backend_spec import backend_library

    cpu = backend_library("CPU")  # loaded with libggml
    assert cpu is not None and cpu.startswith(str(ggml.lib_dir)) and "/libggml-cpu.so" in cpu
    assert backend_library("Vulkan") is None  # the default build has none
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r--p 00000000 00:00 0 \n"  # no path
                    "7f01-7f02 r-xp 00001000 08:01 42   /opt/my gpu/libggml-vulkan.so.0.20.2\n")
    assert backend_library("Vulkan", str(maps)) == "/opt/my gpu/libggml-vulkan.so.0.20.2"
    assert backend_library("RPC", str(maps)) is None
    assert backend_library("Vulkan", str(tmp_path / "none")) is None


def test_missing_backend_hint_names_what_is_missing(ggml, monkeypatch):
    """Without a Vulkan build: the build that has one. With ggml-vulkan loaded but no Vulkan
    registration (the loader found no driver; it used to be told to get a Vulkan build): the
    driver, VK_ICD_FILENAMES and docs/gpu.md."""
    from apir.ggml import backend_spec

    if ggml.ggml_backend_reg_by_name(b"Vulkan"):
        pytest.skip("this ggml build has a Vulkan registration")
    hint = backend_spec.missing_backend_hint(ggml, "vulkan:0")
    assert hint.startswith(f"; the ggml build apir loaded ({ggml.lib_dir}) has no vulkan device: "
                           "scripts/build-ggml-backends.sh builds one") and "docs/gpu.md" in hint
    monkeypatch.setattr(backend_spec, "backend_library", lambda name: f"/b/libggml-{name}.so")
    hint = backend_spec.missing_backend_hint(ggml, "vulkan:0")
    assert hint == ("; the ggml build apir loaded has ggml-vulkan (/b/libggml-vulkan.so), but the Vulkan loader "
                    "found no driver: install the GPU's Vulkan driver (ICD) or point VK_ICD_FILENAMES at its JSON "
                    "file; `vulkaninfo --summary` lists what the loader sees (docs/gpu.md)")
    assert backend_spec.missing_backend_hint(ggml, "cpu") == backend_spec.missing_backend_hint(ggml, "rpc:h:1") == ""


def test_split_specs_names_each_device_of_a_list():
    from apir.ggml.backend_spec import split_specs

    assert split_specs("cpu") == ["cpu"]
    assert split_specs("cpu,vulkan:0") == ["cpu", "vulkan:0"]
    assert split_specs("rpc:a:1,b:2") == ["rpc:a:1,b:2"]  # one spec of two servers
    assert split_specs("rpc:a:1,rpc:b:2") == ["rpc:a:1", "rpc:b:2"]  # two devices
    assert split_specs("cpu, vulkan:1 ,rpc:a:1,b:2") == ["cpu", "vulkan:1", "rpc:a:1,b:2"]
