"""The host's one error type for hostile or malformed guest input, and its log.

Theory of operation: a check anywhere below the dispatcher raises `Refused` with a message
that names what was wrong; the dispatcher's single entry turns it into the backend function's
error return code (`BACKEND_RC_ERROR`) and one log line. Nothing a guest sends escapes as an
exception from `HostContext.submit`.
"""

from __future__ import annotations

import logging

from apir.errors import ApirError

__all__ = ["Refused", "log", "BACKEND_RC_OK", "BACKEND_RC_ERROR"]

# Every apir module logs to `logging.getLogger(__name__)`, but for this one: the refusals of
# guest input (and the dispatcher's other lines) go to the host's package logger, "apir.host",
# one name to watch or silence for everything a guest was refused.
log = logging.getLogger("apir.host")

# Backend function return codes (the `uint32_t` a C `backend_*` handler returns; Forward
# replies 4 + this). The C handlers use 1 for every failure; so does apir.
BACKEND_RC_OK = 0
BACKEND_RC_ERROR = 1


class Refused(ApirError):
    """A guest command the host will not run: the message says why (for the log)."""
