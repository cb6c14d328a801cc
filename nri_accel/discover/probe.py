"""The cheap change probe's readings: what a family's probe() returns, entry by entry.

Owns: file_state(), node_state() and entries() (the lstat identity of directory
entries). Imports the standard library and nri_accel.discover.hostroot. Each reading is
a few stat()s or one small read; the refresher (nri_accel.discover.watch) compares the
readings of two polls and rediscovers the node when any differs.
"""

from __future__ import annotations

import stat
from typing import Any

from nri_accel.discover.hostroot import HostRoot

State = list[tuple[str, Any]]


def file_state(root: HostRoot, host_path: str) -> tuple[str, Any]:
    """A small file's content (driver version files), None when it cannot be read."""
    try:
        return host_path, root.read_text(host_path)
    except (OSError, ValueError):
        return host_path, None


def node_state(root: HostRoot, host_path: str, *, content: bool = False) -> tuple[str, Any]:
    """lstat identity: file type, device number and inode; with `content`, size and mtime
    too (spec files). Device nodes leave mtime out: some drivers' nodes change it on use."""
    try:
        st = root.lstat(host_path)
    except (OSError, ValueError):
        return host_path, None
    ident = (stat.S_IFMT(st.st_mode), st.st_rdev, st.st_ino)
    return host_path, (*ident, st.st_size, st.st_mtime_ns) if content else ident


def entries(root: HostRoot, directory: str, prefixes: tuple[str, ...] = ("",), *,
            content: bool = False) -> State:
    """node_state() of each entry of `directory` whose name starts with one of `prefixes`."""
    return [node_state(root, f"{directory.rstrip('/')}/{name}", content=content)
            for name in root.listdir(directory) if name.startswith(prefixes)]
