"""apir.local: the local transport's pieces that both halves use (no VM, no kernel driver).

- `socket_io`: one local-wire message over a Unix socket (sendmsg / recvmsg, SCM_RIGHTS); the
  socket host (apir.host.local.server) and `LocalDevice` (apir.guest.local) both use it. The
  message layouts themselves are apir.local.wire's, which does no I/O.
- `embedded`: `EmbeddedDevice`, the guest's device with the host in the same process; the one
  place where guest and host code meet (no apir.guest module imports apir.host).
"""
