"""apir.devices: device specs, the registry, and open_device's choice."""

import pytest

from apir import devices
from apir.devices import device_kind, device_spec, open_device, parse_spec, register_device
from apir.guest.drm import DrmDevice
from apir.guest.errors import DeviceError
from apir.local.embedded import EmbeddedDevice


def test_specs_and_kinds():
    assert device_kind() == device_kind("embedded") == "embedded"
    assert device_kind("unix:s") == "socket"
    assert device_kind("drm:/dev/dri/renderD128") == device_kind("drm") == "drm"
    spec = parse_spec("unix:/run/apir.sock")
    assert (spec.scheme.scheme, spec.argument, spec.node, spec.where) == (
        "unix", "/run/apir.sock", "/run/apir.sock", "host at /run/apir.sock")
    assert parse_spec(None).node == "embedded" and parse_spec("drm").argument is None
    assert parse_spec("unix:/a:b").argument == "/a:b"  # only the first colon separates


@pytest.mark.parametrize("spec, why", [("vhost-user:/s", "unknown device"), ("unix", "needs a path"),
                                       ("unix:", "needs a path"), ("embedded:x", "takes no argument"),
                                       ("", "unknown device")])
def test_bad_specs(spec, why):
    with pytest.raises(ValueError, match=why):
        parse_spec(spec)
    with pytest.raises(ValueError, match=why):
        open_device(spec)


def test_cli_options_to_spec():
    assert device_spec() is None
    assert device_spec(socket="s") == "unix:s" and device_spec(drm="/dev/dri/renderD128") == "drm:/dev/dri/renderD128"
    with pytest.raises(ValueError):
        device_spec(socket="s", drm="d")


def test_open_device_picks_embedded_by_default(tmp_path):
    dev = open_device()
    try:
        assert isinstance(dev, EmbeddedDevice)
    finally:
        dev.close()
    with pytest.raises(DeviceError, match="no apir host"):
        open_device(f"unix:{tmp_path / 'nobody.sock'}")
    with pytest.raises(DeviceError, match="cannot open"):
        open_device(f"drm:{tmp_path / 'renderD128'}")


def test_options_reach_the_device_constructor(monkeypatch):
    seen = []

    def fake_drm(path, **options):
        seen.append((path, options))
        return "device"

    monkeypatch.setattr("apir.guest.drm.DrmDevice", fake_drm)
    assert open_device("drm", config={"ignored": "1"}, dri_dir="/nowhere") == "device"
    assert seen == [(None, {"dri_dir": "/nowhere"})]
    assert DrmDevice is not fake_drm


def test_register_device(monkeypatch):
    monkeypatch.setattr(devices, "_SCHEMES", dict(devices._SCHEMES))
    opened = []
    register_device("test", "test-kind", lambda arg, config, options: opened.append((arg, config, options)) or "dev",
                    argument=True, where=lambda arg: f"test {arg}")
    assert open_device("test:x", {"k": "v"}, io_timeout_s=1.0) == "dev"
    assert opened == [("x", {"k": "v"}, {"io_timeout_s": 1.0})]
    assert device_kind("test:y") == "test-kind" and parse_spec("test:y").where == "test y"
    with pytest.raises(ValueError, match="registered already"):
        register_device("unix", "socket", lambda *a: None, argument=True, where=str)
