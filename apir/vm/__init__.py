"""Real VMs on apir's virtio-gpu device (docs/vm.md): `apir vm run` and `apir vm provision`.

  provision.py     where QEMU 11.1 and the guest kernels are (the cache), and provisioning it
  provision-vm.sh  the provisioning itself (root, Debian packages only)
  machine.py       one VM: a PVH-booted Debian kernel, a busybox initramfs, the host's / over 9p
  host.py          the `apir host vhost-user` process serving the VMs' sockets
  run.py           a program in N VMs, its output streamed back, everything cleaned up
  cli.py           the `apir vm` commands

Imports nothing of apir's halves: the device runs in a process of its own.
"""
