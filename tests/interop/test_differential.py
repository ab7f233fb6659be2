"""The C dispatcher and apir's Python dispatcher answer the same command bytes alike, over all
23 backend functions (tests/interop/differential.py, run on the C build's ggml)."""

import json
import subprocess
import sys

import numpy as np

from apir.codec.constants import ApirBackendCommandType
from tests.interop.differential import apir_version_of
from tests.interop.harness import REPO, c_build_env


def run_differential(paths) -> dict:
    env_file = f"{paths['GGML_BUILD']}/paths.env"
    run = subprocess.run([sys.executable, "-m", "tests.interop.differential", env_file], env=c_build_env(paths),
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_replies_agree_field_by_field(cref_paths):
    result = run_differential(cref_paths)
    assert tuple(result["apir_version"]) == apir_version_of(cref_paths)
    bad = [f"{c['name']}: {c['detail']}" for c in result["checks"] if not c["ok"]]
    assert not bad, "\n".join(bad)
    covered = {c["function"] for c in result["checks"]}
    assert covered >= {int(f) for f in ApirBackendCommandType}, "every backend function is exercised"
    by_name = {c["name"]: c for c in result["checks"]}
    # device_get_props: 4 booleans for an APIR 0.1 guest, 5 for 0.2
    props = by_name["device_get_props"]["detail"]
    assert props.count("True") + props.count("False") == (4 if result["apir_version"] == [0, 1] else 5)
    # the graph both hosts computed is really mul_mat(a, b) + c
    K, M, N = 16, 4, 3
    a = ((np.arange(K * M) % 7 - 3) / 4).reshape(M, K)
    b = ((np.arange(K * N) % 5 - 2) / 2).reshape(N, K)
    c = (np.arange(M * N) / 8).reshape(N, M)
    out = np.frombuffer(bytes.fromhex(by_name["buffer_get_tensor(out)"]["shmem_hex"]), np.float32)
    np.testing.assert_array_equal(out, (b @ a.T + c).reshape(-1))
    cleared = bytes.fromhex(by_name["buffer_get_tensor(a) after clear"]["shmem_hex"])
    assert cleared == b"\x5a" * (K * M * 4)
