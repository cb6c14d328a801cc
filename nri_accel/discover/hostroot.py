"""HostRoot: the one seam through which every host path is read (or, rarely, written).

Owns: mapping host-absolute paths ("/dev/nvidiactl", "/sys/bus/pci/...",
"/usr/lib/x86_64-linux-gnu/libcuda.so.1") to where they can be read from this
process, chroot-style path resolution that never leaves a root (walk_in_root, also
used by ldcache; HostRoot.resolve, where a CDI bind mount's source leads), and the few
writes discovery may make to the host (makedirs(), mknod_char(), symlink(): a family
creating device nodes the driver left uncreated, only where the configuration allows
it). Imports only the standard library and msgspec.

A daemon on the node uses HostRoot("/"); a DaemonSet that mounts the host at /host
uses HostRoot("/host"); tests point it at a temporary tree. Paths that nri-accel
emits into a container adjustment are always *host* paths (what runc sees), never
the paths this process used to read them.

The driver root is where the NVIDIA driver's user-space files live as seen from the
host (normally "/", "/run/nvidia/driver" with the GPU operator's driver container).
"""

from __future__ import annotations

import errno
import os
import stat
from collections import deque
from pathlib import PurePosixPath

from msgspec import Struct

from nri_accel.errors import cut
from nri_accel.files import PATH_MAX, UnreadableFile, read_regular

MAX_SYMLINK_HOPS = 40  # as the kernel (MAXSYMLINKS)
# Most read_text() returns: a sysfs attribute is at most a page (4 KiB), the procfs files
# read (/proc/devices, /proc/driver/nvidia*) a few KiB; callers reading more say so.
READ_LIMIT = 64 << 10
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_PATH", 0)


def walk_in_root(base: str, path: str, start: str = "/", *, follow_last: bool = True,
                 must_exist: bool = True) -> str:
    """Resolve `path` with the local directory `base` as its "/", as a chroot would.

    Returns the resolved path inside the root ("/usr/lib/x86_64-linux-gnu/libcuda.so.1"):
    an absolute symlink target restarts at the root, ".." stops at it, so nothing
    outside `base` is ever reached. `start`: an already resolved directory that a
    relative `path` continues from. `follow_last=False` leaves the last component as it
    is (lstat() then still sees a symlink). `must_exist=False` keeps components that
    cannot be read as they are written. Raises OSError: a missing or unreadable
    component (when `must_exist`), ELOOP after MAX_SYMLINK_HOPS links, ENAMETOOLONG for
    a `path` over PATH_MAX bytes.

    Linear in the length of the path and its links: the walk holds a descriptor of the
    directory it has reached and looks up one component at a time from it (never the
    whole path again), and once a component is missing, nothing below it is looked up.
    """
    if len(path.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise OSError(errno.ENAMETOOLONG, f"path longer than {PATH_MAX} bytes",
                      cut(path, 64))
    pending = deque(p for p in path.split("/") if p)
    parts: list[str] = []
    hops = 0
    # `fd` holds the directory "/" + "/".join(parts[:depth]), depth being `missing`
    # once a component below it is missing or not a directory (nothing below it is then
    # looked up), else len(parts). missing == -1: not even the root could be opened.
    missing: int | None = None
    why = errno.ENOTDIR  # why the component at `missing` cannot be walked below
    fd = _open_dir(base)
    try:
        if fd is None:
            if must_exist:
                os.lstat(base)  # raises the reason
            missing = -1
        if not path.startswith("/"):
            for name in (p for p in start.split("/") if p):
                parts.append(name)
                if missing is None:
                    fd, ok = _descend(fd, name)
                    if not ok:
                        missing = len(parts) - 1
                        why = _errno_of(fd, name)
        while pending:
            name = pending.popleft()
            if name == ".":
                continue
            if name == "..":
                if parts:
                    parts.pop()
                    if missing is None:
                        fd, ok = _descend(fd, "..")
                        if not ok:  # the directory went away meanwhile
                            raise OSError(errno.ENOENT, "directory removed during the "
                                          "walk", os.path.join(base, *parts))
                    elif len(parts) == missing:
                        missing = None  # back at the directory `fd` holds
                continue
            if not pending and not follow_last:
                parts.append(name)
                break
            if missing is not None:
                if must_exist:
                    raise OSError(why, os.strerror(why), os.path.join(base, *parts, name))
                parts.append(name)
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError as e:
                if must_exist:
                    raise OSError(e.errno, e.strerror,
                                  os.path.join(base, *parts, name)) from None
                missing, why = len(parts), e.errno or errno.ENOENT
                parts.append(name)
                continue
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links",
                                  os.path.join(base, *parts, name))
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    parts = []
                    new = _open_dir(base)
                    if new is None:
                        raise OSError(errno.ENOENT, "root removed during the walk", base)
                    os.close(fd)  # type: ignore[arg-type]
                    fd = new
                pending.extendleft(reversed([p for p in target.split("/") if p]))
                continue
            ok = False
            if stat.S_ISDIR(st.st_mode):
                fd, ok = _descend(fd, name)
            if not ok:  # a file (nothing is below it), or a directory gone meanwhile
                missing, why = len(parts), errno.ENOTDIR
            parts.append(name)
    finally:
        if fd is not None:
            os.close(fd)
    return "/" + "/".join(parts)


def _open_dir(path: str) -> int | None:
    try:
        return os.open(path, _DIR_FLAGS)
    except OSError:
        return None


def _errno_of(fd: int | None, name: str) -> int:
    """Why `name` in the directory `fd` cannot be walked into."""
    if fd is None:
        return errno.ENOENT
    try:
        os.stat(name, dir_fd=fd)
    except OSError as e:
        return e.errno or errno.ENOENT
    return errno.ENOTDIR


