"""apir.guest.backend.callbacks: a Python failure never crosses into C, it is recorded for
the calling thread and raised by apir's entry points; CFUNCTYPE objects stay alive."""

import ctypes
import gc
import threading

import pytest

from apir.guest.backend.callbacks import (BackendCallbackError, CallbackTable, clear_errors, raise_errors,
                                          take_errors)

PROTO = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)


class Iface(ctypes.Structure):
    _fields_ = [("first", PROTO), ("second", PROTO)]


def test_exception_becomes_the_error_value_and_is_recorded():
    table = CallbackTable()

    def boom(p):
        raise KeyError("no such buffer")

    fn = table.function(PROTO, "buffer.get_base", boom, 7)
    clear_errors()
    assert fn(0x10) == 7  # called through the C thunk, as ggml would
    (name, exc), = take_errors()
    assert name == "buffer.get_base" and isinstance(exc, KeyError)
    assert take_errors() == []


def test_raise_errors_chains_the_first_failure():
    table = CallbackTable()
    fn = table.function(PROTO, "x.y", lambda p: 1 // 0, 0)
    clear_errors()
    fn(None)
    fn(None)
    with pytest.raises(BackendCallbackError, match="ggml_call: 2 backend callback") as ei:
        raise_errors("ggml_call")
    assert isinstance(ei.value.__cause__, ZeroDivisionError) and len(ei.value.errors) == 2
    raise_errors("nothing pending")  # no error: returns


def test_errors_are_per_thread():
    table = CallbackTable()
    fn = table.function(PROTO, "t", lambda p: 1 // 0, 0)
    clear_errors()
    th = threading.Thread(target=fn, args=(None,))
    th.start()
    th.join()
    assert take_errors() == []


def test_iface_sets_named_fields_and_keeps_them_alive():
    table = CallbackTable()
    protos = {"first": PROTO, "second": PROTO}
    inst = table.iface(Iface, protos, {"first": (lambda p: (p or 0) + 1, 0)}, "demo")
    gc.collect()
    assert inst.first(41) == 42
    assert not inst.second  # unset: NULL, optional in ggml
    with pytest.raises(ValueError, match="third"):
        table.iface(Iface, protos, {"third": (lambda p: 0, 0)}, "demo")
    addr = table.cstring("ggml-virtgpu")
    gc.collect()
    assert ctypes.string_at(addr) == b"ggml-virtgpu"
