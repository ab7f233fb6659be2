"""apir as a user installs it: `pip wheel .`, the wheel installed in a fresh virtual environment,
and the CLI tests run there against the installed package, outside the clone.

The fresh environment borrows the running one's dependencies (numpy, numba, libggml-python,
tokenizers, pytest: the folders on its sys.path) through a .pth file, so nothing is downloaded; apir itself comes from the
wheel alone (the test checks where `import apir` finds it)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests import prereq

REPO = Path(__file__).resolve().parents[1]


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)


def test_a_wheel_passes_the_cli_tests_in_a_fresh_venv(tmp_path):
    built = _run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(tmp_path / "dist")])
    if built.returncode != 0:  # (pip fetches setuptools for the build: no network, no wheel)
        prereq.missing(f"pip wheel failed: {built.stderr[-500:]}")
    wheels = list((tmp_path / "dist").glob("apir-*.whl"))
    assert len(wheels) == 1, wheels

    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    python = str(venv / "bin" / "python")
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    # every folder this process imports from but the clone (an editable install puts it there)
    deps = [p for p in sys.path if p and os.path.isdir(p) and Path(p).resolve() != REPO]
    Path(site, "apir-test-deps.pth").write_text("\n".join(deps) + "\n")
    # --ignore-installed: the borrowed site-packages may hold apir too (tox installs it there),
    # which pip would otherwise take for this one and install nothing
    installed = _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
                      str(wheels[0])])  # fmt: skip
    assert installed.returncode == 0, installed.stderr

    work = tmp_path / "work"  # outside the clone: nothing there to import apir from
    shutil.copytree(REPO / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    where = _run([python, "-c", "import apir; print(apir.__file__)"], cwd=work)
    assert where.stdout.strip().startswith(site), where.stdout + where.stderr

    tests = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/local/test_cli.py"], cwd=work)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout
    conformance = _run([str(venv / "bin" / "apir"), "conformance", "--guest-only"], cwd=work)
    assert conformance.returncode == 0, conformance.stdout + conformance.stderr
    assert "0 failed" in conformance.stdout
