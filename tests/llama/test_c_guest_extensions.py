"""llama.cpp with the extended C guest (patches/ggml-virtgpu-extensions.patch, built by
scripts/build-llama-cpp.sh --extensions): SmolLM2-135M generates the same 64 greedy tokens
through apir's host as the unpatched C guest and as local ggml CPU; its ext_query,
graph_compute_keep and graph_recompute carry the bytes of docs/protocol.md section 12 (each
record with its tensor's use count, USE_COUNTS); a decode
token's graph crosses once and is then recomputed by id, in as many round trips as before;
against a host with the extensions off, or with APIR_EXTENSIONS=off, it sends what the
unpatched guest sends. Against a host serving two CPU devices (DEVICES), llama.cpp splits the
model's layers over two ggml devices, device_select precedes device functions when the
selection changes, and both host devices compute graphs. Against a host that offers no
device_buffer_from_ptr (so that tensors cross as to a GPU), a decode token's sets are posted
(ASYNC) with its graph: two round trips instead of eight. With two host devices and ASYNC's
events, llama.cpp turns on pipeline parallelism and ggml's scheduler records, waits for and
synchronizes the host's events. The tokens stay local CPU's.

The host records every command's bytes (tests/llama/record_host.py). The guests use the APIR
capset (GGML_REMOTING_USE_APIR_CAPSET), so command types are the spec's, not Venus-shifted."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest

from apir.codec.constants import (
    APIR_BACKEND_FORWARD_INDEX_INVALID,
    APIR_BACKEND_GRAPH_UNKNOWN,
    APIR_FORWARD_POSTED,
    ApirBackendCommandType as Cmd,
    ApirCommandType,
    ApirExtension,
    ApirExtensionCommandType as X,
    ApirForwardReturnCode,
)
from apir.codec.records import rpc_tensor_dtype
from tests.interop.harness import REPO, c_build_env
from tests.llama.runner import HOST_ERROR, LOGITS_ATOL, Generation, apir_env, generate, local_env

PROMPT = "The capital of France is"
BASE = ApirForwardReturnCode.BASE_INDEX
GRAPH_FUNCTIONS = (Cmd.BACKEND_GRAPH_COMPUTE, X.GRAPH_COMPUTE_KEEP, X.GRAPH_RECOMPUTE)
# what the guest asks for
WANTED = ApirExtension.DEVICES | ApirExtension.GRAPH_REPLAY | ApirExtension.ASYNC | ApirExtension.USE_COUNTS
TWO_CPUS = {"apir.host.backend": "cpu,cpu"}


@dataclass
class Forward:
    function: int
    command: bytes
    rc: int
    reply: bytes
    device: Optional[int] = None  # the host device of a kept graph (graph_compute_keep, graph_recompute)
    graph: bytes = b""  # graph_compute_keep: the graph's bytes
    posted: bool = False  # ASYNC: sent without waiting, at the head of EXECBUFFER `execbuffer`
    execbuffer: int = 0


class RecordingHost:
    """`python -m tests.llama.record_host` on the build's ggml, as a context manager."""

    def __init__(self, paths: Dict[str, str], workdir: Path, config: Dict[str, str]):
        self.socket, self.out, self.log_path = workdir / "apir.sock", workdir / "record.json", workdir / "host.log"
        config = {"apir.host.n_threads": "1", "apir.host.device_type": "gpu", **config}
        cmd = [sys.executable, "-m", "tests.llama.record_host", "--socket", str(self.socket), "--out", str(self.out),
               *[arg for k, v in config.items() for arg in ("--config", f"{k}={v}")]]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=c_build_env(paths), cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError(f"recording host did not start: {self.log_path.read_text()}")

    def stop(self) -> List[Forward]:
        """Stops the host; its Forward commands in order."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self._log.close()
        forwards = []
        for r in json.loads(self.out.read_text()) if self.out.exists() else []:
            cmd = bytes.fromhex(r["command"])
            cmd_type, flags, _ = struct.unpack_from("<III", cmd)
            if cmd_type == ApirCommandType.FORWARD:
                forwards.append(Forward(flags & ~APIR_FORWARD_POSTED, cmd, r["rc"], bytes.fromhex(r["reply"]),
                                        r.get("device"), bytes.fromhex(r.get("graph", "")), r["posted"],
                                        r["execbuffer"]))
        return forwards

    @property
    def errors(self) -> List[str]:
        return [line for line in self.log_path.read_text().splitlines() if HOST_ERROR.search(line)]


@dataclass
class Run:
    gen: Generation
    forwards: List[Forward]


def _through_apir(paths, model, workdir: Path, guest_lib_dir: Optional[str] = None,
                  host_config: Optional[Dict[str, str]] = None, **kw) -> Run:
    workdir.mkdir()
    host = RecordingHost(paths, workdir, host_config or {})
    try:
        env = apir_env(paths, host.socket)
        env["GGML_REMOTING_USE_APIR_CAPSET"] = "1"
        if guest_lib_dir:  # the extended libggml-virtgpu before the main build's
            env["LD_LIBRARY_PATH"] = f"{guest_lib_dir}:{env['LD_LIBRARY_PATH']}"
        gen = generate(paths, model, PROMPT, env, **kw)
    finally:
        forwards = host.stop()
    assert host.errors == [], "the host refused or failed commands"
    assert "[virtgpu] CPU" in gen.stderr
    return Run(gen, forwards)


def per_decode_token(forwards: List[Forward]) -> dict:
    """Round trips (Forward commands waited for), posted commands and graph bytes (in the
    command's blob) per decode token: from after the prompt's graph to the last graph, over the
    graphs in between."""
    graphs = [i for i, f in enumerate(forwards) if f.function in GRAPH_FUNCTIONS]
    decode = forwards[graphs[0] + 1: graphs[-1] + 1]
    tokens = len(graphs) - 1
    graph_bytes = sum(graph_size(f) for f in decode if f.function in GRAPH_FUNCTIONS[:2])
    waited = sum(not f.posted for f in decode)
    return {"tokens": tokens, "round_trips": waited / tokens, "posted": (len(decode) - waited) / tokens,
            "graph_bytes": graph_bytes / tokens, "graph_bytes_total": graph_bytes}


def use_counts(graph: bytes):
    """(the records' padding as int32, the times the graph's own src slots name each record),
    for the graph's nodes."""
    n_nodes = struct.unpack_from("<I", graph)[0]
    node_ids = np.frombuffer(graph, "<u8", n_nodes, 4)
    at = 8 + 8 * n_nodes
    dt = rpc_tensor_dtype()
    recs = np.frombuffer(graph, dt, struct.unpack_from("<I", graph, at - 4)[0], at)
    index = {int(t): i for i, t in enumerate(recs["id"])}
    srcs = [index[int(s)] for s in recs["src"].reshape(-1) if s]
    uses = np.bincount(np.array(srcs, np.int64), minlength=len(recs))
    nodes = [index[int(t)] for t in node_ids]
    return np.ascontiguousarray(recs["padding"]).view("<i4").reshape(-1)[nodes], uses[nodes]


def graph_size(f: Forward) -> int:
    """The graph's size argument: after res_id (graph_compute), after graph_id + res_id (keep)."""
    return struct.unpack_from("<Q", f.command, 16 if f.function == Cmd.BACKEND_GRAPH_COMPUTE else 24)[0]


@pytest.fixture(scope="module")
def local(llama_paths, smollm2, tmp_path_factory) -> Generation:
    logits = tmp_path_factory.mktemp("local") / "local.f32"
    return generate(llama_paths, smollm2, PROMPT, local_env(llama_paths), logits_file=logits)


@pytest.fixture(scope="module")
def unpatched(llama_paths, smollm2, tmp_path_factory) -> Run:
    return _through_apir(llama_paths, smollm2, tmp_path_factory.mktemp("x") / "unpatched")


def test_extended_guest_same_tokens_and_replayed_graphs(llama_paths, extended_guest_paths, smollm2, local,
                                                        unpatched, tmp_path):
    run = _through_apir(llama_paths, smollm2, tmp_path / "extended", extended_guest_paths["GGML_LIB_DIR"],
                        logits_file=tmp_path / "extended.f32")
    assert len(local.generated) == 64
    assert unpatched.gen.generated == local.generated
    assert run.gen.generated == local.generated, (local.text, run.gen.text)
    assert np.abs(run.gen.logits - local.logits).max() <= LOGITS_ATOL

    # negotiation: docs/protocol.md 12.2's example, right after LoadLibrary; one host device
    query = run.forwards[0]
    reply_res = query.command[8:12]
    assert query.command == bytes.fromhex("02000000" "00010000") + reply_res + struct.pack("<I", WANTED)
    assert query.rc == BASE and query.reply[:8] == struct.pack("<II", WANTED, 1)
    assert X.DEVICE_SELECT not in [f.function for f in run.forwards]
    # ggml CPU's buffers are the guest's memory (device_buffer_from_ptr): nothing to post
    assert not any(f.posted for f in run.forwards)
    assert sum(f.function == X.EXT_QUERY for f in run.forwards) == 1

    # replay: no 0.2 graph_compute, a keep for each new graph, recomputes of kept ids only
    functions = [f.function for f in run.forwards]
    assert Cmd.BACKEND_GRAPH_COMPUTE not in functions
    graphs = [f for f in run.forwards if f.function in GRAPH_FUNCTIONS]
    assert len(graphs) == sum(f.function == Cmd.BACKEND_GRAPH_COMPUTE for f in unpatched.forwards)
    kept = set()
    for f in graphs:
        header = struct.pack("<III", ApirCommandType.FORWARD, f.function, int.from_bytes(reply_res, "little"))
        assert f.command[:12] == header and f.rc == BASE and f.reply[:4] == b"\0\0\0\0"  # GGML_STATUS_SUCCESS
        graph_id = struct.unpack_from("<Q", f.command, 12)[0]
        if f.function == X.GRAPH_COMPUTE_KEEP:  # u64 graph_id, u32 res_id, size_t size
            assert len(f.command) == 12 + 8 + 4 + 8
            kept.add(graph_id)
        else:  # u64 graph_id
            assert len(f.command) == 12 + 8 and graph_id in kept
    keeps = [f for f in graphs if f.function == X.GRAPH_COMPUTE_KEEP]
    for f in keeps:  # USE_COUNTS: ggml's counts of the whole graph, in each record's padding
        wire, own = use_counts(f.graph)
        # one split here: each node's count is the times the graph's own records name it
        assert len(wire) > 100 and own.max() > 1 and (wire == own).all()
    # the prompt's graph and the first decode graph cross; every later token is recomputed
    assert len(keeps) == 2 and functions.count(X.GRAPH_RECOMPUTE) == len(graphs) - 2
    first = next(f for f in unpatched.forwards if f.function == Cmd.BACKEND_GRAPH_COMPUTE)
    assert graph_size(keeps[0]) == graph_size(first)

    # the same round trips per decode token, and no graph bytes once the decode graph is kept
    before, after = per_decode_token(unpatched.forwards), per_decode_token(run.forwards)
    print(f"per decode token: unpatched {before}, extended {after}")
    assert after["tokens"] == before["tokens"] == len(graphs) - 1
    assert after["round_trips"] == before["round_trips"]
    assert after["graph_bytes_total"] == graph_size(keeps[1])
    assert before["graph_bytes_total"] >= before["tokens"] * graph_size(keeps[1])


def test_extended_guest_on_an_unextended_host(llama_paths, extended_guest_paths, smollm2, unpatched, tmp_path):
    run = _through_apir(llama_paths, smollm2, tmp_path / "off", extended_guest_paths["GGML_LIB_DIR"],
                        host_config={"apir.host.extensions": "off"})
    assert run.gen.generated == unpatched.gen.generated
    query, rest = run.forwards[0], run.forwards[1:]
    assert query.function == X.EXT_QUERY
    assert query.rc == BASE + APIR_BACKEND_FORWARD_INDEX_INVALID and query.reply == b""
    # then APIR 0.2 byte for byte: the unpatched guest's commands
    assert [f.command for f in rest] == [f.command for f in unpatched.forwards]


def test_extended_guest_with_extensions_off_sends_apir_0_2(llama_paths, extended_guest_paths, smollm2, unpatched,
                                                          tmp_path, monkeypatch):
    monkeypatch.setenv("APIR_EXTENSIONS", "off")  # the guest's knob, as apir's Python guest's
    run = _through_apir(llama_paths, smollm2, tmp_path / "guest-off", extended_guest_paths["GGML_LIB_DIR"])
    assert run.gen.generated == unpatched.gen.generated
    assert [f.command for f in run.forwards] == [f.command for f in unpatched.forwards]


def test_extended_guest_resends_a_graph_the_host_did_not_keep(llama_paths, extended_guest_paths, smollm2, unpatched,
                                                             tmp_path):
    # graphs larger than the host's bound are computed and not kept: every recompute is
    # answered APIR_BACKEND_GRAPH_UNKNOWN and the guest sends the graph again
    run = _through_apir(llama_paths, smollm2, tmp_path / "unkept", extended_guest_paths["GGML_LIB_DIR"],
                        host_config={"apir.host.kept_graph_bytes": "4096"})
    assert run.gen.generated == unpatched.gen.generated
    graphs = [f for f in run.forwards if f.function in GRAPH_FUNCTIONS]
    recomputes = [f for f in graphs if f.function == X.GRAPH_RECOMPUTE]
    assert recomputes and all(f.rc == BASE + APIR_BACKEND_GRAPH_UNKNOWN and f.reply == b"" for f in recomputes)
    keeps = [f for f in graphs if f.function == X.GRAPH_COMPUTE_KEEP]
    assert len(keeps) == sum(f.function == Cmd.BACKEND_GRAPH_COMPUTE for f in unpatched.forwards)
    # each refused recompute is followed by the keep of the same id
    for i, f in enumerate(graphs):
        if f.function == X.GRAPH_RECOMPUTE:
            assert graphs[i + 1].function == X.GRAPH_COMPUTE_KEEP and graphs[i + 1].command[12:20] == f.command[12:20]


def test_extended_guest_splits_the_model_over_two_host_devices(llama_paths, extended_guest_paths, smollm2, local,
                                                              tmp_path):
    run = _through_apir(llama_paths, smollm2, tmp_path / "two", extended_guest_paths["GGML_LIB_DIR"],
                        host_config=TWO_CPUS, logits_file=tmp_path / "two.f32")
    assert run.gen.generated == local.generated, (local.text, run.gen.text)
    assert np.abs(run.gen.logits - local.logits).max() <= LOGITS_ATOL
    query = run.forwards[0]
    assert query.function == X.EXT_QUERY and query.reply[:8] == struct.pack("<II", WANTED, 2)
    # llama.cpp's layer split put weights and KV cache on both (distinctly named) devices
    for name in ("[virtgpu] CPU", "[virtgpu1] CPU"):
        assert f"{name} model buffer size" in run.gen.stderr and f"{name} KV buffer size" in run.gen.stderr

    # device_select(i), 16 bytes answered 4, only when the selection changes (device 0 first)
    selected, selects = 0, []
    for f in run.forwards:
        if f.function == X.DEVICE_SELECT:
            (device,) = struct.unpack_from("<I", f.command, 12)
            assert len(f.command) == 16 and f.rc == BASE and device != selected
            selected = device
            selects.append(device)
    assert set(selects) == {0, 1}
    # each device's information fetched once, under its own selection
    names = [f for f in run.forwards if f.function == Cmd.DEVICE_GET_NAME]
    assert len(names) == 2

    # graphs on both host devices: each decode token's graph is split over them
    graphs = [f for f in run.forwards if f.function in GRAPH_FUNCTIONS]
    assert all(f.rc == BASE for f in graphs) and Cmd.BACKEND_GRAPH_COMPUTE not in [f.function for f in graphs]
    devices = [f.device for f in graphs]
    assert set(devices) == {0, 1}, devices
    recomputed = [f.device for f in graphs if f.function == X.GRAPH_RECOMPUTE]
    assert recomputed.count(0) >= 60 and recomputed.count(1) >= 60


def test_extended_guest_posts_tensor_sets(llama_paths, extended_guest_paths, smollm2, local, tmp_path):
    # a host that offers no device_buffer_from_ptr: the guest allocates device buffers and
    # sends every tensor's bytes, as to a GPU
    config = {"apir.host.import_host_memory": "0"}
    unpatched = _through_apir(llama_paths, smollm2, tmp_path / "sync", host_config=config)
    run = _through_apir(llama_paths, smollm2, tmp_path / "async", extended_guest_paths["GGML_LIB_DIR"],
                        host_config=config)
    assert unpatched.gen.generated == run.gen.generated == local.generated, (local.text, run.gen.text)
    assert Cmd.DEVICE_BUFFER_FROM_PTR not in [f.function for f in run.forwards]

    # posted: buffer_set_tensor_at (the bytes in the guest's post window) and buffer_clear, at
    # the head of the next waited command's EXECBUFFER, their length in the third word
    posted = [f for f in run.forwards if f.posted]
    assert posted and {f.function for f in posted} == {X.BUFFER_SET_TENSOR_AT, Cmd.BUFFER_CLEAR}
    windows, last_offset = set(), {}
    for f in posted:
        assert struct.unpack_from("<III", f.command) == (
            ApirCommandType.FORWARD, f.function | APIR_FORWARD_POSTED, len(f.command))
        if f.function == X.BUFFER_SET_TENSOR_AT:  # ..., u32 res_id, size_t res_offset, offset, size
            res_id, res_offset, _, size = struct.unpack_from("<IQQQ", f.command, len(f.command) - 28)
            windows.add(res_id)
            # increasing 16-aligned offsets in the window until a reply frees it
            assert res_offset % 16 == 0 and res_offset >= last_offset.get(f.execbuffer, 0)
            last_offset[f.execbuffer] = res_offset + size
    assert len(windows) == 1
    by_execbuffer: Dict[int, List[Forward]] = {}
    for f in run.forwards:
        by_execbuffer.setdefault(f.execbuffer, []).append(f)
    # each EXECBUFFER: posted commands, then at most one waited for
    assert all(f.posted for fs in by_execbuffer.values() for f in fs[:-1])

    # a decode token: the unpatched guest's sets, its graph and its read each waited for; the
    # extended guest's sets posted with the graph: two round trips
    before, after = per_decode_token(unpatched.forwards), per_decode_token(run.forwards)
    print(f"per decode token: unpatched {before}, extended {after}")
    assert before["posted"] == 0 and before["round_trips"] >= 4
    assert after["round_trips"] == 2 and after["posted"] == before["round_trips"] - 2


def test_extended_guest_pipelines_over_two_host_devices_with_events(llama_paths, extended_guest_paths, smollm2,
                                                                     local, tmp_path):
    # two host devices whose buffers are device buffers: every device has async and events, so
    # llama.cpp turns on pipeline parallelism and ggml's scheduler makes, records and waits for
    # events
    config = {**TWO_CPUS, "apir.host.import_host_memory": "0"}
    run = _through_apir(llama_paths, smollm2, tmp_path / "events", extended_guest_paths["GGML_LIB_DIR"],
                        host_config=config, logits_file=tmp_path / "events.f32")
    assert run.gen.generated == local.generated, (local.text, run.gen.text)
    assert np.abs(run.gen.logits - local.logits).max() <= LOGITS_ATOL
    assert "pipeline parallelism enabled" in run.gen.stderr
    waited = [f for f in run.forwards if not f.posted]
    graphs = [f for f in waited if f.function in GRAPH_FUNCTIONS]
    assert {f.device for f in graphs} == {0, 1}

    # only event_new (12 bytes, answered a u64 handle) and event_free (12 + 8 bytes naming a
    # live handle) travel, waited for and answered 4: record, wait and synchronize have nothing
    # to wait for in a context whose computes and reads are all waited for
    events = [f for f in run.forwards if X.EVENT_NEW <= f.function <= X.EVENT_FREE]
    assert {f.function for f in events} == {X.EVENT_NEW, X.EVENT_FREE}
    live, made = set(), []
    for f in events:
        assert not f.posted and f.rc == BASE
        if f.function == X.EVENT_NEW:
            assert len(f.command) == 12
            made.append(struct.unpack_from("<Q", f.reply)[0])
            live.add(made[-1])
        else:
            assert len(f.command) == 20
            handle = struct.unpack_from("<Q", f.command, 12)[0]
            assert handle in live
            live.remove(handle)
    # ggml's scheduler: an event per copy (GGML_SCHED_MAX_COPIES, 4) of each virtgpu backend,
    # all freed with the context
    assert len(made) == len(set(made)) == 8 and not live
