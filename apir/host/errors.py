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
    """A guest command the host will not run: the message says why (for the log).

    The fields say the same for code (tests, tools): `node` the index of the graph node
    refused (None where no node is concerned), `op` its op name, `reason` why (the message's
    own words, without the node prefix), `rule` the check that refused it (the rule
    function's `module.qualname`, e.g. "apir.host.graph.shapes.rope._rope"; None where not a shape
    rule). The message, which is all the log and the guest ever see of it, is unchanged by
    them."""

    def __init__(
        self,
        message: str,
        *,
        node: int | None = None,
        op: str | None = None,
        reason: str | None = None,
        rule: str | None = None,
    ) -> None:
        super().__init__(message)
        self.node = node
        self.op = op
        self.reason = message if reason is None else reason
        self.rule = rule
