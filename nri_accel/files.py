"""Bounded reads of files other programs write: never a wait, never more than asked.

Owns: read_regular(), file_kind(), UnreadableFile and PATH_MAX. Imports the standard
library only.

The host's sysfs and procfs values, its loader cache and CDI specs (discovery), and the
record `nri-accel run` leaves for the device plugin are all read from paths something
else controls. A FIFO opened for reading waits for a writer, a device may return bytes
for ever, and a file can be replaced between a stat and an open. read_regular() opens
without blocking (O_NONBLOCK), checks what it opened (fstat on the descriptor, so the
check and the read are of the same file) and reads at most its limit: what it returns
is what a regular file held, whatever sits at the path.
"""

from __future__ import annotations

import errno
import os
import stat

PATH_MAX = 4096
"""Linux's longest path, in bytes (what a path nri-accel walks or records may be)."""

_KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a pipe (FIFO)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """What a file of `mode` (st_mode) is, for messages: "a pipe (FIFO)", "a directory", ..."""
    return next((name for test, name in _KINDS if test(mode)), "an unknown kind of file")


class UnreadableFile(OSError):
    """What read_regular() refuses: not a regular file, larger than its limit, or (own)
    another user's to write."""


def read_regular(path: str, limit: int, *, follow: bool = True, own: bool = False) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them. With `follow`
    false, a symbolic link at `path` itself is refused (OSError ELOOP); with `own`, a
    file this process's user does not own, or that its group or others may write (it
    could have been written by another user: a file this process wrote and reads back).
    Raises UnreadableFile for anything but a regular file of at most `limit` bytes (its
    message says what is there), and OSError (FileNotFoundError, ...) when it cannot be
    opened."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    fd = os.open(path, flags if follow else flags | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        mode = st.st_mode
        if not stat.S_ISREG(mode):
            raise UnreadableFile(errno.EINVAL, f"{file_kind(mode)}, not a regular file", path)
        if own and st.st_uid != os.geteuid():
            raise UnreadableFile(errno.EPERM, f"owned by uid {st.st_uid}, not by this "
                                 f"process's ({os.geteuid()})", path)
        if own and mode & 0o022:
            raise UnreadableFile(errno.EPERM, f"writable by its group or others (mode "
                                 f"{stat.S_IMODE(mode):04o})", path)
        chunks: list[bytes] = []
        size = 0
        while size <= limit:  # to the end, or one byte past the limit
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise UnreadableFile(errno.EFBIG, f"larger than {limit} bytes", path)
    finally:
        os.close(fd)
    return b"".join(chunks)
