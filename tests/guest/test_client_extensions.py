"""apir.guest.client_extensions: what the guest sends once extensions are agreed (or not):
a graph sent before goes as GRAPH_RECOMPUTE of its id, a graph the host no longer holds is
sent again, device functions select their device once, and with APIR_EXTENSIONS=off the
guest never asks."""

from apir.codec.constants import ApirBackendCommandType as Cmd, ApirExtensionCommandType as X
from apir.guest.client import ApirClient
from apir.guest.client_extensions import default_extensions
from apir.local.embedded import EmbeddedDevice
from tests.local.localkit import record_execbuffers
from tests.host.hostkit import GgmlScratch, add_chain
from apir.codec.graph import BufferTable, serialize_graph


def _recording(client):
    calls = []
    call = client._call

    def record(function, *args, **kwargs):
        calls.append(int(function))
        return call(function, *args, **kwargs)

    client._call = record
    return calls


def _wire(ggml, client, s):
    graph = add_chain(ggml, s.ctx, 2)
    local = ggml.ggml_backend_alloc_ctx_tensors_from_buft(s.ctx, ggml.ggml_backend_cpu_buffer_type())
    handle = client.buffer_type_alloc_buffer(client.device_get_buffer_type(), ggml.ggml_backend_buffer_get_size(local))
    table = BufferTable()
    table.register(local, handle, ggml.ggml_backend_buffer_get_base(local))
    return serialize_graph(ggml, graph, table).tobytes(), local


def test_a_graph_sent_before_is_recomputed_by_id(ggml):
    client = ApirClient.connect(EmbeddedDevice())
    s = GgmlScratch(ggml)
    try:
        wire, local = _wire(ggml, client, s)
        calls = _recording(client)
        assert [client.backend_graph_compute(wire) for _ in range(3)] == [0, 0, 0]
        assert calls == [X.GRAPH_COMPUTE_KEEP, X.GRAPH_RECOMPUTE, X.GRAPH_RECOMPUTE]
        client.remote.device.kernel.ctx._library._kept.clear()  # the host dropped it
        del calls[:]
        assert client.backend_graph_compute(wire) == 0
        assert calls == [X.GRAPH_RECOMPUTE, X.GRAPH_COMPUTE_KEEP]
        ggml.ggml_backend_buffer_free(local)
    finally:
        s.close()
        client.close()


def test_without_extensions_the_guest_sends_apir_0_2(ggml, monkeypatch):
    monkeypatch.setenv("APIR_EXTENSIONS", "off")
    assert default_extensions() == 0
    device = EmbeddedDevice(config={"apir.host.backend": "cpu,cpu"})
    sent = record_execbuffers(device)
    client = ApirClient.connect(device)
    s = GgmlScratch(ggml)
    try:
        assert client.extensions == 0 and client.device_count == 1
        wire, local = _wire(ggml, client, s)
        assert client.backend_graph_compute(wire) == 0
        functions = [int.from_bytes(f[4:8], "little") for f in sent[2:]]  # after HandShake, LoadLibrary
        assert functions and all(f < len(Cmd) for f in functions)
        assert functions[-1] == Cmd.BACKEND_GRAPH_COMPUTE
        ggml.ggml_backend_buffer_free(local)
    finally:
        s.close()
        client.close()


def test_device_functions_select_their_device_once():
    client = ApirClient.connect(EmbeddedDevice(config={"apir.host.backend": "cpu,cpu"}))
    try:
        calls = _recording(client)
        one = client.on_device(1)
        one.device_get_name()
        one.device_get_buffer_type()
        client.on_device(0).device_get_name()
        assert calls == [X.DEVICE_SELECT, Cmd.DEVICE_GET_NAME, Cmd.DEVICE_GET_BUFFER_TYPE, X.DEVICE_SELECT,
                         Cmd.DEVICE_GET_NAME]
    finally:
        client.close()
