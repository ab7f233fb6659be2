"""apir.guest.backend.abi: every struct's size and every field's offset and size against the
C compiler's view of ggml-backend-impl.h, for each declared ggml version."""

import subprocess
from types import SimpleNamespace

import pytest

from apir.guest.backend import abi as abi_mod
from tests.guest_backend.abikit import CC, c_layout, py_layout

@pytest.mark.skipif(CC is None, reason="no C compiler")
@pytest.mark.parametrize("fixture, version", [("cref_020", "0.20.2"), ("cref_010", "0.10.1")])
def test_struct_layouts_match_the_c_header(fixture, version, request, tmp_path):
    paths = request.getfixturevalue(fixture)
    a = abi_mod.abi_for(SimpleNamespace(version=version))
    c = c_layout(paths, a, tmp_path)
    py = py_layout(a)
    assert set(c) == set(py)
    diff = {k: (py[k], c[k]) for k in c if py[k] != c[k]}
    assert diff == {}
    # The iface tables are complete: every function pointer of the C struct is declared.
    assert c[("ggml_backend_i", None)][1] == 8 * len(abi_mod.IFACE_FIELDS["ggml_backend_i"])


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_backend_api_version_matches_the_header(cref_020, tmp_path):
    src = tmp_path / "v.c"
    src.write_text('#include <stdio.h>\n#include "ggml-backend-impl.h"\n'
                   'int main(void) { printf("%d", GGML_BACKEND_API_VERSION); return 0; }\n')
    subprocess.run([CC, "-I", cref_020["GGML_INCLUDE"], "-I", cref_020["GGML_SRC"] + "/src", str(src),
                    "-o", str(tmp_path / "v")], check=True)
    out = subprocess.run([str(tmp_path / "v")], check=True, capture_output=True, text=True).stdout
    assert int(out) == abi_mod.abi_for(SimpleNamespace(version="0.20.2")).backend_api_version


def test_unknown_version_is_refused():
    with pytest.raises(abi_mod.UnsupportedGgmlVersion, match=r"0\.99\.0.*series 0\.10, 0\.20, 0\.25$"):
        abi_mod.abi_for(SimpleNamespace(version="0.99.0", lib_dir="/x"))


def test_a_patch_release_uses_its_series_abi():
    """The tables are keyed by API series: another 0.20.x patch release needs no change."""
    a = abi_mod.abi_for(SimpleNamespace(version="0.20.2"))
    assert abi_mod.abi_for(SimpleNamespace(version="0.20.7")) is a and a.series == "0.20"
    old = abi_mod.abi_for(SimpleNamespace(version="0.10.3"))
    assert old.series == "0.10" and [f for f, _ in old.DevCaps._fields_] == [
        "async", "host_buffer", "buffer_from_host_ptr", "events"]


def test_loaded_ggml_has_an_abi_and_buffer_init(ggml):
    a = abi_mod.abi_for(ggml)
    assert a.series == ggml.series
    fn = a.buffer_init(ggml)
    assert fn.argtypes[1] is a.BufferI


def test_every_series_has_its_backend_structs():
    """A series added to apir.ggml.features.SERIES without its interface tables here would
    leave the guest backend refusing that ggml: the two lists must agree."""
    from apir.ggml.features import SERIES

    assert set(abi_mod._IFACES) == set(SERIES) and abi_mod.SUPPORTED_VERSIONS == tuple(SERIES)
