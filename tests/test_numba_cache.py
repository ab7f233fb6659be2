"""apir.numba_cache: kernels compile into one cache per machine, keyed by their source."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import apir.codec._kernels as K
from apir.numba_cache import ApirCacheLocator, cache_root

_RUN = "import numpy as np; from apir.codec import _kernels as K; a = np.arange(8, dtype=np.uint8); " \
       "K.memmove_kernel(a.ctypes.data + 1, a.ctypes.data, 4); print(a.tolist())"


def _run(env):
    root = str(Path(__file__).resolve().parents[1])
    full = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    full.update(env, PYTHONPATH=root)
    return subprocess.run([sys.executable, "-c", _RUN], env=full, capture_output=True, text=True, timeout=300)


def test_cache_root_follows_apir_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("APIR_CACHE_DIR", str(tmp_path / "a"))
    assert cache_root() == tmp_path / "a" / "numba"
    monkeypatch.delenv("APIR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x" / "apir" / "numba"


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    source = Path(K.__file__).read_bytes()
    folder = tmp_path / "numba" / f"_kernels-{hashlib.sha256(source).hexdigest()[:24]}"
    first = _run({"APIR_CACHE_DIR": str(tmp_path)})
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "[0, 0, 1, 2, 3, 5, 6, 7]"
    index = sorted(p.name for p in folder.glob("_kernels.memmove_kernel-*.nbi"))
    assert len(index) == 1
    data = sorted(folder.glob("_kernels.memmove_kernel-*.nbc"))
    assert data
    stamp = [p.stat().st_mtime_ns for p in data]
    second = _run({"APIR_CACHE_DIR": str(tmp_path)})
    assert second.returncode == 0 and second.stdout == first.stdout
    assert [p.stat().st_mtime_ns for p in data] == stamp  # loaded, not compiled and written again


def test_numba_cache_dir_wins(tmp_path):
    r = _run({"APIR_CACHE_DIR": str(tmp_path / "apir"), "NUMBA_CACHE_DIR": str(tmp_path / "numba")})
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "apir" / "numba").exists()
    assert list((tmp_path / "numba").rglob("*.nbi"))


def test_only_apir_sources_use_it(tmp_path):
    def f():
        return 1

    assert ApirCacheLocator.from_function(f, str(tmp_path / "elsewhere.py")) is None


def test_the_apir_command_says_once_that_kernels_compile(tmp_path):
    """A cold cache: one line on stderr while the kernels compile (a first run used to be
    silent for seconds); a warm one: nothing."""
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(APIR_CACHE_DIR=str(tmp_path), PYTHONPATH=root)
    notice = f"apir: compiling kernels on first use (a one-time wait; cached in {tmp_path / 'numba'})"
    runs = [subprocess.run([sys.executable, "-m", "apir", "info"], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert runs[0].stderr.splitlines() == [notice]
    assert runs[1].stderr == ""
