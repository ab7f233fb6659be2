"""The conformance vectors (apir/conformance/data/*.json, captured from ggml's C guest and C host
library) against apir's host, apir's guest encoder and the C host library; and the runner's
rules, which must catch a difference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apir.conformance import guest, host, vectors
from apir.conformance.cli import format_report

FILES = sorted(vectors.default_vector_dir().glob("*.json"))
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
    assert {f.stem for f in FILES} == {"apir-0.1-ggml-0.10.1", "apir-0.2-ggml-0.20.2"}
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
        results = host.check_host(host.SocketTarget(server.path), [vectors.load(FILES[0])])
    assert _failures(results) == []


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
    results = [host.StepResult("f.json", "s", "a", True), host.StepResult("f.json", "s", "b", False, "x: 1, expected 2"),
               host.StepResult("f.json", "s", "c", True, "not a guest command", True)]
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
    assert "guest: apir's encoder: 92 passed, 0 failed, 22 skipped" in run.stdout


# --- the C host library, and the vectors against a fresh capture ---------------------------------
@pytest.mark.cref
@pytest.mark.interop
@pytest.mark.parametrize("version", ["0.20", "0.10"])
def test_c_host_library_passes(version):
    from tests import cref
    from tests.interop.harness import c_build_env

    paths = cref.build(version)
    path = next(f for f in FILES if f"ggml-{version}" in f.name)
    run = subprocess.run([sys.executable, "-m", "apir", "conformance", "--host-only", "--vectors", str(path),
                          "--backend-library", paths["LIBGGML_VIRTGPU_BACKEND"],
                          "--ggml-library", paths["LIBGGML_CPU"], "--ggml-reg", "ggml_backend_cpu_reg"],
                         env=c_build_env(paths), check=False, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert ": 57 passed, 0 failed, 0 skipped" in run.stdout


@pytest.mark.cref
@pytest.mark.interop
@pytest.mark.parametrize("version", ["0.20", "0.10"])
def test_committed_vectors_match_a_fresh_capture(version, tmp_path):
    """scripts/make-conformance-vectors.py still produces the committed vectors: same steps,
    same fields and the same values wherever the rules compare values."""
    run = subprocess.run([sys.executable, "scripts/make-conformance-vectors.py", "--version", version,
                          "--out", str(tmp_path)], check=False, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    fresh = json.loads(next(tmp_path.glob("*.json")).read_text())
    committed = json.loads(next(f for f in FILES if f"ggml-{version}" in f.name).read_text())

    def field(f):
        # a field's position, size, name and helper, with its value or its rule; an any-string
        # (the device description: the CPU's model name) without its size, which is the
        # string's length on the machine that captured it
        if len(f) > 5 and f[5] == "any-string":
            return [f[0], None, f[2], f[3], f[5]]
        return f[:4] + ([f[4]] if len(f) == 5 else [f[5]])

    def comparable(doc):
        out = []
        for sess in doc["sessions"]:
            for st in sess["steps"]:
                parts = [st["command"]["fields"], st["reply"]["fields"], st.get("shmem_in", {}).get("fields", [])]
                for fields in parts:
                    out.append([field(f) for f in fields])
                out.append((st["name"], st["reply"]["return_code"], st.get("shmem_out", {}).get("hex")))
        return out

    assert comparable(fresh) == comparable(committed)
