"""One error root: every public exception class apir defines derives from `apir.errors.ApirError`
(docs/design.md, "Errors"), so a caller can catch everything apir raises with one clause, while
each class keeps the standard base it had (ValueError, RuntimeError), so code catching those
keeps working."""

import importlib
import inspect
import pkgutil

import pytest

import apir
from apir.errors import ApirError


def _public_errors() -> dict:
    """Every exception class defined (not imported) in an apir module, without a leading
    underscore, by its qualified name."""
    found = {}
    for info in pkgutil.walk_packages(apir.__path__, "apir."):
        if info.name == "apir.__main__":  # runs the CLI when imported
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_every_public_error_derives_from_apir_error():
    errors = _public_errors()
    # the discovery sees the errors of both halves, the codec and the guest backend
    for name in ("apir.local.wire.WireError", "apir.guest.errors.DeviceError", "apir.host.errors.Refused",
                 "apir.guest.backend.apir_backend.GraphComputeError", "apir.ggml.errors.GgmlLoadError"):
        assert name in errors
    assert sorted(n for n, cls in errors.items() if not issubclass(cls, ApirError)) == []


# Public errors that were (and stay) a standard exception type: callers catch them as such.
_STANDARD_BASES = {
    "apir.cli.UsageError": ValueError,
    "apir.codec.graph.GraphError": ValueError,
    "apir.socket_path.SocketPathError": ValueError,
    "apir.host.component.trace.TraceError": ValueError,
    "apir.ggml.errors.GgmlLoadError": RuntimeError,
    "apir.models.assets.ModelNotInstalled": RuntimeError,
    "apir.models.minilm.MiniLMError": RuntimeError,
    "apir.models.backends.BackendUnavailable": RuntimeError,
    "apir.guest.backend.apir_backend.BackendInitError": RuntimeError,
    "apir.guest.backend.apir_backend.GraphComputeError": RuntimeError,
    "apir.guest.backend.callbacks.BackendCallbackError": RuntimeError,
    "apir.guest.backend.abi.UnsupportedGgmlVersion": RuntimeError,
}


@pytest.mark.parametrize("name", sorted(_STANDARD_BASES))
def test_error_keeps_its_standard_base(name):
    module, _, cls = name.rpartition(".")
    error = getattr(importlib.import_module(module), cls)
    assert issubclass(error, _STANDARD_BASES[name]) and issubclass(error, ApirError)


def test_guest_errors_share_the_root():
    from apir.guest import errors

    assert errors.ApirError is ApirError
    with pytest.raises(ApirError):
        raise errors.IoctlError("renderD128", "DRM_IOCTL_VIRTGPU_MAP", 2, "No such file or directory")


def test_root_module_imports_nothing_of_apir():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(apir.__file__).with_name("errors.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.split(".")[0] == "apir"]
