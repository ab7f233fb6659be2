"""The socket host's stand-in for the virtio-gpu kernel driver (apir.host.local.kernel): the
names a guest sees are its own."""

from apir.codec.virtgpu import VIRTGPU_BLOB_FLAG_USE_MAPPABLE, VIRTGPU_BLOB_MEM_HOST3D, VIRTGPU_DRM_CAPSET_APIR
from apir.host.local.kernel import KernelContext


def test_two_guests_interleaving_blob_creations_see_independent_resource_ids():
    """Resource ids come from each guest's own counter: the ids one guest gets do not show how
    many blobs another created in between."""
    guests = [KernelContext(f"guest-{i}") for i in range(2)]
    seen: list[list[int]] = [[], []]
    try:
        for k in guests:
            k.context_init(VIRTGPU_DRM_CAPSET_APIR, 1)
        for step in range(6):
            i = 0 if step % 3 else 1  # b, a, a, b, a, a
            res_id, _, _ = guests[i].create_blob(VIRTGPU_BLOB_MEM_HOST3D, VIRTGPU_BLOB_FLAG_USE_MAPPABLE, 4096)
            seen[i].append(res_id)
        alone = KernelContext("alone")
        alone.context_init(VIRTGPU_DRM_CAPSET_APIR, 1)
        guests.append(alone)
        ids = [alone.create_blob(VIRTGPU_BLOB_MEM_HOST3D, VIRTGPU_BLOB_FLAG_USE_MAPPABLE, 4096)[0] for _ in range(4)]
    finally:
        for k in guests:
            k.close()
    assert seen == [ids, ids[:2]]  # what a guest alone on the host would have seen
