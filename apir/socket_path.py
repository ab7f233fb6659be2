"""Unix socket paths as the user gives them (`--socket PATH`), checked before bind or connect.

Why: the socket calls report "No such file or directory", "Connection refused" or "AF_UNIX path
too long" without saying which path or what to do. These checks name the path and the reason:
`check_syntax` for what can never work (empty, longer than sockaddr_un.sun_path holds: a usage
error), `check_connect` / `check_listen` for what the file system says now (a runtime error).
"""

from __future__ import annotations

import os
import stat

from apir.errors import ApirError

__all__ = ["SUN_PATH_MAX", "SocketPathError", "check_syntax", "check_connect", "check_listen"]

# struct sockaddr_un.sun_path is 108 bytes on Linux, the last one the terminating NUL.
SUN_PATH_MAX = 107


class SocketPathError(ApirError, ValueError):
    """A socket path that cannot be used; the message names it and says why."""


def check_syntax(path: str) -> str:
    """`path` if it can be a Unix socket path at all; else SocketPathError (empty, or longer
    than SUN_PATH_MAX bytes once encoded)."""
    if not path:
        raise SocketPathError("empty socket path (give a file name such as /tmp/apir.sock)")
    n = len(os.fsencode(path))
    if n > SUN_PATH_MAX:
        raise SocketPathError(f"{path}: {n} bytes, longer than a Unix socket path can be ({SUN_PATH_MAX})")
    return path


def check_connect(path: str) -> None:
    """Raises SocketPathError unless `path` exists and is a socket (a host may still not
    answer there: that is the connection's error)."""
    check_syntax(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise SocketPathError(
            f"{path}: no such socket; start a host there with `apir host serve --socket {path}`"
        ) from None
    except OSError as exc:
        raise SocketPathError(f"{path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise SocketPathError(f"{path}: not a Unix socket ({_kind(mode)})")


def check_listen(path: str) -> None:
    """Raises SocketPathError when a host cannot listen at `path`: its folder is missing or
    not a folder, or something other than a socket is already there (a leftover socket is
    fine: the server replaces it)."""
    check_syntax(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise SocketPathError(f"{path}: its folder {folder} {what}")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        if not os.access(folder, os.W_OK | os.X_OK):
            read_only = os.statvfs(folder).f_flag & os.ST_RDONLY
            why = "is on a read-only file system" if read_only else "is not writable by this user"
            raise SocketPathError(f"{path}: cannot create a socket there: its folder {folder} {why}") from None
        return
    if not stat.S_ISSOCK(mode):
        raise SocketPathError(f"{path}: exists and is not a socket ({_kind(mode)}); not replacing it")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "not a socket"
