"""apir.ggml.load(): enums and sizes come from the build it loads, checked against it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apir.ggml import GgmlLoadError
from apir.ggml.header import parse_enum

PROBE = """
import json, apir.ggml as G
g = G.load()
print(json.dumps({"version": g.version, "op_count": g.op_count, "type_count": g.type_count,
                  "ops": g.ops, "types": g.types, "tensor_size": g.tensor_dtype.itemsize}))
"""


def _probe(lib_dir, include_dir) -> dict:
    # Another ggml build cannot share a process with the pinned one (same symbol names).
    env = dict(os.environ, APIR_GGML_LIB_DIR=str(lib_dir), APIR_GGML_INCLUDE_DIR=str(include_dir))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_pinned_build(ggml):
    assert ggml.version == "0.20.2"
    assert ggml.op_count == 101 and ggml.ops["NONE"] == 0 and ggml.ops["ADD"] == 2
    assert ggml.type_count == 43 and ggml.types["F32"] == 0 and "Q4_2" not in ggml.types
    assert ggml.tensor_dtype.itemsize == 336
    # ggml's own names agree with the header's for every op.
    assert all(ggml.ggml_op_name(v).decode() == k for k, v in ggml.ops.items())


@pytest.mark.parametrize("version, op_count, type_count", [("0.20", 101, 43), ("0.10", 96, 42)])
def test_other_build_selected_by_path(version, op_count, type_count, request):
    paths = request.getfixturevalue("cref_020" if version == "0.20" else "cref_010")
    facts = _probe(Path(paths["LIBGGML"]).parent, paths["GGML_INCLUDE"])
    assert facts["version"].startswith(version)
    assert (facts["op_count"], facts["type_count"]) == (op_count, type_count)
    assert facts["tensor_size"] == 336


def test_ops_differ_between_builds(cref_010, ggml):
    old = _probe(Path(cref_010["LIBGGML"]).parent, cref_010["GGML_INCLUDE"])["ops"]
    moved = {k for k in old if k in ggml.ops and old[k] != ggml.ops[k]}
    assert moved, "0.10.1 and 0.20.2 op numbering should differ somewhere"


def test_missing_build_is_a_clear_error(tmp_path):
    env = dict(os.environ, APIR_GGML_LIB_DIR=str(tmp_path), APIR_GGML_INCLUDE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", "import apir.ggml as G; G.load()"], env=env,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "GgmlLoadError" in out.stderr and "libggml-base.so: not found" in out.stderr


def test_enum_parser_handles_holes_and_comments():
    text = """enum ggml_type {
        GGML_TYPE_F32 = 0, // first
        /* GGML_TYPE_GONE = 1, */
        GGML_TYPE_Q = 6,
        GGML_TYPE_R,
        GGML_TYPE_COUNT,
    };"""
    assert parse_enum(text, "ggml_type", "GGML_TYPE_") == {"F32": 0, "Q": 6, "R": 7, "COUNT": 8}
    with pytest.raises(GgmlLoadError):
        parse_enum(text, "ggml_op", "GGML_OP_")


def test_ggml_is_complete_and_closed(ggml):
    """Every declared function and fact is there when load() returns; nothing is added later."""
    import dataclasses

    from apir.ggml.functions import SIGNATURES

    names = {f.name for f in dataclasses.fields(ggml)}
    assert set(SIGNATURES) <= names and {"tensor_dtype", "valid_types", "features", "header"} <= names
    assert all(callable(getattr(ggml, n)) for n in SIGNATURES)
    with pytest.raises(AttributeError):
        ggml.apir_graph_plan = None  # nothing can be added after load() (slots)
    # hasattr never raises: an undeclared name is simply not an attribute.
    assert not hasattr(ggml, "ggml_not_declared") and not hasattr(ggml, "_apir_graph_plan")
    assert repr(ggml) == f"Ggml({ggml.version!r}, lib_dir={str(ggml.lib_dir)!r})"  # not ~270 fields


def test_missing_function_is_falsy_and_raises_when_called(ggml):
    from apir.ggml.functions import MissingFunction

    missing = MissingFunction("ggml_gone", ggml.lib_dir)
    assert not missing and ggml.has("ggml_add") and not ggml.has("ggml_not_declared")
    with pytest.raises(GgmlLoadError, match="ggml_gone: not in this ggml build"):
        missing()


def test_header_facts(ggml):
    h = ggml.header
    assert (h.ops, h.types, h.limits) == (ggml.ops, ggml.types, ggml.limits)
    assert h.statuses == {"ALLOC_FAILED": -2, "FAILED": -1, "SUCCESS": 0, "ABORTED": 1}
    assert h.rope_types["NEOX"] == 2 and h.dev_types["CPU"] == 0
    assert h.dev_caps == ("async", "host_buffer", "buffer_from_host_ptr", "events", "mmap_support")
    assert h.glu_ops["COUNT"] == len(h.glu_ops) - 1 and h.unary_ops["COUNT"] == len(h.unary_ops) - 1
