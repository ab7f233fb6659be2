"""The descriptors open in this process, for tests that check a refused or dropped
descriptor is closed."""

import gc
import os


def open_fds() -> set[int]:
    """The numbers of the descriptors open now, taken after a garbage collection, so that a
    socket or file an earlier test left to the collector is closed before the count rather
    than during the test. A test compares with `<=`: nothing open that was not open before
    (the count alone also drops when something unrelated closes, and then hides a leak)."""
    gc.collect()
    return {int(name) for name in os.listdir("/proc/self/fd")}
