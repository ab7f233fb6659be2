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
