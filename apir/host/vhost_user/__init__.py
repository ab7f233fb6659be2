"""A virtio-gpu device served over vhost-user: the hypervisor half for real VMs.

QEMU 11.1's generic `vhost-user-test-device-pci` (virtio-id 16) connects to `VhostUserServer`'s
socket; the guest kernel's virtio_gpu driver then talks to `GpuDevice`, whose APIR contexts are
`apir.host.component.context.HostContext`s. Modules, one job each:

    protocol        the vhost-user message codec (requests, features, framing, fds)
    memory          guest RAM through the memory table, every access bounds-checked
    virtqueue       split virtqueues: descriptor chains in, used elements out
    backend_channel SHMEM_MAP / SHMEM_UNMAP to QEMU, with REPLY_ACK
    gpu_wire        virtio-gpu command and response layouts
    completion      fenced responses in fence order
    context_worker  a thread per context (SUBMIT_3D off the queue thread)
    gpu_device      contexts, resources, blobs and the control commands
    session         one front-end: negotiation, set-up messages, the queue thread, teardown
    server          the listening socket, one front-end after another

Start it with `apir host vhost-user --socket PATH`; docs/vm.md has the QEMU command line.
"""

from apir.host.vhost_user.server import DEFAULT_SHM_SIZE, VhostUserServer

__all__ = ["VhostUserServer", "DEFAULT_SHM_SIZE"]
