"""Running one hostile input against the host in a child process, so that an input that
would abort the host (a GGML_ASSERT, `std::bad_alloc`, SIGSEGV) fails the test instead of
killing pytest.

`run_child("tests.host.test_x:_child_fn")` runs `_child_fn()` in a fresh Python with this
checkout on its path, its address space limited to `AS_LIMIT` bytes (a huge allocation
then fails at once instead of taking the machine's memory), and warnings of `apir.host`
logged to stderr; it returns the completed process (the caller asserts `returncode == 0`
and reads the refusal from `stderr`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

AS_LIMIT = 2 << 30
_ROOT = Path(__file__).resolve().parents[2]

_PRELUDE = """
import logging, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
import importlib
mod = importlib.import_module({module!r})
getattr(mod, {name!r})()
print("child done")
"""


def run_child(target: str, timeout: float = 300) -> subprocess.CompletedProcess:
    module, name = target.split(":")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    code = _PRELUDE.format(limit=AS_LIMIT, module=module, name=name)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=str(_ROOT), capture_output=True,
                          text=True, timeout=timeout, check=False)


def assert_child_ok(target: str, *expect: str, timeout: float = 300) -> str:
    """Runs `target` in a child; asserts it exited 0 (not killed by a signal) and that each
    string of `expect` is in its log; returns its stderr."""
    proc = run_child(target, timeout)
    assert proc.returncode == 0 and "child done" in proc.stdout, (
        f"child {target} exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    for s in expect:
        assert s in proc.stderr, proc.stderr[-4000:]
    return proc.stderr
