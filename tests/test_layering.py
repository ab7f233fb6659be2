"""The package layering docs/design.md describes, checked on the import statements (those inside
functions included): the codec imports neither half and does no I/O; no guest module imports the
host (embedded mode lives in apir.local, where the halves meet, and the device registry in
apir.devices); what apir.local shares with both halves imports neither."""

import ast
from pathlib import Path

import pytest

import apir

ROOT = Path(apir.__file__).parent


def _imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(package: str):
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", _modules("guest"), ids=lambda p: str(p.relative_to(ROOT)))
def test_guest_imports_no_host(path):
    bad = {m for m in _imports(path)
           if m.split(".")[:2] == ["apir", "host"] or m in ("apir.local.embedded", "apir.devices")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_shared_local_io_imports_neither_half():
    bad = {m for m in _imports(ROOT / "local" / "socket_io.py")
           if m.split(".")[:2] in (["apir", "host"], ["apir", "guest"])}
    assert not bad


@pytest.mark.parametrize("path", _modules("codec"), ids=lambda p: str(p.relative_to(ROOT)))
def test_codec_imports_neither_half_and_does_no_io(path):
    bad = {m for m in _imports(path)
           if m.split(".")[:2] in (["apir", "host"], ["apir", "guest"], ["apir", "local"], ["apir", "ggml"])
           or m.split(".")[0] in ("socket", "os", "select", "mmap", "fcntl", "subprocess")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
