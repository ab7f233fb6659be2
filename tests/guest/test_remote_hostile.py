"""The guest's Remote against a host that never answers: a call that raises while it waits
(a timeout) leaves no traceback that pins the reply mapping through the Remote's one kept
reply Decoder (`Remote.call` takes it after the wait)."""

from __future__ import annotations

import itertools
import mmap

import pytest

from apir.codec.constants import VIRTGPU_DRM_CAPSET_APIR, CapsetApir
from apir.codec.virtgpu import VirtgpuParam
from apir.guest.client import ApirClient
from apir.guest.device import Blob
from apir.guest.errors import ApirTimeout


class _SilentDevice:
    """A VirtgpuDevice (APIR capset) with anonymous mmaps as blobs whose host never answers;
    destroy_blob closes the mapping, like the DRM device's unmap."""

    name = "silent"
    _ids = itertools.count(1)

    def __init__(self):
        self.blobs = {}
        self.closed_blobs = []
        self.pinned = []

    def get_param(self, param):
        return {VirtgpuParam.SUPPORTED_CAPSET_IDS: 1 << VIRTGPU_DRM_CAPSET_APIR}.get(param, 1)

    def get_caps(self, capset_id, size):
        return CapsetApir(0, True).pack()[:size]

    def context_init(self, capset_id, num_rings=1):
        pass

    def create_blob(self, size):
        res_id = next(self._ids)
        blob = Blob(res_id, res_id, size, mmap.mmap(-1, size))
        self.blobs[res_id] = blob
        return blob

    def destroy_blob(self, blob):
        if self.blobs.pop(blob.res_id, None) is not None:
            try:
                blob.memory.close()
            except BufferError:
                self.pinned.append(blob.res_id)
                raise
            self.closed_blobs.append(blob.res_id)

    def execbuffer(self, payload, ring_idx=0):
        pass

    def close(self):
        for blob in list(self.blobs.values()):
            self.destroy_blob(blob)


def test_timed_out_handshake_leaves_no_reply_mapping_pinned():
    """ApirClient.connect against a host that never answers: the HandShake times out and
    connect closes the Remote from its `except BaseException` (the ApirTimeout's traceback
    alive). Were the Remote's reply Decoder taken into a local of `Remote.call` before the
    wait, its memoryview would export the reply mmap and that frame, kept by the traceback,
    would make the reply blob's unmap fail (BufferError, 'left mapped'); the call's frame must
    hold only the Blob (no export), as `_wait`'s docstring says: 'a kept traceback must not pin
    the reply mapping'."""
    dev = _SilentDevice()
    with pytest.raises(ApirTimeout):
        ApirClient.connect(dev, handshake_timeout_s=0.02)
    assert dev.blobs == {} and dev.pinned == []
    assert len(dev.closed_blobs) == 2  # the reply blob and the data window, both unmapped
