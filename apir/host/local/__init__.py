"""The host side of the local transport (docs/local-transport.md): `kernel` stands in for the
virtio-gpu kernel driver, `server` is the socket host, `memfile` the shared memory file blobs
live in, `hangup` cancels a departed guest's compute."""
