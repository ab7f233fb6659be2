"""The package layering docs/design.md describes, checked on the import statements (those inside
functions included): the codec imports neither half and does no I/O; no guest module imports the
host (embedded mode lives in apir.local, where the halves meet, and the device registry in
apir.devices); what apir.local shares with both halves imports neither; and no module of apir
imports itself through others (an import cycle), not even from inside a function."""

import ast
import sys
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _apir_imports(path: Path, known: set) -> set:
    """The apir modules `path` imports, anywhere in it (inside functions and `if TYPE_CHECKING:`
    too: an annotation names the module as much as a call does). `from P import X` counts as
    importing P.X when that is a module, else P; relative imports are resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{module}.{alias.name}" for alias in node.names} & known
            out |= subs
            if len(subs) < len(node.names):
                out.add(module)
    return (out & known) - {name}


def _import_cycles() -> list:
    """Each import cycle among apir's modules, as a list of module names (Tarjan's strongly
    connected components of the import graph)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: _apir_imports(p, set(paths)) for name, p in paths.items()}
    index: dict = {}
    low: dict = {}
    stack: list = []
    cycles = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    assert _import_cycles() == []


def test_the_cycle_check_sees_imports_inside_functions_and_for_annotations(tmp_path, monkeypatch):
    """A cycle hidden behind an import inside a function, or one made for annotations only, is
    still a cycle."""
    pkg = tmp_path / "apir"
    (pkg / "x").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "x" / "__init__.py").write_text("")
    (pkg / "x" / "a.py").write_text("from apir.x import b\n")
    (pkg / "x" / "b.py").write_text("def f():\n    from apir.x.a import g\n")
    (pkg / "x" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from apir.x import d\n")
    (pkg / "x" / "d.py").write_text("from apir.x.c import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert _import_cycles() == [["apir.x.a", "apir.x.b"], ["apir.x.c", "apir.x.d"]]


# The host's packages, lowest first: each imports only those below it. The top-level modules
# (config, errors, handles, library, resources, tensors) are the seams all of them share.
HOST_LAYERS = ("", "graph", "backend", "component", "local", "vhost_user")


def _host_layer(module: str):
    """The index in HOST_LAYERS of apir.host module `module`'s package, or None for the
    package itself (apir.host's __init__, the facade over all of them)."""
    parts = module.split(".")[2:]
    if not parts:
        return None
    return HOST_LAYERS.index(parts[0] if len(parts) > 1 or parts[0] in HOST_LAYERS else "")


def _host_layer_breaches() -> list:
    """(importer, imported) pairs of apir.host modules where a package imports one above it."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    out = []
    for name, path in sorted(paths.items()):
        if not name.startswith("apir.host.") or _host_layer(name) is None:
            continue
        for dep in sorted(_apir_imports(path, set(paths))):
            if dep.startswith("apir.host") and (_host_layer(dep) or 0) > _host_layer(name):
                out.append((name, dep))
    return out


def test_host_packages_form_no_circle():
    assert _host_layer_breaches() == []


def test_the_host_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    """An annotation-only import of a package above is a breach; one below, or of the shared
    top-level modules, is not."""
    host = tmp_path / "apir" / "host"
    for d in ("graph", "backend"):
        (host / d).mkdir(parents=True)
        (host / d / "__init__.py").write_text("")
    (tmp_path / "apir" / "__init__.py").write_text("")
    (host / "__init__.py").write_text("from apir.host.backend import b\n")
    (host / "errors.py").write_text("")
    (host / "graph" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nfrom apir.host import errors\nif TYPE_CHECKING:\n"
        "    from apir.host.backend.b import Lib\n"
    )
    (host / "backend" / "b.py").write_text("from apir.host.graph import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "apir")
    assert _host_layer_breaches() == [("apir.host.graph.a", "apir.host.backend.b")]


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
