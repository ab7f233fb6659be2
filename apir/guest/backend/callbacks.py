"""Python functions that C calls: kept alive, and never letting an exception reach C.

Theory of operation: ggml calls our backend through function pointers in iface structs. A
CFUNCTYPE object must outlive every C pointer to it, so each `ApirBackend` owns one
`CallbackTable` holding every CFUNCTYPE object and every C string it handed out; the table
is only dropped when no C object can still reach it (see `ApirBackend.close`).

An exception must not unwind through C frames, and most of ggml's callbacks return void.
Where the C guest would GGML_ABORT (a failed remote call), each callback instead logs the
exception, records it for the calling thread and returns a safe value (NULL, 0, false,
GGML_STATUS_FAILED). apir's own entry points (`tensor_set`, `tensor_get`,
`ApirBackend.graph_compute`) clear the record before calling ggml and raise
`BackendCallbackError` after, so a failure surfaces as a Python exception in the caller.
Code calling ggml directly can do the same with `take_errors()` / `raise_errors()`.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Callable, Dict, List

from apir.errors import ApirError

__all__ = ["BackendCallbackError", "CallbackTable", "take_errors", "raise_errors", "clear_errors", "record_error"]

log = logging.getLogger(__name__)

_pending = threading.local()


class BackendCallbackError(ApirError, RuntimeError):
    """A backend callback failed inside a ggml call; `errors` lists (callback name,
    exception) in order and `__cause__` is the first exception."""

    def __init__(self, what: str, errors: List[tuple]):
        names = ", ".join(f"{n}: {type(e).__name__}: {e}" for n, e in errors)
        super().__init__(f"{what}: {len(errors)} backend callback(s) failed ({names})")
        self.errors = errors


def record_error(name: str, exc: BaseException) -> None:
    """Record a failure for the calling thread (for callbacks that recover by themselves)."""
    log.error("ggml backend callback %s failed: %s: %s", name, type(exc).__name__, exc)
    _record(name, exc)


def _record(name: str, exc: BaseException) -> None:
    errs = getattr(_pending, "errors", None)
    if errs is None:
        errs = _pending.errors = []
    errs.append((name, exc))


def clear_errors() -> None:
    """Forget the calling thread's recorded callback failures."""
    _pending.errors = []


def take_errors() -> List[tuple]:
    """The calling thread's recorded callback failures [(callback name, exception)], cleared."""
    errs = getattr(_pending, "errors", None) or []
    _pending.errors = []
    return errs


def raise_errors(what: str) -> None:
    """Raise BackendCallbackError if a callback failed on this thread since the last clear."""
    errs = take_errors()
    if errs:
        raise BackendCallbackError(what, errs) from errs[0][1]


class CallbackTable:
    """Strong references to one backend's CFUNCTYPE objects and C strings."""

    def __init__(self):
        self._objects: List[object] = []
        self._lock = threading.Lock()

    def _keep(self, obj):
        with self._lock:
            self._objects.append(obj)
        return obj

    def function(self, proto, name: str, fn: Callable, on_error):
        """A `proto` CFUNCTYPE object calling `fn`; an exception in `fn` is logged, recorded
        for the thread, and C gets `on_error` (None for void)."""

        def guarded(*args):
            try:
                return fn(*args)
            except BaseException as exc:  # noqa: BLE001 - nothing may unwind into C
                try:
                    log.error(
                        "ggml backend callback %s failed: %s: %s",
                        name,
                        type(exc).__name__,
                        exc,
                        exc_info=not isinstance(exc, (KeyboardInterrupt, SystemExit)),
                    )
                    _record(name, exc)
                except BaseException:  # noqa: BLE001 - logging itself failed; still return to C
                    pass
                return on_error

        return self._keep(proto(guarded))

    def iface(self, cls, protos: Dict[str, object], impls: Dict[str, tuple], prefix: str):
        """An instance of iface struct `cls` with the fields named in `impls`
        ({field: (fn, on_error)}) set; the others stay NULL (optional in ggml)."""
        unknown = set(impls) - set(protos)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        inst = cls()
        for field, (fn, on_error) in impls.items():
            setattr(inst, field, self.function(protos[field], f"{prefix}.{field}", fn, on_error))
        return self._keep(inst)

    def cstring(self, text: str) -> int:
        """Address of a NUL-terminated UTF-8 copy of `text`, valid while the table lives."""
        buf = self._keep(ctypes.create_string_buffer(text.encode()))
        return ctypes.addressof(buf)

    def keep(self, obj):
        """Keep any object (a struct C points to) alive with the table; returns it."""
        return self._keep(obj)

    def __len__(self) -> int:
        return len(self._objects)
