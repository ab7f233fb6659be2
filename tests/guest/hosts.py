"""Hosts for the client tests, behind the device seam.

`SyncDevice(ctx)` is a VirtgpuDevice serving a HostContext-like object (design.md "Host
seam": capset_id, add_resource, remove_resource, submit, close) synchronously from
execbuffer, with anonymous mmaps as blobs. `CHostContext` is that object made of the C
reference: the virglrenderer APIR component's few lines (header, HandShake, LoadLibrary,
Forward, reply notification) around the C backend library libggml-virtgpu-backend.so, so
the client's bytes are checked against the C host itself. `SilentHost` never replies.
"""

import ctypes
import itertools
import mmap
import struct

from apir.codec.atomics import store_release_u32
from apir.codec.constants import (
    APIR_HANDSHAKE_MAGIC, VENUS_COMMAND_TYPE_LENGTH, VIRTGPU_DRM_CAPSET_APIR, ApirCommandType,
    ApirForwardReturnCode, ApirLoadLibraryReturnCode, CapsetApir,
)
from apir.codec.virtgpu import VirtgpuParam
from apir.guest.device import Blob
from apir.guest.errors import MissingCapability


class SyncDevice:
    """A VirtgpuDevice whose host runs inside execbuffer."""

    name = "sync-device"
    _res_ids = itertools.count(1)  # unique across devices: several may share one host

    def __init__(self, ctx, capsets_mask=None, owns_host=True):
        self.ctx = ctx
        self.owns_host = owns_host
        self.mask = (1 << ctx.capset_id) if capsets_mask is None else capsets_mask
        self.blobs = {}
        self.contexts = []
        self.submitted = 0

    def get_param(self, param):
        return {VirtgpuParam.SUPPORTED_CAPSET_IDS: self.mask}.get(param, 1)

    def get_caps(self, capset_id, size):
        if not self.mask & (1 << capset_id):
            raise MissingCapability(self.name, f"capset {capset_id}")
        return CapsetApir(0, True).pack()[:size]

    def context_init(self, capset_id, num_rings=1):
        self.contexts.append((capset_id, num_rings))

    def create_blob(self, size):
        res_id = next(self._res_ids)
        memory = mmap.mmap(-1, size)
        self.ctx.add_resource(res_id, memory)
        blob = Blob(res_id, res_id, size, memory)
        self.blobs[res_id] = blob
        return blob

    def destroy_blob(self, blob):
        if self.blobs.pop(blob.res_id, None) is not None:
            self.ctx.remove_resource(blob.res_id)
            blob.memory.close()

    def execbuffer(self, payload, ring_idx=0):
        self.submitted += 1
        self.ctx.submit(bytes(payload))

    def close(self):
        for blob in list(self.blobs.values()):
            self.destroy_blob(blob)
        if self.owns_host:
            self.ctx.close()


class SilentHost:
    """Takes every command and never answers (a dead or hung host)."""

    capset_id = VIRTGPU_DRM_CAPSET_APIR

    def __init__(self):
        self.commands = []

    def add_resource(self, res_id, memory):
        pass

    def remove_resource(self, res_id):
        pass

    def submit(self, command):
        self.commands.append(command)

    def close(self):
        pass


class _Callbacks(ctypes.Structure):
    _fields_ = [("get_config", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32, ctypes.c_char_p)),
                ("get_shmem_ptr", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32))]


_C_HOST = []  # the C backend initializes once per process: one C host for the session


def connect(device, **remote_options):
    """`ApirClient.connect(device, **remote_options)`, save that the shared C host
    (`shared_c_host`) gets no second LoadLibrary once a client loaded its backend library (it
    refuses one: one backend per process), whichever test file connected first."""
    from apir.guest.client import ApirClient
    from apir.guest.remote import Remote

    client = ApirClient(Remote(device, **remote_options))
    try:
        client.handshake()
        ctx = getattr(device, "ctx", None)
        if not (isinstance(ctx, CHostContext) and ctx.loaded):
            client.load_library()
    except BaseException:
        client.close()
        raise
    return client


