"""The one error of apir.ggml."""

from __future__ import annotations

__all__ = ["GgmlLoadError"]


class GgmlLoadError(RuntimeError):
    """The ggml build cannot be used: a library, header, symbol or layout is missing or off."""
