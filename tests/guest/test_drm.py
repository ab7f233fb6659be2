"""DrmDevice against a fake kernel: discovery, capability errors, blobs, EXECBUFFER layouts."""

import errno

import pytest

from apir.codec import virtgpu
from apir.guest import drm_uapi as uapi
from apir.guest.device import Blob, VirtgpuDevice
from apir.guest.drm import DrmDevice, find_virtgpu_nodes
from apir.guest.errors import DeviceNotFound, IoctlError, MissingCapability
from tests.guest.fake_kernel import FakeKernel


@pytest.fixture
def dri(tmp_path):
    """A /dev/dri look-alike: an i915 node, then a virtio_gpu node."""
    for name in ("renderD128", "renderD129", "card0"):
        (tmp_path / name).touch()
    nodes = {str(tmp_path / "renderD128"): "i915", str(tmp_path / "renderD129"): "virtio_gpu",
             str(tmp_path / "card0"): "virtio_gpu"}
    return tmp_path, nodes


def test_discovery_picks_the_virtio_gpu_render_node(dri):
    path, nodes = dri
    kernel = FakeKernel(nodes)
    assert list(find_virtgpu_nodes(str(path), kernel)) == [str(path / "renderD129")]
    dev = DrmDevice(dri_dir=str(path), kernel=kernel)
    assert dev.name == str(path / "renderD129")
    assert isinstance(dev, VirtgpuDevice)
    dev.close()
    assert kernel.fds == {}  # every probe and the device closed their fds


def test_no_virtio_gpu_node(dri):
    path, nodes = dri
    kernel = FakeKernel({k: "amdgpu" for k in nodes})
    with pytest.raises(DeviceNotFound, match=str(path)):
        DrmDevice(dri_dir=str(path), kernel=kernel)
    with pytest.raises(DeviceNotFound, match="renderD128.*amdgpu"):
        DrmDevice(str(path / "renderD128"), kernel=kernel)
    assert kernel.fds == {}


@pytest.mark.parametrize("param,words", [
    (virtgpu.VirtgpuParam.RESOURCE_BLOB, "blob resources"),
    (virtgpu.VirtgpuParam.HOST_VISIBLE, "host-visible"),
    (virtgpu.VirtgpuParam.CONTEXT_INIT, "context init"),
])
def test_missing_capability_names_node_and_capability(dri, param, words):
    path, nodes = dri
    kernel = FakeKernel(nodes, params={param: 0})
    with pytest.raises(MissingCapability) as info:
        DrmDevice(dri_dir=str(path), kernel=kernel)
    assert info.value.node == str(path / "renderD129")
    assert words in info.value.capability and str(path / "renderD129") in str(info.value)
    assert kernel.fds == {}


def test_unknown_param_reads_zero_and_params_read_back(dri):
    path, nodes = dri
    kernel = FakeKernel(nodes, params={virtgpu.VirtgpuParam.SUPPORTED_CAPSET_IDS: (1 << 4) | (1 << 10)})
    with DrmDevice(dri_dir=str(path), kernel=kernel) as dev:
        assert dev.get_param(virtgpu.VirtgpuParam.SUPPORTED_CAPSET_IDS) == (1 << 4) | (1 << 10)
        assert dev.get_param(999) == 0


def test_get_caps_and_missing_capset(dri):
    path, nodes = dri
    kernel = FakeKernel(nodes, capsets={10: bytes(range(24))})
    with DrmDevice(dri_dir=str(path), kernel=kernel) as dev:
        assert dev.get_caps(10, 24) == bytes(range(24))
        with pytest.raises(MissingCapability, match="capset 4"):
            dev.get_caps(4, 24)


def test_context_init_params(dri):
    path, nodes = dri
    kernel = FakeKernel(nodes)
    with DrmDevice(dri_dir=str(path), kernel=kernel) as dev:
        dev.context_init(10)
    assert kernel.contexts == [[(1, 10), (2, 1), (3, 0)]]


def test_blob_lifecycle(dri):
    path, nodes = dri
    kernel = FakeKernel(nodes)
    dev = DrmDevice(dri_dir=str(path), kernel=kernel)
    blob = dev.create_blob(32768)
    assert isinstance(blob, Blob)
    assert (blob.res_id, blob.size) == (kernel.blobs[blob.bo_handle][0], 32768)
    blob.memory[:4] = b"abcd"
    assert kernel.mappings[blob.bo_handle][:4] == b"abcd"
    other = dev.create_blob(16384)
    dev.destroy_blob(blob)
    dev.destroy_blob(blob)  # idempotent
    assert kernel.gem_closed == [blob.bo_handle] and blob.memory.closed
    dev.close()  # releases the blob still open
    assert kernel.gem_closed == [blob.bo_handle, other.bo_handle] and other.memory.closed
    assert kernel.fds == {}


def test_map_failure_closes_the_gem_handle(dri):
    path, nodes = dri
    kernel = FakeKernel(nodes)
    with DrmDevice(dri_dir=str(path), kernel=kernel) as dev:
        kernel.fail[uapi.DRM_IOCTL_VIRTGPU_MAP] = [errno.ENOMEM]
        with pytest.raises(IoctlError) as info:
            dev.create_blob(16384)
        assert info.value.errno == errno.ENOMEM and info.value.request == "DRM_IOCTL_VIRTGPU_MAP"
        assert info.value.node in str(info.value)
        assert kernel.blobs == {} and kernel.gem_closed == [1]


@pytest.mark.parametrize("sizes,expected", [((64, 40), 64), ((40,), 40), ((64,), 64)])
def test_execbuffer_layout_by_kernel_answer(dri, sizes, expected):
    path, nodes = dri
    kernel = FakeKernel(nodes, execbuffer_sizes=sizes)
    with DrmDevice(dri_dir=str(path), kernel=kernel) as dev:
        assert dev.execbuffer_size is None
        dev.execbuffer(b"\x00\x01\x02\x03" * 3)
        dev.execbuffer(bytearray(b"next"))
        assert dev.execbuffer_size == expected
    request = kernel.execbuffer_requests[expected]
    assert kernel.submitted == [(request, virtgpu.VIRTGPU_EXECBUF_RING_IDX, 0, b"\x00\x01\x02\x03" * 3),
                                (request, virtgpu.VIRTGPU_EXECBUF_RING_IDX, 0, b"next")]
    # once chosen, only that number is used
    execs = [r for r in kernel.calls if r in kernel.execbuffer_requests.values()]
    assert execs[-1] == request and execs.count(request) == 2


def test_execbuffer_rejected_by_both_layouts(dri):
    path, nodes = dri
    kernel = FakeKernel(nodes, execbuffer_sizes=())
    with DrmDevice(dri_dir=str(path), kernel=kernel) as dev:
        with pytest.raises(IoctlError, match="EXECBUFFER") as info:
            dev.execbuffer(b"abcd")
        assert info.value.errno == errno.EINVAL


def test_eintr_is_retried_other_errnos_raise(dri):
    path, nodes = dri
    kernel = FakeKernel(nodes)
    with DrmDevice(dri_dir=str(path), kernel=kernel) as dev:
        kernel.fail[uapi.DRM_IOCTL_VIRTGPU_EXECBUFFER] = [errno.EINTR, errno.EAGAIN]
        dev.execbuffer(b"abcd")
        assert len(kernel.submitted) == 1
        kernel.fail[uapi.DRM_IOCTL_VIRTGPU_EXECBUFFER] = [errno.ENODEV]
        with pytest.raises(IoctlError) as info:
            dev.execbuffer(b"abcd")
        assert info.value.errno == errno.ENODEV and info.value.node == dev.name
