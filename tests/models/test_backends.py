"""apir.models.backends: the seam that picks the backend for `apir embed`."""

import pytest

from apir.models import backends as B


def _apir_missing():
    try:
        B.open_apir(None, None).close()
    except B.BackendUnavailable:
        return True
    return False


def test_local_cpu(ggml):
    with B.open_local_cpu(1) as ob:
        assert ob.transport == "local-cpu" and not ob.through_apir and not ob.fallback
        assert ggml.ggml_backend_name(ob.backend) == b"CPU"
        assert ob.buft == ggml.ggml_backend_get_default_buffer_type(ob.backend)
        assert "not through APIR" in ob.description


def test_default_falls_back_flagged_or_uses_apir():
    with B.open_backend() as ob:
        if _apir_missing():
            assert ob.fallback and ob.transport == "local-cpu" and "FALLBACK" in ob.description
        else:
            assert ob.through_apir and not ob.fallback


@pytest.mark.parametrize("device", ["unix:/nonexistent/apir.sock", "drm:/nonexistent/renderD128"])
def test_explicit_transport_never_falls_back(device):
    with pytest.raises(B.BackendUnavailable):
        B.open_backend(device)


def test_no_fallback_when_disallowed():
    if not _apir_missing():
        pytest.skip("the APIR backend is available")
    with pytest.raises(B.BackendUnavailable, match="apir.guest.backend"):
        B.open_backend(allow_fallback=False)


def test_bad_device_spec_rejected():
    with pytest.raises(ValueError, match="unknown device"):
        B.open_backend("vhost:/a")
