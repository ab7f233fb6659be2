"""apir.guest.drm_uapi against the kernel UAPI header: sizes, field offsets, request numbers.

A C program compiled against the reference build's drm/virtgpu_drm.h (and libdrm's drm.h)
prints what the compiler says; every value must equal ours.
"""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from apir.codec import virtgpu
from apir.guest import drm_uapi as uapi

# ours -> C struct name (the 6.1 execbuffer has no header here: checked as a prefix below)
STRUCTS = {
    uapi.DrmVersion: "drm_version",
    uapi.DrmGemClose: "drm_gem_close",
    uapi.DrmVirtgpuGetparam: "drm_virtgpu_getparam",
    uapi.DrmVirtgpuGetCaps: "drm_virtgpu_get_caps",
    uapi.DrmVirtgpuContextSetParam: "drm_virtgpu_context_set_param",
    uapi.DrmVirtgpuContextInit: "drm_virtgpu_context_init",
    uapi.DrmVirtgpuResourceCreateBlob: "drm_virtgpu_resource_create_blob",
    uapi.DrmVirtgpuMap: "drm_virtgpu_map",
    uapi.DrmVirtgpuExecbuffer: "drm_virtgpu_execbuffer",
}
REQUESTS = [
    "DRM_IOCTL_VERSION", "DRM_IOCTL_GEM_CLOSE", "DRM_IOCTL_VIRTGPU_MAP", "DRM_IOCTL_VIRTGPU_EXECBUFFER",
    "DRM_IOCTL_VIRTGPU_GETPARAM", "DRM_IOCTL_VIRTGPU_GET_CAPS", "DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB",
    "DRM_IOCTL_VIRTGPU_CONTEXT_INIT",
]
CONSTANTS = ["VIRTGPU_EXECBUF_RING_IDX", "VIRTGPU_BLOB_MEM_HOST3D", "VIRTGPU_BLOB_FLAG_USE_MAPPABLE"]
PARAMS = {p: "VIRTGPU_PARAM_" + {"FEATURES_3D": "3D_FEATURES", "SUPPORTED_CAPSET_IDS": "SUPPORTED_CAPSET_IDs"}
          .get(p.name, p.name) for p in virtgpu.VirtgpuParam}
CTX_PARAMS = {p: "VIRTGPU_CONTEXT_PARAM_" + p.name for p in virtgpu.VirtgpuContextParam}


def _drm_h_dirs():
    """Folders holding libdrm's drm.h, which virtgpu_drm.h includes as "drm.h"."""
    out = subprocess.run(["pkg-config", "--cflags-only-I", "libdrm"], capture_output=True, text=True)
    dirs = [f[2:] for f in out.stdout.split()] if out.returncode == 0 else []
    return dirs + [d for d in ("/usr/include/libdrm", "/usr/include/drm") if Path(d).is_dir()]


@pytest.fixture(scope="module")
def c_values(cref_020, tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "drm.h"', '#include "virtgpu_drm.h"',
             "int main(void) {"]
    for ours, cname in STRUCTS.items():
        lines.append(f'printf("size {cname} %zu\\n", sizeof(struct {cname}));')
        for field, *_ in ours._fields_:
            lines.append(f'printf("off {cname}.{field} %zu\\n", offsetof(struct {cname}, {field}));')
    for name in REQUESTS + CONSTANTS + list(PARAMS.values()) + list(CTX_PARAMS.values()):
        lines.append(f'printf("val {name} %lu\\n", (unsigned long)({name}));')
    lines += ["return 0;", "}"]
    tmp = tmp_path_factory.mktemp("uapi")
    (tmp / "uapi.c").write_text("\n".join(lines))
    inc = Path(cref_020["VIRTGPU_DRM_INCLUDE"]) / "drm"
    cmd = [cc, f"-I{inc}"] + [f"-I{d}" for d in _drm_h_dirs()] + [str(tmp / "uapi.c"), "-o", str(tmp / "uapi")]
    subprocess.run(cmd, check=True)
    values = {}
    for line in subprocess.run([str(tmp / "uapi")], check=True, capture_output=True, text=True).stdout.splitlines():
        kind, key, value = line.split()
        values[(kind, key)] = int(value)
    return values


@pytest.mark.parametrize("ours", list(STRUCTS), ids=lambda s: s.__name__)
def test_struct_size_and_offsets(c_values, ours):
    cname = STRUCTS[ours]
    assert ctypes.sizeof(ours) == c_values[("size", cname)]
    for field, *_ in ours._fields_:
        assert getattr(ours, field).offset == c_values[("off", f"{cname}.{field}")], field


@pytest.mark.parametrize("name", REQUESTS)
def test_request_numbers(c_values, name):
    assert getattr(uapi, name) == c_values[("val", name)]
    assert uapi.REQUEST_NAMES[getattr(uapi, name)] == name  # the IoctlName an IoctlError reports


def test_constants_and_params(c_values):
    for name in CONSTANTS:
        assert getattr(virtgpu, name) == c_values[("val", name)], name
    for ours, cname in {**PARAMS, **CTX_PARAMS}.items():
        assert ours == c_values[("val", cname)], cname


def test_execbuffer_61_layout_is_the_40_byte_prefix(c_values):
    """Kernel 6.1's struct: 40 bytes, the current one's fields up to ring_idx at the same
    offsets, then `pad` where `syncobj_stride` is now."""
    old = uapi.DrmVirtgpuExecbuffer61
    assert ctypes.sizeof(old) == 40
    for field, *_ in old._fields_[:-1]:
        assert getattr(old, field).offset == c_values[("off", f"drm_virtgpu_execbuffer.{field}")]
    assert old.pad.offset == c_values[("off", "drm_virtgpu_execbuffer.syncobj_stride")]
    # same command number, size field 40: what a 6.1 header's DRM_IOCTL_VIRTGPU_EXECBUFFER is
    new = c_values[("val", "DRM_IOCTL_VIRTGPU_EXECBUFFER")]
    assert uapi.DRM_IOCTL_VIRTGPU_EXECBUFFER_61 == (new & ~(0x3FFF << 16)) | (40 << 16)
