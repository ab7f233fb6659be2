"""apir.codec.constants against the C headers of both protocol versions."""

import subprocess
from pathlib import Path

import pytest

from apir.codec import constants as C

PROGRAM = r"""
#include <cstdio>
#include "api_remoting.h"
#include "apir_backend.h"
#include "apir_hw.h"
int main() {
    printf("PROTOCOL %d %d\n", APIR_PROTOCOL_MAJOR, APIR_PROTOCOL_MINOR);
    printf("MAGIC %d\n", APIR_HANDSHAKE_MAGIC);
    for (int i = 0; i < APIR_COMMAND_TYPE_LENGTH; i++)
        printf("CMD %d %s\n", i, apir_command_name((ApirCommandType) i));
    for (int i = 0; i <= APIR_LOAD_LIBRARY_INIT_BASE_INDEX; i++)
        printf("LOADLIB %d %s\n", i, apir_load_library_error((ApirLoadLibraryReturnCode) i));
    for (int i = 0; i <= APIR_FORWARD_BASE_INDEX; i++)
        printf("FORWARD %d %s\n", i, apir_forward_error((ApirForwardReturnCode) i));
    for (int i = 0; i <= APIR_BACKEND_INITIALIZE_BACKEND_INIT_FAILED; i++)
        printf("INIT %d %s\n", i, apir_backend_initialize_error(i));
    printf("INDEX_INVALID %d\n", APIR_BACKEND_FORWARD_INDEX_INVALID);
    for (int i = 0; i < APIR_BACKEND_DISPATCH_TABLE_COUNT; i++)
        printf("FN %d %s\n", i, apir_dispatch_command_name((ApirBackendCommandType) i));
    printf("CAPSET_SIZE %zu\n", sizeof(struct virgl_renderer_capset_apir));
    return 0;
}
"""


def _run(paths, tmp_path) -> list[list[str]]:
    src = tmp_path / "constants.cpp"
    src.write_text(PROGRAM)
    exe = tmp_path / "constants"
    virtgpu = Path(paths["GGML_SRC"]) / "src" / "ggml-virtgpu"
    subprocess.run(["g++", "-std=c++17", "-w", "-I", paths["GGML_VIRTGPU_SHARED_INCLUDE"],
                    "-I", str(virtgpu / "include"), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [line.split() for line in out.splitlines()]


def _check(rows, expected_minor):
    seen = {kind: {} for kind in ("CMD", "LOADLIB", "FORWARD", "INIT", "FN")}
    for row in rows:
        if row[0] == "PROTOCOL":
            assert (int(row[1]), int(row[2])) == (0, expected_minor)
            assert (0, expected_minor) in C.APIR_PROTOCOL_VERSIONS
        elif row[0] == "MAGIC":
            assert int(row[1]) == C.APIR_HANDSHAKE_MAGIC
        elif row[0] == "INDEX_INVALID":
            assert int(row[1]) == C.APIR_BACKEND_FORWARD_INDEX_INVALID
        elif row[0] == "CAPSET_SIZE":
            assert int(row[1]) == C.CapsetApir.SIZE
        else:
            seen[row[0]][int(row[1])] = row[2]
    assert {v: C.ApirCommandType(v).c_name for v in seen["CMD"]} == seen["CMD"]
    prefixes = {"LOADLIB": ("APIR_LOAD_LIBRARY_", C.ApirLoadLibraryReturnCode),
                "FORWARD": ("APIR_FORWARD_", C.ApirForwardReturnCode),
                "INIT": ("APIR_BACKEND_INITIALIZE_", C.ApirBackendInitializeReturnCode)}
    for kind, (prefix, enum) in prefixes.items():
        assert {v: prefix + enum(v).name for v in seen[kind]} == seen[kind], kind
    assert len(seen["FN"]) == len(C.ApirBackendCommandType)
    assert {v: C.ApirBackendCommandType(v).c_name for v in seen["FN"]} == seen["FN"]


def test_constants_match_apir_0_2(cref_020, tmp_path):
    _check(_run(cref_020, tmp_path), expected_minor=2)


def test_constants_match_apir_0_1(cref_010, tmp_path):
    _check(_run(cref_010, tmp_path), expected_minor=1)


@pytest.mark.parametrize("blob", [False, True])
def test_capset_round_trip(blob):
    packed = C.CapsetApir(2, blob).pack()
    assert len(packed) == 24
    back = C.CapsetApir.unpack(packed)
    assert (back.apir_version, back.supports_blob_resources) == (2, blob)
    with pytest.raises(ValueError):
        C.CapsetApir.unpack(packed[:20])
