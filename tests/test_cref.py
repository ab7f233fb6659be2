"""tests/cref.py: where the C reference cache lives (the user's cache folder, not the clone)."""

from pathlib import Path

from tests import cref


def _env(monkeypatch, **values):
    for name in ("APIR_CREF_CACHE", "APIR_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_cache_follows_xdg_and_apir_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _env(monkeypatch)
    assert cref.cache_dir() == tmp_path / "home" / ".cache" / "apir" / "cref"
    _env(monkeypatch, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert cref.cache_dir() == tmp_path / "xdg" / "apir" / "cref"
    _env(monkeypatch, XDG_CACHE_HOME=str(tmp_path / "xdg"), APIR_CACHE_DIR=str(tmp_path / "c"))
    assert cref.cache_dir() == tmp_path / "c" / "cref"
    _env(monkeypatch, APIR_CACHE_DIR=str(tmp_path / "c"), APIR_CREF_CACHE=str(tmp_path / "exact"))
    assert cref.cache_dir() == tmp_path / "exact"
    _env(monkeypatch, XDG_CACHE_HOME="")  # empty counts as unset (XDG base directory rule)
    assert cref.cache_dir() == tmp_path / "home" / ".cache" / "apir" / "cref"


def test_build_script_is_the_projects_own():
    repo = Path(cref.__file__).resolve().parents[1]
    assert cref.BUILD_SCRIPT == repo / "scripts" / "build-c-reference.sh"
    assert cref.BUILD_SCRIPT.is_file()
    assert repo in cref.BUILD_SCRIPT.parents  # nothing outside the clone
