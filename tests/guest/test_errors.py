"""apir.guest.errors: every LoadLibrary and Forward return code maps to its own exception."""

import pytest

from apir.codec.constants import (
    ApirBackendInitializeReturnCode as Init, ApirForwardReturnCode as Fwd, ApirLoadLibraryReturnCode as LL,
)
from apir.guest import errors as E


@pytest.mark.parametrize("code,cls", [
    (LL.HYPERCALL_INITIALIZATION_ERROR, E.LoadLibraryHypercallError),
    (LL.ALREADY_LOADED, E.LibraryAlreadyLoaded),
    (LL.ENV_VAR_MISSING, E.LoadLibraryConfigMissing),
    (LL.CANNOT_OPEN, E.LoadLibraryCannotOpen),
    (LL.SYMBOL_MISSING, E.LoadLibrarySymbolMissing),
    (LL.INIT_BASE_INDEX + Init.CANNOT_OPEN_BACKEND_LIBRARY, E.BackendCannotOpenBackendLibrary),
    (LL.INIT_BASE_INDEX + Init.CANNOT_OPEN_GGML_LIBRARY, E.BackendCannotOpenGgmlLibrary),
    (LL.INIT_BASE_INDEX + Init.MISSING_BACKEND_SYMBOLS, E.BackendMissingBackendSymbols),
    (LL.INIT_BASE_INDEX + Init.MISSING_GGML_SYMBOLS, E.BackendMissingGgmlSymbols),
    (LL.INIT_BASE_INDEX + Init.BACKEND_FAILED, E.BackendFailed),
    (LL.INIT_BASE_INDEX + Init.BACKEND_REG_FAILED, E.BackendRegFailed),
    (LL.INIT_BASE_INDEX + Init.ALREADY_INITED, E.BackendAlreadyInited),
    (LL.INIT_BASE_INDEX + Init.NO_DEVICE, E.BackendNoDevice),
    (LL.INIT_BASE_INDEX + Init.BACKEND_INIT_FAILED, E.BackendInitFailed),
    (LL.INIT_BASE_INDEX + 0, E.BackendInitializeError),  # "init returned success" is not success
    (LL.INIT_BASE_INDEX + 42, E.BackendInitializeError),
])
def test_load_library_codes(code, cls):
    exc = E.load_library_error(code)
    assert type(exc) is cls and isinstance(exc, E.LoadLibraryError) and isinstance(exc, E.ApirError)
    assert exc.code == code
    if issubclass(cls, E.BackendInitializeError):
        assert exc.init_code == code - LL.INIT_BASE_INDEX
    assert E.load_library_error(LL.SUCCESS) is None


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
