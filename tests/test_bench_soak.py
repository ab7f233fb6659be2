"""benchmarks/soak.py, the 2-minute version CI runs: one host process serving llama.cpp,
MiniLM and killed guests through its socket and VMs through its vhost-user device as they
come and go, back where it started once they left (descriptors,
threads, contexts, blobs; RSS within the soak's slack), and no guest failed. The hour-long run's
figures are in docs/security.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import prereq
from tests.llama import build as llama_build

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.llama
@pytest.mark.vm
def test_a_two_minute_soak_leaves_the_host_flat():
    from apir.vm.provision import NotProvisioned, find

    if not llama_build.is_built():
        prereq.missing("llama.cpp is not built: run `scripts/get-llama-cpp.sh cpu`")
    try:
        find()
    except NotProvisioned as exc:
        prereq.missing(str(exc))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--minutes", "2", "--sample-s", "2", "--vm", "--json"],
        env=env, capture_output=True, text=True, timeout=1200,
    )
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["guest_failures"] == [], report["guest_failures"][:3]
    assert set(report["guest_runs"]) == {"llama", "minilm", "killed", "vm"}, report["guest_runs"]
    assert all(n >= 1 for n in report["guest_runs"].values()), report["guest_runs"]
    start, end = report["start"], report["end"]
    for key in ("fds", "threads", "contexts", "blobs", "blob_bytes"):
        assert end[key] <= start[key], (key, start, end)
    assert end["contexts"] == 0 and end["blobs"] == 0
    assert report["flat"] and run.returncode == 0, run.stderr[-2000:]
