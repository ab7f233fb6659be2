"""The conformance vectors (apir/conformance/data/*.json, captured from ggml's C guest and C host
library, and the extension vectors from the C guest of patches/ggml-virtgpu-extensions.patch
against apir's host) against apir's host, apir's guest encoder and the C host library; and the
runner's rules, which must catch a difference."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from apir.conformance import guest, host, vectors
from apir.conformance.cli import format_report

ALL_FILES = sorted(vectors.default_vector_dir().glob("*.json"))
EXT_FILE = vectors.default_vector_dir() / "apir-0.2-ext-ggml-0.25.3.json"
FILES = [f for f in ALL_FILES if f != EXT_FILE]  # the C guest and C host library's, 0.1 and 0.2
IDS = [f.stem for f in FILES]
REPO = Path(__file__).resolve().parents[2]


def _load(path, mutate=None, tmp_path=None):
    if mutate is None:
        return vectors.load(path)
    doc = json.loads(Path(path).read_text())
    mutate(doc)
    out = tmp_path / Path(path).name
    out.write_text(json.dumps(doc))
    return vectors.load(out)


def _step(doc, name, session=0):
    return next(s for s in doc["sessions"][session]["steps"] if s["name"] == name)


def _failures(results):
    return [(r.step, r.detail) for r in results if not r.ok]


def test_vectors_cover_the_protocol():
    """Both APIR versions; all 23 functions, HandShake over both capsets, LoadLibrary, graphs
    with views and two buffers, inline tensors, and error replies of the C host library."""
    assert {f.stem for f in ALL_FILES} == {"apir-0.1-ggml-0.10.1", "apir-0.2-ggml-0.20.2", EXT_FILE.stem}
    for path in FILES:
        vf = vectors.load(path)
        steps = [s for sess in vf.sessions for s in sess.steps]
        assert {s.raw.get("function_id") for s in steps if s.raw["command_type"] == "Forward"} >= set(range(23))
        assert {(sess.capset, s.raw["command_type"]) for sess in vf.sessions for s in sess.steps} >= {
            (10, "HandShake"), (4, "HandShake"), (10, "LoadLibrary"), (4, "LoadLibrary")}
        venus = next(s for s in vf.sessions if s.capset == 4)
        assert venus.steps[0].command[:4] == (331).to_bytes(4, "little")
        graphs = [s for s in steps if s.function == "backend_graph_compute" and s.raw["shmem_in"]["hex"]]
        assert len(graphs) == 3
        buffers = {f[4] for g in graphs for f in g.raw["shmem_in"]["fields"] if f[2].endswith(".buffer")}
        assert len(buffers - {0}) == 2
        assert any(f[2].endswith(".view_src") and f[4] for g in graphs for f in g.raw["shmem_in"]["fields"])
        rcs = {s.raw["reply"]["return_code"] for s in steps if s.name.startswith("error.")}
        assert rcs == {5, 10}
        props = next(s for s in steps if s.function == "device_get_props")
        assert len([f for f in props.raw["reply"]["fields"] if f[3] == "apir_encode_bool_t"]) == 3 + vf.minor


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_apir_host_passes(path):
    results = host.check_host(host.EmbeddedTarget(), [vectors.load(path)])
    assert _failures(results) == []
    assert len(results) == 57


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_apir_guest_encoder_passes(path):
    results = guest.check_guest([vectors.load(path)])
    assert _failures(results) == []
    assert sum(not r.skipped for r in results) == 46


def test_socket_host_passes(tmp_path):
    from apir.host.local.server import LocalServer

    with LocalServer(str(tmp_path / "h.sock")) as server:
        server.start()
        results = host.check_host(host.SocketTarget(server.path), [vectors.load(FILES[0]), vectors.load(EXT_FILE)])
    assert _failures(results) == []
    # the extension session's posted commands travel in one payload with their waited command;
    # the sessions needing a host configuration are skipped
    assert sum(r.skipped for r in results) == 29 and sum(r.step.startswith("buffer_set_tensor_at") for r in results
                                                         if not r.skipped) == 4


# --- the runner catches differences ------------------------------------------------------------
def test_host_check_reports_wrong_reply_field(tmp_path):
    actual = vectors.field_value(_step(json.loads(FILES[0].read_text()), "device_get_props")["reply"]["fields"],
                                 "async")

    def mutate(doc):
        _step(doc, "device_get_props")["reply"]["fields"][0][4] ^= 1

    results = host.check_host(host.EmbeddedTarget(), [_load(FILES[0], mutate, tmp_path)])
    assert _failures(results) == [("device_get_props", f"reply async: {actual}, expected {actual ^ 1}")]


def test_host_check_reports_wrong_computed_bytes(tmp_path):
    def mutate(doc):
        out = _step(doc, "buffer_get_tensor.r")["shmem_out"]
        raw = bytearray.fromhex(out["hex"])
        raw[5] ^= 0x40
        out["hex"] = raw.hex()

    fails = _failures(host.check_host(host.EmbeddedTarget(), [_load(FILES[0], mutate, tmp_path)]))
    assert len(fails) == 1 and fails[0][0] == "buffer_get_tensor.r"
    assert fails[0][1].startswith("shared memory out: byte 5 is")


def test_host_check_reports_wrong_return_code(tmp_path):
    def mutate(doc):
        _step(doc, "error.buffer_get_base.unknown_buffer")["reply"]["return_code"] = 4

    fails = _failures(host.check_host(host.EmbeddedTarget(), [_load(FILES[0], mutate, tmp_path)]))
    assert [f[0] for f in fails] == ["error.buffer_get_base.unknown_buffer"]
    assert fails[0][1].startswith("return code 5, expected 4")


def test_guest_check_reports_graph_difference(tmp_path):
    fields = _step(json.loads(FILES[0].read_text()), "backend_graph_compute.chain")["shmem_in"]["fields"]
    ne = vectors.field_value(fields, "tensors[1].ne")

    def mutate(doc):
        fields = _step(doc, "backend_graph_compute.chain")["shmem_in"]["fields"]
        next(f for f in fields if f[2] == "tensors[1].ne")[4][0] += 1

    fails = _failures(guest.check_guest([_load(FILES[0], mutate, tmp_path)]))
    wrong = [ne[0] + 1] + ne[1:]
    assert fails == [("backend_graph_compute.chain", f"shared memory in: tensors[1].ne: {ne}, expected {wrong}")]


def test_guest_check_reports_id_that_names_another_tensor(tmp_path):
    def mutate(doc):
        fields = _step(doc, "backend_graph_compute.chain")["shmem_in"]["fields"]
        a = next(f for f in fields if f[2] == "nodes[0]")
        b = next(f for f in fields if f[2] == "nodes[1]")
        a[4], b[4] = b[4], a[4]

    fails = _failures(guest.check_guest([_load(FILES[0], mutate, tmp_path)]))
    assert len(fails) == 1 and "nodes[0]" in fails[0][1] and "does not name" in fails[0][1]


def test_compare_rules():
    ctx = vectors.Context(res={"reply": 7}, handles={"s.buffer": 0x1234})
    fields = [[0, 4, "res", "u32", 1, "res:reply"], [4, 8, "h", "u64", 99, "ref:s.buffer"],
              [12, 8, "p", "ptr", 0, "nonzero"], [20, 4, "pad", "-", None, "any"], [24, 4, "v", "i32", -1]]
    good = (7).to_bytes(4, "little") + (0x1234).to_bytes(8, "little") + bytes(8) + b"\xaa" * 4 + b"\xff" * 4
    assert vectors.compare(fields, good, ctx) is None
    assert vectors.compare(fields, (8).to_bytes(4, "little") + good[4:], ctx).startswith("res:")
    assert vectors.compare(fields, good[:12] + (1).to_bytes(8, "little") + good[20:], ctx) == \
        "p: 0x1, expected 0"
    assert vectors.compare(fields, good[:24] + b"\xfe\xff\xff\xff", ctx) == "v: -2, expected -1"
    assert vectors.compare(fields, good + b"\0", ctx) == "length 29, expected 28"
    ids = [[0, 8, "a.id", "u64", 5, "id"], [8, 8, "b.id", "u64", 6, "id"], [16, 8, "b.src", "u64", 5, "id-ref"]]
    pack = lambda *v: b"".join(x.to_bytes(8, "little") for x in v)  # noqa: E731
    assert vectors.compare(ids, pack(50, 60, 50), ctx) is None
    assert "does not name" in vectors.compare(ids, pack(50, 60, 60), ctx)
    assert "not unique" in vectors.compare(ids, pack(50, 50, 50), ctx)


def test_report_format():
    results = [
        host.StepResult("f.json", "s", "a", True),
        host.StepResult("f.json", "s", "b", False, "x: 1, expected 2"),
        host.StepResult("f.json", "s", "c", True, "not a guest command", True),
    ]
    assert format_report("t", results, False) == ["== t", "FAIL f.json s b: x: 1, expected 2",
                                                   "t: 1 passed, 1 failed, 1 skipped"]


def test_cli_exit_status(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "apir", "conformance", "--vectors", str(FILES[0])],
                        check=False, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "host: embedded apir: 57 passed, 0 failed, 0 skipped" in ok.stdout
    assert "guest: apir's encoder: 46 passed, 0 failed, 11 skipped" in ok.stdout

    def mutate(doc):
        _step(doc, "device_get_count")["reply"]["fields"][0][4] = 2

    bad = _load(FILES[0], mutate, tmp_path)
    run = subprocess.run([sys.executable, "-m", "apir", "conformance", "--host-only", "--vectors", str(bad.path)],
                         check=False, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 1
    assert "FAIL apir-0.1-ggml-0.10.1.json apir-capset device_get_count: reply count: 1, expected 2" in run.stdout


def test_the_vectors_ship_with_the_package(tmp_path):
    """`apir conformance` from an installed wheel: the vectors are package data (pyproject's
    package-data), found beside the package. The wheel is stood in for by what it holds, the
    package's modules and that data, run outside the clone (from a wheel the runner looked
    for .../site-packages/conformance)."""
    import shutil

    tomllib = pytest.importorskip("tomllib")
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    site = tmp_path / "site-packages"
    for source in (REPO / "apir").rglob("*.py"):
        target = site / source.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, target)
    for package, patterns in package_data.items():
        folder = REPO.joinpath(*package.split("."))
        for pattern in patterns:
            for source in folder.glob(pattern):
                target = site / source.relative_to(REPO)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(source, target)
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-m", "apir", "conformance", "--guest-only"], env=env,
                         check=False, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "guest: apir's encoder: 150 passed, 0 failed, 27 skipped" in run.stdout


# --- the C host library, and the vectors against a fresh capture ---------------------------------
def _c_host_conformance(version: str, vectors) -> subprocess.CompletedProcess:
    """`apir conformance --host-only` on `vectors` against the C host library (ggml `version`,
    built by tests.cref) on ggml CPU."""
    from tests import cref
    from tests.interop.harness import c_build_env

    paths = cref.build(version)
    cmd = [sys.executable, "-m", "apir", "conformance", "--host-only", "--vectors", str(vectors),
           "--backend-library", paths["LIBGGML_VIRTGPU_BACKEND"],
           "--ggml-library", paths["LIBGGML_CPU"], "--ggml-reg", "ggml_backend_cpu_reg"]
    return subprocess.run(cmd, env=c_build_env(paths), check=False, capture_output=True, text=True, cwd=REPO,
                          timeout=300)


@pytest.mark.cref
@pytest.mark.interop
@pytest.mark.parametrize("version", ["0.20", "0.10"])
def test_c_host_library_passes(version):
    path = next(f for f in FILES if f"ggml-{version}" in f.name)
    run = _c_host_conformance(version, path)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert ": 57 passed, 0 failed, 0 skipped" in run.stdout


@pytest.mark.cref
@pytest.mark.interop
def test_c_host_library_answers_the_extension_fallback():
    """The extension vectors' 0.2 fallback session (recorded from apir's host with extensions
    off) is what a host without extensions answers: the C host library passes it; the
    extension and devices sessions are skipped (their replies are apir's host's)."""
    run = _c_host_conformance("0.20", EXT_FILE)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert ": 16 passed, 0 failed, 47 skipped" in run.stdout


@pytest.mark.cref
@pytest.mark.interop
@pytest.mark.parametrize("version", ["0.20", "0.10"])
def test_committed_vectors_match_a_fresh_capture(version, tmp_path):
    """scripts/make-conformance-vectors.py still produces the committed vectors: same steps,
    same fields and the same values wherever the rules compare values."""
    fresh = _fresh_capture(version, tmp_path)
    committed = json.loads(next(f for f in FILES if f"ggml-{version}" in f.name).read_text())
    assert _comparable(fresh) == _comparable(committed)


def _fresh_capture(version: str, out: Path) -> dict:
    run = subprocess.run([sys.executable, "scripts/make-conformance-vectors.py", "--version", version,
                          "--out", str(out)], check=False, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return json.loads(next(out.glob("*.json")).read_text())


def _comparable(doc: dict) -> list:
    """Every session's blobs, every step's fields (position, size, name, helper, and the value
    or the rule), name, return code, shared-memory output, and for posted commands the step
    they were sent with and their offset in the post window: what a re-capture must reproduce."""

    def field(f):
        # an any-string (the device description: the CPU's model name) without its size,
        # which is the string's length on the machine that captured it
        if len(f) > 5 and f[5] == "any-string":
            return [f[0], None, f[2], f[3], f[5]]
        return f[:4] + ([f[4]] if len(f) == 5 else [f[5]])

    out = []
    for sess in doc["sessions"]:
        out.append((sess["name"], sess["capset"], sess.get("host_config"), list(sess["resources"])))
        for st in sess["steps"]:
            reply = st.get("reply", {})  # none for a posted command
            parts = [st["command"]["fields"], reply.get("fields", []), st.get("shmem_in", {}).get("fields", [])]
            for fields in parts:
                out.append([field(f) for f in fields])
            out.append((st["name"], reply.get("return_code"), st.get("shmem_out", {}).get("hex"), st.get("sent_with"),
                        st.get("shmem_in", {}).get("offset")))
    return out


# --- the extension vectors (docs/protocol.md section 12) ----------------------------------------
def _ext_steps(session: int) -> dict:
    return {s["name"]: s for s in json.loads(EXT_FILE.read_text())["sessions"][session]["steps"]}


def test_extension_vectors_cover_what_the_c_guest_sends():
    """ext_query agreeing on graph replay, graph_compute_keep, graph_recompute of a kept graph
    and one the host forgot (GRAPH_UNKNOWN, then the graph again under its id), and the 0.2
    fallback: ext_query answered 10 by a host with extensions off, then no extension id."""
    vf = vectors.load(EXT_FILE)
    assert vf.extensions and [(s.name, s.host_config) for s in vf.sessions] == [
        ("apir-capset-extensions", {}), ("apir-capset-0.2-fallback", {"apir.host.extensions": "off"}),
        ("apir-capset-devices", {"apir.host.backend": "cpu,cpu"})]
    ext = _ext_steps(0)
    query = ext["ext_query"]
    assert (query["function_id"], vectors.field_value(query["command"]["fields"], "guest_extensions")) == (0x100, 15)
    assert [f[4] for f in query["reply"]["fields"]] == [15, 1]  # all four agreed, one device
    keep, again = ext["graph_compute_keep.add"], ext["graph_recompute.add"]
    assert (keep["function_id"], again["function_id"]) == (0x102, 0x103)
    graph_id = vectors.field_value(keep["command"]["fields"], "graph_id")
    assert graph_id and vectors.field_value(again["command"]["fields"], "graph_id") == graph_id
    assert len(bytes.fromhex(again["command"]["hex"])) == 20  # the id instead of the graph
    assert again["reply"]["return_code"] == 4
    names = list(ext)
    unknown = names.index("graph_recompute.add.unknown")
    assert ext[names[unknown]]["reply"]["return_code"] == 11 and ext[names[unknown]]["reply"]["hex"] == ""
    resend = ext[names[unknown + 1]]
    assert resend["function"] == "graph_compute_keep"
    assert vectors.field_value(resend["command"]["fields"], "graph_id") == graph_id
    # the same graph's bytes again (by the rules: the names' tails are the C's stack garbage)
    buffer = vectors.field_value(ext["buffer_type_alloc_buffer.a"]["reply"]["fields"], "buffer")
    ctx = vectors.Context(handles={"buffer_type_alloc_buffer.a.buffer": buffer})
    assert vectors.compare(resend["shmem_in"]["fields"], bytes.fromhex(keep["shmem_in"]["hex"]), ctx) is None
    # the graph computed again sees the new input: s_again differs from s, the resend equals it
    s1, s2, s3 = (ext[n]["shmem_out"]["hex"] for n in ("buffer_get_tensor.s", "buffer_get_tensor.s_again",
                                                        "buffer_get_tensor.s_resend"))
    assert s1 != s2 == s3
    fallback = _ext_steps(1)
    assert fallback["ext_query"]["reply"]["return_code"] == 10
    after = list(fallback)[list(fallback).index("ext_query") + 1:]
    assert max(fallback[n]["function_id"] for n in after) < 23  # APIR 0.2's functions only
    assert sum(s.get("function") == "backend_graph_compute" for s in fallback.values()) == 3
    assert [s["shmem_out"]["hex"] for n, s in fallback.items() if n.startswith("buffer_get_tensor.s")] == [s1, s2]


def _record_paddings(step: dict) -> list:
    """The int32 in each graph record's `padding` of a graph step's shared memory."""
    raw = bytes.fromhex(step["shmem_in"]["hex"])
    fields = step["shmem_in"]["fields"]
    return [struct.unpack_from("<i", raw, f[0])[0] for f in fields if f[2].endswith("].padding + tail hole")]


def test_extension_vectors_carry_use_counts():
    """USE_COUNTS agreed: each record of a + b carries its use count in the graph (a and b one
    each, the node none), as ggml-rpc's add_tensor; the 0.2 fallback's padding is the C's stack
    garbage, which no host reads."""
    for name in ("graph_compute_keep.add", "graph_compute_keep.mul", "graph_compute_keep.add.resend"):
        assert _record_paddings(_ext_steps(0)[name]) == [1, 1, 0], name
    assert _record_paddings(_ext_steps(1)["backend_graph_compute.add"]) != [1, 1, 0]


def test_extension_vectors_cover_async_and_devices():
    """ASYNC: sets posted as buffer_set_tensor_at (their bytes at increasing offsets of the
    post window) and a posted clear, each gathered into the EXECBUFFER of the waited command
    after it; synchronize clean and with the pending error of a posted clear of an unknown
    buffer. DEVICES: device_select before the device functions of device 1, then of device 0,
    sent only when the selection changes."""
    ext = _ext_steps(0)
    x, y = ext["buffer_set_tensor_at.x"], ext["buffer_set_tensor_at.y"]
    for step in (x, y):
        assert (step["function_id"], step["sent_with"]) == (0x8000010A, "graph_compute_keep.add")
        assert "reply" not in step  # posted
        command = bytes.fromhex(step["command"]["hex"])
        assert int.from_bytes(command[8:12], "little") == len(command) == 12 + 8 + 304 + 4 + 24
    window = x["shmem_in"]["res"]
    assert window == y["shmem_in"]["res"] == "blob.buffer_set_tensor_at.x"
    assert json.loads(EXT_FILE.read_text())["sessions"][0]["resources"][window]["size"] == 4 << 20
    assert (x["shmem_in"].get("offset"), y["shmem_in"]["offset"]) == (None, 48)  # 48 bytes, 16-aligned
    assert vectors.field_value(y["command"]["fields"], "shmem_offset") == 48
    clear, sync = ext["buffer_clear.a"], ext["synchronize"]
    assert (clear["function_id"], clear["sent_with"]) == (0x80000014, "synchronize")
    assert ext["buffer_set_tensor_at.x_after_clear"]["sent_with"] == "synchronize"
    assert (sync["function_id"], len(bytes.fromhex(sync["command"]["hex"]))) == (0x104, 12)
    assert [f[4] for f in sync["reply"]["fields"]] == [2, 0, 0, 0]  # posted 2, nothing failed
    assert ext["buffer_get_tensor.s_cleared"]["shmem_out"]["hex"] == "11" * 48
    assert ext["buffer_get_tensor.x_after_clear"]["shmem_out"]["hex"] == \
        ext["buffer_set_tensor_at.x_after_clear"]["shmem_in"]["hex"]
    failed = ext["error.synchronize.pending_error"]
    assert ext["error.buffer_clear.posted_unknown_buffer"]["sent_with"] == failed["name"]
    assert [f[4] for f in failed["reply"]["fields"]] == [1, 0, 20, 5]  # the clear, answered 5
    devices = list(_ext_steps(2).values())
    query = devices[2]
    assert [f[4] for f in query["reply"]["fields"]] == [15, 2]
    order = [(s["name"], s["function"]) for s in devices[3:11]]
    assert [f for _, f in order] == ["device_select", "device_get_name", "device_get_buffer_type",
                                     "buffer_type_alloc_buffer"] * 2
    assert [vectors.field_value(s["command"]["fields"], "device") for s in devices
            if s.get("function") == "device_select"] == [1, 0]
    bufts = [vectors.field_value(s["reply"]["fields"], "buft") for s in devices
             if s.get("function") == "device_get_buffer_type"]
    assert len(set(bufts)) == 2


def test_extension_vectors_cover_events():
    """ASYNC's events as the C guest's apir_event_* send them, each waited for: event_new (no
    arguments) answered a handle, then record, wait, synchronize and free naming it; a record of
    the freed event refused (5)."""
    ext = _ext_steps(0)
    names = list(ext)
    life = ["event_new", "event_record", "event_wait", "event_synchronize", "event_free"]
    at = names.index("event_new")
    assert names[at: at + 6] == life + ["error.event_record.freed_event"]
    new = ext["event_new"]
    assert (new["function_id"], new["command"]["hex"][:16]) == (0x105, "0200000005010000")
    assert len(bytes.fromhex(new["command"]["hex"])) == 12 and "sent_with" not in new
    assert [f[2:4] for f in new["reply"]["fields"]] == [["event", "apir_encode_uint64_t"]]
    handle = vectors.field_value(new["reply"]["fields"], "event")
    assert handle and new["reply"]["return_code"] == 4
    for function_id, name in enumerate(life[1:], 0x106):
        step = ext[name]
        command = bytes.fromhex(step["command"]["hex"])
        assert (step["function_id"], len(command), step["reply"]["return_code"]) == (function_id, 20, 4)
        assert int.from_bytes(command[12:], "little") == handle and step["reply"]["hex"] == ""
        assert step["command"]["fields"][3][5] == "ref:event_new.event"  # the handle event_new answered
    freed = ext["error.event_record.freed_event"]
    assert freed["command"]["hex"] == ext["event_record"]["command"]["hex"]
    assert freed["reply"]["return_code"] == 5


def test_apir_host_passes_the_extension_vectors():
    results = host.check_host(host.EmbeddedTarget(), [vectors.load(EXT_FILE)])
    assert _failures(results) == []
    assert (len(results), sum(r.skipped for r in results)) == (63, 0)


def test_apir_guest_encoder_passes_the_extension_vectors():
    results = guest.check_guest([vectors.load(EXT_FILE)])
    assert _failures(results) == []
    assert [r.step for r in results if r.skipped] == ["forget.ext_query.none", "forget.ext_query.again",
                                                      "error.buffer_clear.posted_unknown_buffer",
                                                      "error.synchronize.pending_error",
                                                      "error.event_record.freed_event"]
    assert sum(not r.skipped for r in results) == 58


def test_fallback_session_needs_its_host_config(tmp_path):
    """Without the session's host_config (extensions off) apir's host agrees on graph replay:
    the runner reports the fallback's ext_query; a socket host, which the runner cannot
    configure, skips that session; the C host library skips the extension session."""

    def mutate(doc):
        del doc["sessions"][1]["host_config"]

    fails = _failures(host.check_host(host.EmbeddedTarget(), [_load(EXT_FILE, mutate, tmp_path)]))
    assert fails[0] == ("ext_query", "return code 4, expected 10 (APIR_FORWARD_BASE_INDEX + "
                                     "APIR_BACKEND_FORWARD_INDEX_INVALID (6))")
    vf = vectors.load(EXT_FILE)
    assert host.SocketTarget("unused").skip_reason(vf, vf.sessions[0]) is None
    assert "apir.host.extensions" in host.SocketTarget("unused").skip_reason(vf, vf.sessions[1])
    assert "apir.host.backend" in host.SocketTarget("unused").skip_reason(vf, vf.sessions[2])
    c_library = host.EmbeddedTarget({"apir.load_library.path": "libggml-virtgpu-backend.so"})
    assert "no extensions" in c_library.skip_reason(vf, vf.sessions[0])
    assert "no extensions" in c_library.skip_reason(vf, vf.sessions[2])
    assert c_library.skip_reason(vf, vf.sessions[1]) is None


def test_guest_check_reports_posted_difference(tmp_path):
    """A posted set's command and its bytes in the post window are the client's, checked
    when the EXECBUFFER of the command they were sent with comes."""

    def window(doc):  # the bytes elsewhere in the window than the client put them
        _step(doc, "buffer_set_tensor_at.y")["shmem_in"]["offset"] = 64

    fails = _failures(guest.check_guest([_load(EXT_FILE, window, tmp_path)]))
    assert fails[0] == ("buffer_set_tensor_at.y", "shared memory in: shared memory in differs")

    def offset(doc):
        field = next(f for f in _step(doc, "buffer_set_tensor_at.y")["command"]["fields"] if f[2] == "shmem_offset")
        field[4] = 64

    fails = _failures(guest.check_guest([_load(EXT_FILE, offset, tmp_path)]))
    assert fails[0] == ("buffer_set_tensor_at.y", "command shmem_offset: 48, expected 64")

    def waited(doc):  # a vector whose set was not posted: the client's posted set is reported
        del _step(doc, "buffer_set_tensor_at.x")["sent_with"]

    fails = _failures(guest.check_guest([_load(EXT_FILE, waited, tmp_path)]))
    assert fails[0] == ("buffer_set_tensor_at.x", "the client sent 0 commands, expected 1")


def test_host_check_reports_posted_difference(tmp_path):
    """A posted clear of another value shows in the bytes read after it; a synchronize reply
    counting another number of posts is reported."""

    def clear(doc):
        step = _step(doc, "buffer_clear.a")
        step["command"]["hex"] = step["command"]["hex"][:-8] + "22000000"

    fails = _failures(host.check_host(host.EmbeddedTarget(), [_load(EXT_FILE, clear, tmp_path)]))
    assert [f[0] for f in fails] == ["buffer_get_tensor.s_cleared"]
    assert fails[0][1] == "shared memory out: byte 0 is 0x22, expected 0x11"

    def posted(doc):
        _step(doc, "synchronize")["reply"]["fields"][0][4] = 3

    fails = _failures(host.check_host(host.EmbeddedTarget(), [_load(EXT_FILE, posted, tmp_path)]))
    assert fails == [("buffer_clear.a", "sent with synchronize: reply posted: 2, expected 3"),
                     ("buffer_set_tensor_at.x_after_clear", "sent with synchronize: reply posted: 2, expected 3"),
                     ("synchronize", "reply posted: 2, expected 3")]


def test_guest_check_reports_graph_id_of_another_graph(tmp_path):
    """guest-id: a vector whose second graph carries the first one's id: apir's guest, which
    gives the new graph a new id, is reported."""

    def mutate(doc):
        add = _step(doc, "graph_compute_keep.add")
        mul = next(f for f in _step(doc, "graph_compute_keep.mul")["command"]["fields"] if f[2] == "graph_id")
        mul[4] = next(f for f in add["command"]["fields"] if f[2] == "graph_id")[4]

    fails = _failures(guest.check_guest([_load(EXT_FILE, mutate, tmp_path)]))
    assert fails[0] == ("graph_compute_keep.mul", "command graph_id: 0x2, expected 0x1 (the id sent for the "
                                                  "vector's 0x1 before)")


def test_compare_guest_id_rule():
    ctx = vectors.Context()
    field = [[0, 8, "graph_id", "u64", 7, "guest-id"]]
    other = [[0, 8, "graph_id", "u64", 8, "guest-id"]]
    pack = lambda v: v.to_bytes(8, "little")  # noqa: E731
    assert vectors.compare(field, pack(1), ctx) is None
    assert vectors.compare(field, pack(1), ctx) is None  # the same graph, the same id
    assert "expected 0x1" in vectors.compare(field, pack(2), ctx)
    assert "another vector value" in vectors.compare(other, pack(1), ctx)
    assert vectors.compare(other, pack(2), ctx) is None
    assert "non-zero" in vectors.compare(other, pack(0), ctx)


@pytest.mark.llama
@pytest.mark.interop
def test_committed_extension_vectors_match_a_fresh_capture(tmp_path):
    """make-conformance-vectors.py --version ext (the extended C guest, built by
    scripts/get-llama-cpp.sh extensions) still produces the committed extension vectors."""
    from tests import prereq
    from tests.llama import build as llama_build

    if not llama_build.is_built() and not prereq.required():
        prereq.missing("llama.cpp is not built: run `python -m tests.llama.build` (about 25 minutes)")
    assert _comparable(_fresh_capture("ext", tmp_path)) == _comparable(json.loads(EXT_FILE.read_text()))
