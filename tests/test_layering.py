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


TESTS = Path(__file__).parent


def _test_file_imports(path: Path) -> set:
    """The test modules (`test_*`) that `path` imports, absolute or relative."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names = [base] + [f"{base}.{alias.name}" if node.module else base + alias.name for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.rstrip(".").rsplit(".", 1)[-1].startswith("test_"))
    return found


@pytest.mark.parametrize("path", sorted(TESTS.rglob("*.py")), ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_file_imports_another(path):
    """What tests share lives in kit modules (tests/host/shapekit.py, tests/local/localkit.py,
    ...) or conftest fixtures: a test file imported by another runs its tests' module code
    twice and hides what each file tests."""
    bad = _test_file_imports(path)
    assert not bad, f"tests/{path.relative_to(TESTS)} imports {sorted(bad)}"


def test_the_test_import_check_sees_cross_imports(tmp_path):
    """The check above, on the forms it must catch (and one it must not)."""
    cases = {
        "from tests.host.test_shapes import _rope": True,
        "from .test_cli import run_cli": True,
        "from . import test_cli": True,
        "import tests.local.test_cli": True,
        "from tests.host.shapekit import Case": False,
    }
    for source, caught in cases.items():
        path = tmp_path / "m.py"
        path.write_text(source + "\n")
        assert bool(_test_file_imports(path)) == caught, source
