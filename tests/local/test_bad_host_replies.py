"""LocalDevice against a host that names memory it does not have: a clear error, never a
mapping past the shared file's end (whose first access would kill the guest with SIGBUS)."""

import os

import pytest

from apir.local.wire import REPLY, Op
from apir.guest.local import HostConnectionLost, LocalDevice
from tests.fdkit import fds_on, target
from tests.local.fakehost import FakeHost


@pytest.mark.parametrize("offset", [16384, 8192, 1 << 40])  # past the end, across it, far past
def test_a_blob_past_the_shared_file_is_refused_not_a_bus_error(tmp_path, offset):
    host = FakeHost(tmp_path / "s.sock", {
        Op.CREATE_BLOB: (REPLY[Op.CREATE_BLOB].pack(7, 1, 16384), 0),
        Op.MAP: (REPLY[Op.MAP].pack(offset), 0),
    })
    try:
        with LocalDevice(host.path, io_timeout_s=2.0) as dev:
            with pytest.raises(HostConnectionLost, match="past the 16384-byte shared file"):
                dev.create_blob(16384)
            assert dev.blobs == {}
    finally:
        host.close()


def test_a_blob_inside_the_shared_file_maps(tmp_path):
    host = FakeHost(tmp_path / "s.sock", {
        Op.CREATE_BLOB: (REPLY[Op.CREATE_BLOB].pack(7, 1, 16384), 0),
        Op.MAP: (REPLY[Op.MAP].pack(0), 0),
    })
    try:
        with LocalDevice(host.path, io_timeout_s=2.0) as dev:
            blob = dev.create_blob(100)
            blob.memory[0:4] = b"ok!!"
            assert (blob.res_id, blob.size, bytes(blob.memory[0:4])) == (7, 16384, b"ok!!")
    finally:
        host.close()


def test_descriptors_a_host_attaches_to_other_replies_are_closed(tmp_path):
    """Only HELLO's reply carries a descriptor (the shared file); any other the host sends
    along is closed at once, not left open in the guest for every reply."""
    r, w = os.pipe()
    host = FakeHost(tmp_path / "s.sock", {Op.GETPARAM: (REPLY[Op.GETPARAM].pack(1), 0, w, w, w)})
    try:
        with LocalDevice(host.path, io_timeout_s=2.0) as dev:
            for _ in range(20):
                assert dev.get_param(1) == 1
            assert sorted(fds_on([target(w)])) == sorted([r, w])  # no copy of `w` left open
    finally:
        host.close()
        os.close(r)
        os.close(w)
