"""The one switch between apir's plain reference path and its Numba accelerations.

Every protocol step is plain Python first: the code a porter reads. A Numba kernel is an
acceleration of such a step, held equal to it by tests on the same inputs. `enabled()` says
which of the two runs in this process: the kernels, unless the environment sets
``APIR_ACCEL=0`` or Numba cannot be imported. With it off, no module of apir imports Numba.
The choice is read once per process.
"""

from __future__ import annotations

import functools
import os

__all__ = ["ENV_ACCEL", "enabled"]

ENV_ACCEL = "APIR_ACCEL"
_OFF = ("0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
    """Whether the Numba kernels run (True) or the plain path (False)."""
    if os.environ.get(ENV_ACCEL, "1").strip().lower() in _OFF:
        return False
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True
