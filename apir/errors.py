"""apir's one error root, `ApirError`, shared by every package (docs/design.md, "Errors").

Theory of operation: every public exception apir raises derives from `ApirError`, on both
halves: the codec's (`WireError`, `GraphError`, `EncoderOverflow`), the guest's
(`apir.guest.errors`: device, HandShake, LoadLibrary, Forward), its ggml backend's, the
host's (`Refused`, `KernelError`, ...), ggml loading's and the models'. A class that was a
`ValueError` or `RuntimeError` stays one as well (multiple inheritance), so code catching the
standard type keeps working. This module imports nothing of apir: every package can use it
without breaking the layering (tests/test_layering.py).
"""

from __future__ import annotations

__all__ = ["ApirError"]


class ApirError(Exception):
    """Base of every apir error."""
