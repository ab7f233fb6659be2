"""The one error of apir.ggml."""

from __future__ import annotations

from apir.errors import ApirError

__all__ = ["GgmlLoadError"]


class GgmlLoadError(ApirError, RuntimeError):
    """The ggml build cannot be used: a library, header, symbol or layout is missing or off."""
