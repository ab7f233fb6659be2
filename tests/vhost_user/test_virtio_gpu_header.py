"""apir's virtio-gpu numbers and command layouts against the kernel's <linux/virtio_gpu.h>.

A C program compiled against the system's UAPI header prints the values and struct sizes; the
vocabulary in apir.codec.virtgpu and the layouts in apir.host.vhost_user.gpu_wire must equal
them (a command body is the C struct less its 24-byte header)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from apir.codec import virtgpu
from apir.host.vhost_user import gpu_wire as w
from apir.host.vhost_user.session import CONFIG_SIZE

HEADER = Path("/usr/include/linux/virtio_gpu.h")

VALUES = {f"VIRTIO_GPU_{m.name}": int(m) for m in virtgpu.VirtioGpuCtrlType}
VALUES.update({f"VIRTIO_GPU_F_{m.name}": int(m) for m in virtgpu.VirtioGpuFeature})
VALUES.update(
    {
        name: getattr(virtgpu, name)
        for name in (
            "VIRTIO_GPU_FLAG_FENCE",
            "VIRTIO_GPU_FLAG_INFO_RING_IDX",
            "VIRTIO_GPU_CONTEXT_INIT_CAPSET_ID_MASK",
            "VIRTIO_GPU_MAX_SCANOUTS",
            "VIRTIO_GPU_SHM_ID_HOST_VISIBLE",
            "VIRTIO_GPU_BLOB_MEM_GUEST",
            "VIRTIO_GPU_BLOB_MEM_HOST3D_GUEST",
            "VIRTIO_GPU_BLOB_FLAG_USE_SHAREABLE",
            "VIRTIO_GPU_BLOB_FLAG_USE_CROSS_DEVICE",
            "VIRTIO_GPU_MAP_CACHE_CACHED",
        )
    }
)
VALUES["VIRTIO_GPU_BLOB_MEM_HOST3D"] = virtgpu.VIRTGPU_BLOB_MEM_HOST3D
VALUES["VIRTIO_GPU_BLOB_FLAG_USE_MAPPABLE"] = virtgpu.VIRTGPU_BLOB_FLAG_USE_MAPPABLE

HDR = w.CTRL_HDR.size
SIZES = {  # C struct -> our size of it
    "virtio_gpu_ctrl_hdr": HDR,
    "virtio_gpu_resource_unref": HDR + w.RESOURCE_ID_REQ.size,
    "virtio_gpu_ctx_resource": HDR + w.RESOURCE_ID_REQ.size,
    "virtio_gpu_resource_unmap_blob": HDR + w.RESOURCE_ID_REQ.size,
    "virtio_gpu_get_capset_info": HDR + w.CAPSET_INFO_REQ.size,
    "virtio_gpu_resp_capset_info": HDR + w.CAPSET_INFO_RESP.size,
    "virtio_gpu_get_capset": HDR + w.GET_CAPSET_REQ.size,
    "virtio_gpu_resource_create_blob": HDR + w.CREATE_BLOB_REQ.size,
    "virtio_gpu_mem_entry": w.MEM_ENTRY.size,
    "virtio_gpu_ctx_create": HDR + w.CTX_CREATE_REQ.size,
    "virtio_gpu_cmd_submit": HDR + w.SUBMIT_3D_REQ.size,
    "virtio_gpu_resource_map_blob": HDR + w.MAP_BLOB_REQ.size,
    "virtio_gpu_resp_map_info": HDR + w.MAP_INFO_RESP.size,
    "virtio_gpu_resp_display_info": HDR + virtgpu.VIRTIO_GPU_MAX_SCANOUTS * w.DISPLAY_ONE.size,
    "virtio_gpu_update_cursor": HDR + w.UPDATE_CURSOR_REQ.size,
    "virtio_gpu_config": CONFIG_SIZE,
}


@pytest.fixture(scope="module")
def c_values(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not HEADER.exists():
        pytest.skip(f"needs a C compiler and {HEADER} (linux-libc-dev)")
    lines = ["#include <stdio.h>", "#include <linux/virtio_gpu.h>", "int main(void) {"]
    lines += [f'printf("val {n} %lu\\n", (unsigned long)({n}));' for n in VALUES]
    lines += [f'printf("size {s} %zu\\n", sizeof(struct {s}));' for s in SIZES]
    lines += ["return 0;", "}"]
    tmp = tmp_path_factory.mktemp("virtio_gpu")
    (tmp / "v.c").write_text("\n".join(lines))
    subprocess.run([cc, str(tmp / "v.c"), "-o", str(tmp / "v")], check=True)
    out = subprocess.run([str(tmp / "v")], check=True, capture_output=True, text=True).stdout
    return {(kind, key): int(value) for kind, key, value in (line.split() for line in out.splitlines())}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_value(c_values, name):
    assert VALUES[name] == c_values[("val", name)]


@pytest.mark.parametrize("struct_name", sorted(SIZES))
def test_struct_size(c_values, struct_name):
    assert SIZES[struct_name] == c_values[("size", struct_name)]
