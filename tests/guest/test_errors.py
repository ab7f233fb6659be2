"""apir.guest.errors: every LoadLibrary and Forward return code maps to its own exception."""

import pytest

from apir.codec.constants import (
    ApirBackendInitializeReturnCode as Init, ApirForwardReturnCode as Fwd, ApirLoadLibraryReturnCode as LL,
)
from apir.guest import errors as E


# A backend library's failure comes as INIT_BASE_INDEX + apir_backend_initialize's code, itself
# a LoadLibrary code: one for the ggml library, or INIT_BASE_INDEX + backend_dispatch_initialize's
# (backend.cpp); virtgpu.cpp reads it back so: 20 = 6 + (6 + NO_DEVICE 8).
_INIT = LL.INIT_BASE_INDEX + LL.INIT_BASE_INDEX


@pytest.mark.parametrize("code,cls", [
    (LL.HYPERCALL_INITIALIZATION_ERROR, E.LoadLibraryHypercallError),
    (LL.ALREADY_LOADED, E.LibraryAlreadyLoaded),
    (LL.ENV_VAR_MISSING, E.LoadLibraryConfigMissing),
    (LL.CANNOT_OPEN, E.LoadLibraryCannotOpen),
    (LL.SYMBOL_MISSING, E.LoadLibrarySymbolMissing),
    (LL.INIT_BASE_INDEX + LL.ENV_VAR_MISSING, E.BackendGgmlLibraryError),
    (LL.INIT_BASE_INDEX + LL.CANNOT_OPEN, E.BackendGgmlLibraryError),
    (LL.INIT_BASE_INDEX + LL.SYMBOL_MISSING, E.BackendGgmlLibraryError),
    (_INIT + Init.CANNOT_OPEN_BACKEND_LIBRARY, E.BackendCannotOpenBackendLibrary),
    (_INIT + Init.CANNOT_OPEN_GGML_LIBRARY, E.BackendCannotOpenGgmlLibrary),
    (_INIT + Init.MISSING_BACKEND_SYMBOLS, E.BackendMissingBackendSymbols),
    (_INIT + Init.MISSING_GGML_SYMBOLS, E.BackendMissingGgmlSymbols),
    (_INIT + Init.BACKEND_FAILED, E.BackendFailed),
    (_INIT + Init.BACKEND_REG_FAILED, E.BackendRegFailed),
    (_INIT + Init.ALREADY_INITED, E.BackendAlreadyInited),
    (_INIT + Init.NO_DEVICE, E.BackendNoDevice),
    (_INIT + Init.BACKEND_INIT_FAILED, E.BackendInitFailed),
    (LL.INIT_BASE_INDEX + 0, E.BackendInitializeError),  # "init returned success" is not success
    (_INIT + 0, E.BackendInitializeError),
    (_INIT + 42, E.BackendInitializeError),
])
def test_load_library_codes(code, cls):
    exc = E.load_library_error(code)
    assert type(exc) is cls and isinstance(exc, E.LoadLibraryError) and isinstance(exc, E.ApirError)
    assert exc.code == code
    if issubclass(cls, E.BackendInitializeError):
        assert exc.init_code == code - LL.INIT_BASE_INDEX
        if code >= _INIT:
            assert exc.backend_code == code - _INIT and exc.ggml_load_code is None
        else:
            assert exc.ggml_load_code == code - LL.INIT_BASE_INDEX and exc.backend_code is None
    assert E.load_library_error(LL.SUCCESS) is None


def test_a_backend_without_its_device_reads_as_the_c_guest_reads_it():
    """20: what apir's host (and virglrenderer with the C backend) sends for NO_DEVICE."""
    exc = E.load_library_error(20)
    assert type(exc) is E.BackendNoDevice and exc.backend_code == Init.NO_DEVICE
    assert "NO_DEVICE" in str(exc)


def test_forward_codes():
    assert E.forward_error(Fwd.BASE_INDEX, 2) is None
    for code, cls in ((Fwd.NO_DISPATCH_FCT, E.NoDispatchFunction), (Fwd.TIMEOUT, E.HostForwardTimeout),
                      (Fwd.FAILED_TO_SYNC_STREAMS, E.FailedToSyncStreams), (0, E.ForwardError)):
        exc = E.forward_error(code, 2)
        assert type(exc) is cls and exc.code == code and exc.function == "device_get_name"
    exc = E.forward_error(Fwd.BASE_INDEX + 6, 99)  # APIR_BACKEND_FORWARD_INDEX_INVALID
    assert type(exc) is E.BackendFunctionError and exc.function_code == 6 and "99" in str(exc)


def test_device_errors_name_node_and_capability():
    exc = E.MissingCapability("/dev/dri/renderD128", "context init")
    assert isinstance(exc, E.DeviceError) and "renderD128" in str(exc) and "context init" in str(exc)
    exc = E.IoctlError("/dev/dri/renderD128", "DRM_IOCTL_VIRTGPU_MAP", 12, "Cannot allocate memory")
    assert exc.errno == 12 and "DRM_IOCTL_VIRTGPU_MAP" in str(exc)
