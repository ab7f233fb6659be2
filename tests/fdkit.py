"""Which descriptors of this process are open on a given file, for tests that check a refused
or dropped descriptor is closed. They look for copies of the very file they sent, not at the
count or set of all descriptors: other tests' threads and the garbage collector open and close
descriptors of their own at any moment (CI saw both)."""

import os


def target(fd: int) -> str:
    """What /proc/self/fd/`fd` names: a path, or "pipe:[inode]", "socket:[inode]", ..."""
    return os.readlink(f"/proc/self/fd/{fd}")


def fds_on(targets) -> list[int]:
    """The descriptors open now on any of `targets` (strings from `target`)."""
    targets = set(targets)
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") in targets:
                found.append(int(name))
        except OSError:
            continue  # closed since the listing (the listing's own descriptor, another thread's)
    return found