def shared_c_host(cref_020):
    """The session's one CHostContext over the C reference (`cref_020`: its paths.env),
    made on first use: the C backend initializes once per process, so every test file that
    talks to the C host shares it (its backend library stays loaded across clients)."""
    if not _C_HOST:
        config = {"ggml.library.path": cref_020["LIBGGML_CPU"], "ggml.library.reg": "ggml_backend_cpu_reg"}
        _C_HOST.append(CHostContext(cref_020["LIBGGML_VIRTGPU_BACKEND"], config))
    return _C_HOST[0]


class CHostContext:
    """The C reference host for one context. The C backend keeps process-wide state (one
    backend per process, never re-initialized), so make one per test session
    (`shared_c_host`)."""

    capset_id = VIRTGPU_DRM_CAPSET_APIR
    version = (0, 2)

    def __init__(self, backend_library, config, ctx_id=1):
        self.ctx_id = ctx_id
        self.lib = ctypes.CDLL(str(backend_library))
        self.lib.apir_backend_initialize.restype = ctypes.c_uint32
        self.lib.apir_backend_initialize.argtypes = [ctypes.c_uint32, ctypes.POINTER(_Callbacks)]
        self.lib.apir_backend_dispatcher.restype = ctypes.c_uint32
        self.lib.apir_backend_dispatcher.argtypes = [
            ctypes.c_uint32, ctypes.POINTER(_Callbacks), ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        self.config = {k.encode(): ctypes.create_string_buffer(v.encode()) for k, v in config.items()}
        self.resources = {}  # res_id -> (memory, ctypes view for its address)
        self.callbacks = _Callbacks(_Callbacks._fields_[0][1](self._get_config),
                                    _Callbacks._fields_[1][1](self._get_shmem_ptr))
        self.loaded = False
        self.commands = 0

    def _get_config(self, ctx_id, key):
        value = self.config.get(key)
        return ctypes.addressof(value) if value is not None else None

    def _get_shmem_ptr(self, ctx_id, res_id):
        entry = self.resources.get(res_id)
        return ctypes.addressof(entry[1]) if entry else None

    def add_resource(self, res_id, memory):
        self.resources[res_id] = (memory, (ctypes.c_char * len(memory)).from_buffer(memory))

    def remove_resource(self, res_id):
        self.resources.pop(res_id, None)

    def submit(self, command):
        self.commands += 1
        cmd_type, flags, reply_id = struct.unpack_from("<iiI", command)
        if self.capset_id != VIRTGPU_DRM_CAPSET_APIR:
            cmd_type -= VENUS_COMMAND_TYPE_LENGTH
        memory, view = self.resources[reply_id]
        reply = ctypes.addressof(view)
        if cmd_type == ApirCommandType.HANDSHAKE:
            struct.pack_into("<II", memory, 4, *self.version)
            ret = APIR_HANDSHAKE_MAGIC
        elif cmd_type == ApirCommandType.LOADLIBRARY:
            if self.loaded:
                ret = ApirLoadLibraryReturnCode.ALREADY_LOADED
            else:
                ret = self.lib.apir_backend_initialize(self.ctx_id, ctypes.byref(self.callbacks))
                # the component turns the backend's "INIT_BASE_INDEX + SUCCESS" into SUCCESS
                if ret == ApirLoadLibraryReturnCode.INIT_BASE_INDEX:
                    ret = ApirLoadLibraryReturnCode.SUCCESS
                self.loaded = ret == ApirLoadLibraryReturnCode.SUCCESS
        elif not self.loaded:
            ret = ApirForwardReturnCode.NO_DISPATCH_FCT
        else:
            args = ctypes.create_string_buffer(command[12:], len(command) - 12)  # the C decodes in place
            start = ctypes.addressof(args)
            after = ctypes.c_void_p()
            ret = ApirForwardReturnCode.BASE_INDEX + self.lib.apir_backend_dispatcher(
                self.ctx_id, ctypes.byref(self.callbacks), flags, start, start + len(command) - 12,
                reply + 4, reply + len(memory), ctypes.byref(after))
        store_release_u32(memory, 0, ret + 1)

    def close(self):
        self.resources.clear()
