"""The host's shape rules on ggml 0.25 (issue 14): tests/host's tests of what 0.25 added
(test_shapes_ggml025.py) run in a
pytest of their own with apir's ggml pointed at the llama.cpp build (APIR_GGML_LIB_DIR /
APIR_GGML_INCLUDE_DIR; one ggml per process), and must pass there, none skipped for want of
the build."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.cref import REPO

FILES = ["tests/host/test_shapes_ggml025.py"]


def test_host_rules_on_ggml_025(llama_paths):
    env = dict(os.environ, APIR_GGML_LIB_DIR=llama_paths["GGML_LIB_DIR"],
               APIR_GGML_INCLUDE_DIR=llama_paths["GGML_INCLUDE"], PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *FILES], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 42, summary  # test_shapes_ggml025.py alone has 42
    # the 0.25 rules' own tests ran (none skipped as "for ggml >= 0.25")
    assert "ggml >= 0.25" not in run.stdout