def _descend(fd: int | None, name: str) -> tuple[int | None, bool]:
    """(`name` opened from the directory `fd`, True), `fd` then closed; (`fd`, False)
    where `name` is not a directory (a symlink never is: not followed)."""
    if fd is None:
        return None, False
    try:
        new = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
    except OSError:
        return fd, False
    os.close(fd)
    return new, True


class HostRoot(Struct, frozen=True):
    """Where the host's filesystem, /dev, /sys and the driver root are mounted here."""

    root: str = "/"
    dev: str = "/dev"  # host path of the device directory
    sys: str = "/sys"  # host path of sysfs
    driver_root: str = "/"  # host path under which the driver's files are installed

    @classmethod
    def at(cls, root: str | os.PathLike[str], *, driver_root: str = "/") -> HostRoot:
        return cls(root=os.fspath(root), driver_root=driver_root)

    def local(self, host_path: str) -> str:
        """Where this process reads the host-absolute `host_path`.

        Under a root other than "/", symlinks in every component but the last are
        resolved inside the root, as the host itself would see them (a host's
        /var/run -> /run must not lead to this container's /run). The last component is
        left alone so lstat() still sees a symlink where one is.
        """
        p = PurePosixPath(host_path)
        if not p.is_absolute():
            raise ValueError(f"host path must be absolute: {host_path!r}")
        if ".." in p.parts:
            raise ValueError(f"host path must not contain '..': {host_path!r}")
        if self.root in ("", "/"):
            return str(p)
        resolved = walk_in_root(self.root, str(p), follow_last=False, must_exist=False)
        return os.path.join(self.root, resolved.lstrip("/"))

    def resolve(self, host_path: str) -> str:
        """The host path `host_path` names once every symlink in it is followed (inside
        the root, as the host sees it; missing components kept as written). Raises
        OSError (ELOOP) for a symlink loop, ValueError for a relative path."""
        if not host_path.startswith("/"):
            raise ValueError(f"host path must be absolute: {host_path!r}")
        return walk_in_root(self.root or "/", host_path, must_exist=False)

    def dev_path(self, name: str) -> str:
        """Host path of a node under the device directory, e.g. dev_path('nvidiactl')."""
        return str(PurePosixPath(self.dev) / name)

    def sys_path(self, rel: str) -> str:
        """Host path of a sysfs entry, e.g. sys_path('bus/pci/devices')."""
        return str(PurePosixPath(self.sys) / rel)

    def lstat(self, host_path: str) -> os.stat_result:
        return os.lstat(self.local(host_path))

    def exists(self, host_path: str) -> bool:
        return os.path.lexists(self.local(host_path))

    def read_text(self, host_path: str, *, limit: int = READ_LIMIT) -> str:
        """The text of the regular file `host_path` (every symlink in it followed inside
        the root), at most `limit` bytes. Opened non-blocking and checked with fstat
        before any read, so a FIFO, socket or device there never blocks discovery.
        Raises OSError: FileNotFoundError and the like, or UnreadableFile (not a regular
        file, or larger than `limit`)."""
        local = self.local(host_path)
        inside = self.root not in ("", "/")
        if inside:  # the last component too, as the host sees it
            local = os.path.join(self.root, walk_in_root(self.root, host_path).lstrip("/"))
        try:
            data = read_regular(local, limit, follow=not inside)
        except UnreadableFile as e:  # named by its host path
            raise UnreadableFile(e.errno, e.strerror, host_path) from None
        return data.decode("utf-8", errors="replace")

    def listdir(self, host_path: str) -> list[str]:
        """The sorted names in the directory `host_path`, a last symlink followed inside
        the root as the host sees it; [] where there is none (or it cannot be read)."""
        try:
            return sorted(os.listdir(self.local(self.resolve(host_path))))
        except (OSError, ValueError):
            return []

    # ---- writes: discovery/refresh only, never on a CreateContainer -------------------
    #
    # Each creates one entry in a directory that must be a real directory (never a
    # symlink) writable by its owner alone, so nobody but that owner (root, for /dev) can
    # swap the new entry between its creation and its chmod. An existing entry is never
    # replaced: FileExistsError.

    def makedirs(self, host_path: str, mode: int = 0o755) -> None:
        """Create the directory `host_path` and its missing parents with `mode` (exact,
        whatever the umask). An existing component must be a real directory."""
        parts = PurePosixPath(host_path).parts[1:]
        for i in range(1, len(parts) + 1):
            path = "/" + "/".join(parts[:i])
            try:
                st = self.lstat(path)
            except FileNotFoundError:
                local = self._new_entry(path)
                try:
                    os.mkdir(local, mode)
                except FileExistsError:
                    pass  # created meanwhile: checked below
                else:
                    os.chmod(local, mode)
                st = self.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory (or a symlink)",
                                         path)

    def mknod_char(self, host_path: str, major: int, minor: int, mode: int) -> None:
        """Create the character device node `host_path` (major:minor, permissions `mode`
        exactly). FileExistsError if anything is there already."""
        local = self._new_entry(host_path)
        os.mknod(local, stat.S_IFCHR | mode, os.makedev(major, minor))
        os.chmod(local, mode)

    def symlink(self, host_path: str, target: str) -> None:
        """Create the symbolic link `host_path` -> `target` (as written: a relative
        target stays relative). FileExistsError if anything is there already."""
        os.symlink(target, self._new_entry(host_path))

    def _new_entry(self, host_path: str) -> str:
        """Where to create `host_path`, after checking its parent directory."""
        parent = str(PurePosixPath(host_path).parent)
        st = self.lstat(parent)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory (or a symlink)", parent)
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PermissionError(errno.EPERM, "directory writable by others than its "
                                  "owner", parent)
        return self.local(host_path)
