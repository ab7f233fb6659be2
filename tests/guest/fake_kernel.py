"""A fake kernel for DrmDevice: answers DRM ioctls like virtio_gpu does, from ctypes args.

It reads and writes user memory through the addresses in the structures (as the kernel's
copy_from_user / copy_to_user would), so DrmDevice's pointer handling is exercised too.
"""

import ctypes
import errno
import mmap

from apir.codec import virtgpu
from apir.guest import drm_uapi as uapi
from apir.guest.drm import Kernel


class FakeKernel(Kernel):
    def __init__(self, nodes, params=None, capsets=None, execbuffer_sizes=(64, 40)):
        self.nodes = dict(nodes)  # path -> driver name
        self.params = {virtgpu.VirtgpuParam.RESOURCE_BLOB: 1, virtgpu.VirtgpuParam.HOST_VISIBLE: 1,
                       virtgpu.VirtgpuParam.CONTEXT_INIT: 1, virtgpu.VirtgpuParam.SUPPORTED_CAPSET_IDS: 1 << 10}
        self.params.update(params or {})
        self.capsets = dict(capsets or {10: bytes(range(24))})
        # which EXECBUFFER numbers this kernel takes (a strict fake: real DRM takes both)
        self.execbuffer_requests = {
            64: uapi.DRM_IOCTL_VIRTGPU_EXECBUFFER, 40: uapi.DRM_IOCTL_VIRTGPU_EXECBUFFER_61}
        self.accepted_execbuffer = {self.execbuffer_requests[s] for s in execbuffer_sizes}
        self.fds = {}
        self.next_fd = 100
        self.next_handle = 1
        self.blobs = {}  # bo_handle -> (res_id, size)
        self.map_offsets = {}  # offset -> bo_handle
        self.mappings = {}  # bo_handle -> mmap
        self.calls = []  # request numbers, in order
        self.submitted = []  # (request, flags, ring_idx, payload bytes)
        self.contexts = []  # list of [(param, value), ...]
        self.gem_closed = []
        self.fail = {}  # request -> list of errnos to raise, one per call

    # --- syscalls -------------------------------------------------------------------------
    def open(self, path):
        if path not in self.nodes:
            raise OSError(errno.ENOENT, "No such file or directory", path)
        fd = self.next_fd
        self.next_fd += 1
        self.fds[fd] = path
        return fd

    def close(self, fd):
        del self.fds[fd]

    def mmap(self, fd, size, offset):
        handle = self.map_offsets[offset]
        assert self.blobs[handle][1] == size
        mem = mmap.mmap(-1, size)
        self.mappings[handle] = mem
        return mem

    def ioctl(self, fd, request, arg):
        assert fd in self.fds
        self.calls.append(request)
        pending = self.fail.get(request)
        if pending:
            raise OSError(pending.pop(0), "injected")
        if request == uapi.DRM_IOCTL_VERSION:
            name = self.nodes[self.fds[fd]].encode()
            if arg.name and arg.name_len:
                n = min(arg.name_len, len(name))
                ctypes.memmove(arg.name, name, n)
            arg.name_len = len(name)
            arg.version_major = 0
        elif request == uapi.DRM_IOCTL_VIRTGPU_GETPARAM:
            if arg.param not in self.params:
                raise OSError(errno.EINVAL, "bad param")
            ctypes.c_uint32.from_address(arg.value).value = self.params[arg.param]
        elif request == uapi.DRM_IOCTL_VIRTGPU_GET_CAPS:
            if arg.cap_set_id not in self.capsets or arg.cap_set_ver != 0:
                raise OSError(errno.EINVAL, "bad capset")
            data = self.capsets[arg.cap_set_id][: arg.size]
            ctypes.memmove(arg.addr, data, len(data))
        elif request == uapi.DRM_IOCTL_VIRTGPU_CONTEXT_INIT:
            params = (uapi.DrmVirtgpuContextSetParam * arg.num_params).from_address(arg.ctx_set_params)
            self.contexts.append([(p.param, p.value) for p in params])
        elif request == uapi.DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB:
            assert arg.blob_mem == virtgpu.VIRTGPU_BLOB_MEM_HOST3D
            assert arg.blob_flags == virtgpu.VIRTGPU_BLOB_FLAG_USE_MAPPABLE
            handle = self.next_handle
            self.next_handle += 1
            self.blobs[handle] = (1000 + handle, arg.size)
            arg.bo_handle, arg.res_handle = handle, 1000 + handle
        elif request == uapi.DRM_IOCTL_VIRTGPU_MAP:
            if arg.handle not in self.blobs:
                raise OSError(errno.ENOENT, "no such bo")
            arg.offset = arg.handle << 20
            self.map_offsets[arg.offset] = arg.handle
        elif request == uapi.DRM_IOCTL_GEM_CLOSE:
            if self.blobs.pop(arg.handle, None) is None:
                raise OSError(errno.EINVAL, "no such bo")
            self.gem_closed.append(arg.handle)
        elif request in self.execbuffer_requests.values():
            if request not in self.accepted_execbuffer:
                raise OSError(errno.EINVAL, "bad execbuffer")
            payload = ctypes.string_at(arg.command, arg.size)
            self.submitted.append((request, arg.flags, arg.ring_idx, payload))
        else:
            raise OSError(errno.ENOTTY, "unknown ioctl")
