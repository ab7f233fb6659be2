"""The host's shape rules on ggml 0.25: the whole of tests/host/shapes (the cases
of what 0.25 added, skipped elsewhere for want of their apir.ggml.features Feature, and the
coverage check test_checked_ops.py) runs in a pytest of its own with apir's ggml pointed at the
llama.cpp build (APIR_GGML_LIB_DIR / APIR_GGML_INCLUDE_DIR; one ggml per process), and must
pass there, none of 0.25's cases skipped for want of a feature or constructor."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.cref import REPO

FILES = ["tests/host/shapes"]


def test_host_rules_on_ggml_025(llama_paths):
    env = dict(os.environ, APIR_GGML_LIB_DIR=llama_paths["GGML_LIB_DIR"],
               APIR_GGML_INCLUDE_DIR=llama_paths["GGML_INCLUDE"], PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *FILES], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 690, summary  # 690 passed on 0.25.3 (42 of them the cases of what 0.25 added)
    # the 0.25 cases ran (none skipped for want of a Feature or of a constructor), and so did
    # the coverage check, which skips in a run that is not complete
    assert " lacks " not in run.stdout and "is not in this ggml build" not in run.stdout, run.stdout[-4000:]
    assert "needs a run of the whole of tests/host/shapes" not in run.stdout, run.stdout[-4000:]
