"""Where Numba keeps apir's compiled kernels: one on-disk cache per machine.

Theory of operation: Numba's `cache=True` finds a cache folder through its list of cache
locators; its default puts the cache in `__pycache__` next to the source file (or, when that
is read-only, in a folder named after the source's path), so every checkout, installed copy
and tox environment compiled the kernels again.
`ApirCacheLocator`, put first in that list by `install()`, keeps the kernels of apir's own
source files in `<apir cache>/numba/<module>-<sha256 of the source>` instead, where
`<apir cache>` is `$APIR_CACHE_DIR`, else `$XDG_CACHE_HOME/apir`, else `~/.cache/apir` (the
folders tests/cref.py uses): every process of this machine (tests, the CLI, the benchmarks,
any checkout) that runs the same kernel source loads the same compiled code, and a changed
source gets a folder of its own. Numba still checks, per entry, the Python and Numba versions,
the CPU and the source's hash, so a stale entry is never loaded.

`NUMBA_CACHE_DIR` set (Numba's own setting) wins: the locator then steps aside. A cache
folder that cannot be created or written also makes it step aside (Numba's defaults apply).
`announce_first_compile` lets the `apir` command say so when a cold cache makes it compile.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from numba.core import caching, config, event

__all__ = ["ApirCacheLocator", "cache_root", "install", "announce_first_compile"]

_PACKAGE_DIR = str(Path(__file__).resolve().parent) + os.sep
# The codec's primitives, which kernels of other modules compile in: Numba's index checks only
# the kernel's own file, so its cache key covers this file's source too.
_PRIMITIVES = os.path.join(_PACKAGE_DIR, "codec", "_kernels.py")


def cache_root() -> Path:
    """`<apir cache>/numba`: $APIR_CACHE_DIR, else $XDG_CACHE_HOME/apir, else ~/.cache/apir."""
    base = os.environ.get("APIR_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = os.path.join(xdg, "apir") if xdg else os.path.join(os.path.expanduser("~"), ".cache", "apir")
    return Path(base) / "numba"


class ApirCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """Numba cache locator for functions defined in apir's source files (see the module)."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        sha = hashlib.sha256()
        for path in dict.fromkeys((str(Path(py_file).resolve()), _PRIMITIVES)):
            with open(path, "rb") as f:
                sha.update(f.read())
        digest = sha.hexdigest()[:24]
        self._cache_path = str(cache_root() / f"{Path(py_file).stem}-{digest}")

    def get_cache_path(self):
        return self._cache_path

    @classmethod
    def from_function(cls, py_func, py_file):
        if getattr(config, "CACHE_DIR", "") or not os.path.abspath(py_file).startswith(_PACKAGE_DIR):
            return None
        return super().from_function(py_func, py_file)


def install() -> None:
    """Puts `ApirCacheLocator` first in Numba's locator list (idempotent). Call before the
    first `cache=True` decoration: Numba picks a function's locator when it is decorated."""
    classes = caching.CacheImpl._locator_classes
    if ApirCacheLocator not in classes:
        classes.insert(0, ApirCacheLocator)


def announce_first_compile(notice: Callable[[], None]) -> None:
    """Calls `notice()` once, as the first of apir's kernels starts compiling: Numba found no
    compiled code for it in the cache (a loaded one raises no compile event)."""

    class FirstCompile(event.Listener):
        told = False

        def on_start(self, ev) -> None:
            py_func = getattr(ev.data.get("dispatcher"), "py_func", None)
            path = getattr(getattr(py_func, "__code__", None), "co_filename", "")
            if not self.told and os.path.abspath(path).startswith(_PACKAGE_DIR):
                self.told = True
                notice()

        def on_end(self, ev) -> None:
            pass

    event.register("numba:compile", FirstCompile())
