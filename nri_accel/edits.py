"""Edits: what a Selection means for the container (device nodes, mounts, env, hooks).

Owns: the Catalog (every device's and driver capability's edits, checked and normalised
once per inventory, and each family's tables), build() (Selection x Request x container
-> ContainerEdits: the final order, de-duplicated once), the safety rules for what may be
emitted (check_edits and its parts check_node, check_mount, ...; the mount denylist
FORBIDDEN_SOURCES), and the container env the edits write. Imports the standard library, msgspec,
nri_accel.config (types), nri_accel.errors, nri_accel.inventory, nri_accel.policy (the
Request), nri_accel.select (the Selection), nri_accel.errors and nri_accel.vendors. Pure:
no I/O, no logging.

What a container gets:
- the device nodes of each granted device (a MIG device's include its parent GPU's node);
- per family with a granted device (or asked for its driver alone, NVIDIA "none"), what
  its profile's edits() adds: driver files by capability, the env its software reads
  (NVIDIA_VISIBLE_DEVICES=<uuids>, NVIDIA_DRIVER_CAPABILITIES, AWS_NEURON_VISIBLE_DEVICES,
  ...), defaults set only where the container does not set them
  (NEURON_RT_VISIBLE_CORES), library directories (nri_accel.vendors.base);
- per family that got nothing but whose visibility variable the container's env sets,
  that variable rewritten to the family's "nothing" value, so a co-installed vendor hook
  cannot widen the grant (rewritten, never removed: the runtimes' NRI, from v0.10, drops
  a removal of a variable the image sets; see nri_accel.vendors.base, `visibility`);
- LD_LIBRARY_PATH: the container's own value followed by the directories the driver
  libraries are mounted in, without duplicates (libraries become loadable without
  running anything in the container's root filesystem); a container value too long to
  extend (MAX_ENV_STRING, the kernel's limit on one env string) is refused;
- CDI devices: their device edits plus their spec's container edits (Driver "cdi:...").
- Hooks: none by default. With config devices.hooks and hook_path, one createContainer
  hook `<hook_path> update-ldcache --folder DIR...` (the nvidia-cdi-hook syntax) with
  PATH as its only env and a timeout; hooks that come with CDI specs are emitted only when
  devices.hooks is on. A hook never receives anything from the container's env.

Safety (defence in depth: discovery already guarantees most of it, a hand-written
inventory JSON may not; THE rules, which CDI spec loading and static devices call too):
- one device or driver capability adds at most MAX_EDITS (1024) edits in all, one
  container's devices together MAX_CONTAINER_EDITS (2048);
- paths are absolute, normalised and free of "..", at most MAX_PATH_BYTES (4096, PATH_MAX)
  bytes and MAX_PATH_COMPONENTS (256) components (path_size_problem);
- device nodes live under /dev (container and host path) with a real major/minor, type c
  or b, and cgroup access holding r and w: through NRI the runtime allows "rw" (and runc
  "m") whatever a node asks, so a narrower CDI `permissions` ("r", "w", "m", "none") is
  refused rather than silently widened (RUNTIME_ACCESS);
- a mount is a bind mount or a tmpfs, never another type (check_mount). A bind mount
  always carries ro, nosuid, nodev and bind, never rw, suid, dev or shared propagation,
  and its source is neither under nor an ancestor of a FORBIDDEN_SOURCES path (/proc,
  /sys, /var/lib/kubelet, /etc/kubernetes, the runtimes' state and socket directories,
  nri-accel's own state). A tmpfs has a name for its source, not a host path, keeps only
  allow-listed options (size=, mode=, ..., rw or ro) and always carries nosuid, nodev.
  No mount lands on / or under /proc, /sys or a runtime socket's directory (a read-only
  bind of a socket still lets a process connect to it);
- inventory env may not set LD_PRELOAD or LD_AUDIT, nor a name starting with "-" (in
  an NRI adjustment, the removal of the variable so named).
An edit breaking these is refused when a container needs it, with an AllocationError
naming the device or capability; other containers are unaffected. Device nodes and mounts
already in the container spec are not emitted again (two NRI plugins setting one path
fail the container). Output is deterministic: env sorted by name, nodes by path in
natural order, mounts by destination, gids ascending; nri.adjust keeps that order.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from msgspec import Struct, field
from msgspec.structs import replace

from nri_accel.errors import AllocationError, RequestError, cut
from nri_accel.files import PATH_MAX
from nri_accel.inventory import (
    ContainerEdits,
    DeviceNode,
    Hook,
    Inventory,
    Mount,
    merge_edits,
    natural_key,
    vendor_of,
)
from nri_accel.memo import Memo
from nri_accel.select import Selection
from nri_accel.vendors import PROFILES, family_of
from nri_accel.vendors.base import Checked, DriverFiles, take

if TYPE_CHECKING:
    from nri_accel.config import DevicesConfig
    from nri_accel.policy import Request

HOOK_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
HOOK_TIMEOUT = 10  # seconds
REQUIRED_MOUNT_OPTIONS = ("ro", "nosuid", "nodev")  # every bind mount
TMPFS_REQUIRED_OPTIONS = ("nosuid", "nodev")  # every tmpfs (it may be written: it is its own)
# Dropped from every mount: write access to a host path, set-uid files and device nodes
# honoured, and shared propagation (a mount made inside the container would appear on the
# host, and NRI makes the whole root filesystem rshared for it).
_DROPPED_MOUNT_OPTIONS = frozenset({"rw", "suid", "dev", "shared", "rshared"})
_DROPPED_TMPFS_OPTIONS = _DROPPED_MOUNT_OPTIONS - {"rw"}
_BIND_OPTIONS = frozenset({"bind", "rbind"})
# A recursive bind mount becomes a plain one: runc makes read-only (and nosuid, nodev)
# only the top mount of a recursive bind (its remount is not recursive; runc's "rro"
# needs runc 1.1 and Linux 5.12), so the mounts under its source would stay writable in
# the container. The host's submounts are then not in the container at all.
_NOT_RECURSIVE = {"rbind": "bind"}
BIND_TYPES = frozenset({"bind", "none", ""})  # CDI SPEC.md: a bind mount's type is a dummy
TMPFS = "tmpfs"
# What a tmpfs may carry besides the above: mount flags (mount(8) FILESYSTEM-INDEPENDENT
# MOUNT OPTIONS) and tmpfs(5)'s own options. Anything else is refused: "remount", "bind",
# filesystem options of another type, an option that smuggles more after a ','.
_TMPFS_FLAGS = frozenset({
    "ro", "rw", "nosuid", "nodev", "noexec", "exec", "noatime", "atime", "relatime",
    "norelatime", "strictatime", "nostrictatime", "nodiratime", "diratime", "lazytime",
    "nolazytime", "sync", "async", "dirsync", "private", "rprivate", "slave", "rslave",
    "unbindable", "runbindable", "noswap", "inode32", "inode64",
})
_TMPFS_VALUES = frozenset({"size", "nr_blocks", "nr_inodes", "mode", "uid", "gid", "huge",
                           "mpol"})
FORBIDDEN_DESTINATIONS = ("/proc", "/sys")
# Runtime sockets and their directories: no mount from them, nor onto them.
RUNTIME_SOCKETS = (
    "/run/containerd", "/var/run/containerd", "/run/crio", "/var/run/crio",
    "/run/docker.sock", "/var/run/docker.sock", "/run/docker", "/var/run/docker",
    "/run/nri", "/var/run/nri", "/run/podman", "/var/run/podman",
    "/run/cri-dockerd.sock", "/var/run/cri-dockerd.sock", "/var/run/dockershim.sock",
)
# THE host paths no mount may come from, nor contain (a bind of /var/lib would show
# /var/lib/kubelet), with why; /var/run is listed beside /run because the check is on the
# path as written (a symlink in a CDI spec's hostPath is resolved at load time and the
# result checked again). Default locations: a kubelet --root-dir or a runtime root moved
# elsewhere is not known here.
_KUBELET = ("kubelet state (device-plugin and pod-resources sockets, pod secrets and tokens, "
            "its client certificate)")
_CONTAINERD = "containerd state (its socket, shims, every image and container filesystem)"
_STORAGE = ("containers/storage of CRI-O and Podman (every image and container filesystem, "
            "registry credentials)")
_CRIO = "CRI-O state (its socket, conmon sockets, exit files)"
_DOCKER = "Docker state (its socket, every image and container filesystem)"
FORBIDDEN_SOURCES: Mapping[str, str] = MappingProxyType({
    "/proc": "procfs (every host process, /proc/1/root is the host's /)",
    "/sys": "sysfs (host device, firmware and kernel interfaces)",
    "/var/lib/kubelet": _KUBELET,
    "/etc/kubernetes": "the node's Kubernetes credentials (kubelet.conf, pki)",
    "/var/lib/containerd": _CONTAINERD,
    "/run/containerd": _CONTAINERD,
    "/var/run/containerd": _CONTAINERD,
    "/var/lib/containers": _STORAGE,
    "/run/containers": _STORAGE,
    "/var/run/containers": _STORAGE,
    "/var/lib/crio": _CRIO,
    "/run/crio": _CRIO,
    "/var/run/crio": _CRIO,
    "/var/lib/docker": _DOCKER,
    "/run/docker": _DOCKER,
    "/var/run/docker": _DOCKER,
    "/run/docker.sock": _DOCKER,
    "/var/run/docker.sock": _DOCKER,
    "/run/cri-dockerd.sock": "the cri-dockerd socket",
    "/var/run/cri-dockerd.sock": "the cri-dockerd socket",
    "/var/run/dockershim.sock": "the dockershim socket",
    "/run/podman": "the Podman API socket",
    "/var/run/podman": "the Podman API socket",
    "/run/libpod": "Podman state",
    "/var/run/libpod": "Podman state",
    "/run/runc": "runc state (every container's state.json)",
    "/var/run/runc": "runc state (every container's state.json)",
    "/run/crun": "crun state",
    "/var/run/crun": "crun state",
    "/run/nri": "the NRI socket (a process on it is trusted by the runtime)",
    "/var/run/nri": "the NRI socket (a process on it is trusted by the runtime)",
    "/run/k3s": "k3s state (its containerd socket)",
    "/var/lib/rancher": "k3s and RKE2 state (containerd root, join token, TLS keys)",
    "/run/nri-accel": "nri-accel's own state (the grants checkpoint)",
})
# check_mount_source()'s whole test: a path under a root starts with one of these...
_UNDER_FORBIDDEN = tuple(root.rstrip("/") + "/" for root in FORBIDDEN_SOURCES)
# ... and a path holding a root, once stripped of a trailing "/" ("" for "/"), is one of
# these: each root's ancestors, as cut at its slashes.
_HOLDING_FORBIDDEN = frozenset(root[:i] for root in FORBIDDEN_SOURCES
                               for i, c in enumerate(root) if c == "/")
# The cgroup access a device in an NRI adjustment gets: the runtime derives it
# (containerd/nri pkg/api LinuxDevice.AccessString: "rw", and "m" for block devices) and
# NRI's LinuxDevice has no field to narrow it; runc adds "m" for every device whatever
# the spec says (libcontainer/specconv AllowedDevices). So a node whose permissions lack
# r or w cannot be honoured and is refused; "m" can be withheld by no one.
RUNTIME_ACCESS = frozenset("rw")
NO_ACCESS = "none"  # CDI's keyword for a node with an empty cgroup rule (pkg/cdi)
FORBIDDEN_ENV = frozenset({"LD_PRELOAD", "LD_AUDIT"})
# build()'s memos, per inventory, bounded by entries and by the characters of the
# requests (and env added) they keep (nri_accel.memo): a Request holds its parsed
# NVIDIA_REQUIRE_* constraints, some 25 times the text they were written in.
MEMO_SIZE = 4096  # grants remembered before the memo starts over
MEMO_CHARS = 1024 * 1024
EDITS_MEMO_SIZE = 1024  # container edits remembered (per grant and own env values)
EDITS_MEMO_CHARS = 1024 * 1024
LD_LIBRARY_PATH = "LD_LIBRARY_PATH"
# The longest "KEY=VALUE" string execve(2) accepts (MAX_ARG_STRLEN, 32 pages): a longer
# LD_LIBRARY_PATH could not reach the container's process anyway, and extending one
# costs time in proportion to its length, so it is refused before any work.
MAX_ENV_STRING = 32 * 4096
MAX_EDITS = 1024
# A path longer than PATH_MAX fails every system call (ENAMETOOLONG); real device, driver
# and library paths have under 16 components. Both bound the walk a path costs.
MAX_PATH_BYTES = PATH_MAX
MAX_PATH_COMPONENTS = 256
"""Device nodes, mounts, env entries and hooks that one device or one driver capability
may add. The answer for a device set is built on its first grant, at about 3 us an
edit, on the event loop, where every other container waits (a thousand: 3 ms; the
40,000 mounts a 4 MiB CDI spec can list: 120 ms and more). A real one adds tens:
nvidia-ctk's spec for a whole driver, about 100 at most."""
MAX_CONTAINER_EDITS = 2 * MAX_EDITS
"""The same for all the devices of one container together (their edits merged): an
answer built in about 6 ms at most. `all` on a 512-GPU node adds about 550."""
ENV_PREFIXES = tuple(f"{name}=" for name in sorted({
    LD_LIBRARY_PATH,
    *(p.visibility[0] for p in PROFILES if p.visibility is not None),
    *(name for p in PROFILES for name in p.env_defaults),
}))
"""The container's own values build() acts on: LD_LIBRARY_PATH (extended), each family's
visibility variable (rewritten) and defaults (set only where the container
does not set them). Of the other variables the edits set, the container's own value only
saves writing an equal one again (nri_accel.nri.convert may leave those out of a large
env)."""


class UnsafeEdit(ValueError):
    """An inventory edit breaks a safety rule (message says which path and why)."""


class Catalog(Struct, frozen=True, eq=False):
    """Every edit the inventory can contribute, checked once (per inventory and config).
    Compared by identity: its memos change as it serves."""

    devices: Mapping[str, Checked]  # qualified name -> its device edits
    files: DriverFiles  # (vendor, capability) -> driver edits; the families' tables
    hook_path: str  # the ld.so.cache hook binary; "" when no hook may be emitted
    # build()'s memo of the grant-dependent part of the edits, per grant.
    memo: Memo[tuple[Any, ...], _Common] = field(
        default_factory=lambda: Memo(MEMO_SIZE, MEMO_CHARS))
    # build()'s edits per grant and the container's own values of the variables they
    # set, of containers whose own devices and mounts replace none of the grant's: one
    # object for all such containers, so that its hash (the adjustment memo's key,
    # nri_accel.nri.adjust) is taken once.
    edits: Memo[tuple[Any, ...], ContainerEdits] = field(
        default_factory=lambda: Memo(EDITS_MEMO_SIZE, EDITS_MEMO_CHARS))

    def refused(self) -> tuple[tuple[str, str], ...]:
        """(whose edits, why) of every device and driver capability whose edits the
        safety checks refuse: a container granted one of them fails, naming it."""
        drivers = ((f"driver {v}" + (f" capability {c}" if c else ""), checked)
                   for (v, c), checked in self.files.checked.items())
        return tuple((who, checked.refused)
                     for who, checked in (*self.devices.items(), *drivers) if checked.refused)


_UNCHECKED = Checked(refused="the device is not in the catalog of this inventory")


def compile_catalog(inventory: Inventory, devices: DevicesConfig) -> Catalog:
    """Check and normalise every edit of `inventory` once."""
    hooks_enabled = devices.hooks
    dev_edits = {d.qualified_name: _check(d.edits, hooks_enabled) for d in inventory.devices}
    drv = {(vendor, cap): _check(edits, hooks_enabled)
           for vendor, driver in inventory.drivers.items()
           for cap, edits in driver.capabilities.items()}
    tables = {p.name: t for p in PROFILES if (t := p.tables(inventory)) is not None}
    return Catalog(
        devices=MappingProxyType(dev_edits),
        files=DriverFiles(MappingProxyType(drv), MappingProxyType(tables)),
        hook_path=devices.hook_path if devices.hooks else "",
    )


def _check(edits: ContainerEdits, hooks_enabled: bool) -> Checked:
    try:
        checked = check_edits(edits, hooks_enabled=hooks_enabled)
    except UnsafeEdit as e:
        return Checked(refused=str(e))
    return Checked(edits=checked, lib_dirs=_lib_dirs(checked.mounts),
                   dropped_hooks=len(edits.hooks) - len(checked.hooks))


def check_edits(edits: ContainerEdits, *, hooks_enabled: bool = False) -> ContainerEdits:
    """`edits` normalised (mount options forced), or UnsafeEdit saying what is wrong.
    Hooks are dropped unless `hooks_enabled`."""
    check_edit_count(_size(edits))
    for kv in edits.env:
        check_env(kv)
    for n in edits.device_nodes:
        check_node(n)
    mounts = tuple(check_mount(m) for m in edits.mounts)
    hooks: tuple[Hook, ...] = ()
    if hooks_enabled:
        hooks = tuple(_check_hook(h) for h in edits.hooks)
    return replace(edits, mounts=mounts, hooks=hooks)


def _size(edits: ContainerEdits) -> int:
    """The edits MAX_EDITS and MAX_CONTAINER_EDITS count: device nodes, mounts, env
    entries and hooks."""
    return len(edits.env) + len(edits.device_nodes) + len(edits.mounts) + len(edits.hooks)


def check_edit_count(count: int) -> None:
    """UnsafeEdit when one device or capability adds more than MAX_EDITS edits."""
    if count > MAX_EDITS:
        raise UnsafeEdit(f"{count} device nodes, mounts, env entries and hooks, over the "
                         f"{MAX_EDITS} nri-accel takes from one device or capability")


def _check_utf8(text: str, what: str) -> None:
    """Text the NRI protobuf can carry (UTF-8: no lone surrogate, which a JSON "\\ud800"
    escape in a CDI spec or a saved inventory gives), else UnsafeEdit."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeEdit(f"{what} {text[:64]!r} is not valid UTF-8 (a lone surrogate)") from None


def check_env(kv: str) -> None:
    """One "KEY=VALUE" entry nri-accel may set, or UnsafeEdit."""
    _check_utf8(kv, "env entry")
    key, sep, _ = kv.partition("=")
    if not sep or not key or "\0" in kv:
        raise UnsafeEdit(f"env entry {kv[:64]!r} is not KEY=VALUE")
    # In an adjustment a key starting with "-" removes the variable instead of setting
    # it (containerd/nri pkg/api, IsMarkedForRemoval, as pkg/adaptation/result.go and
    # pkg/runtime-tools/generate/generate.go AdjustEnv read it)
    if key.startswith("-"):
        raise UnsafeEdit(f"env {key[:64]}: a name starting with '-' would remove "
                         f"{key[1:65]!r} from the container instead of setting it")
    if key in FORBIDDEN_ENV:
        raise UnsafeEdit(f"env {key} may not be set by nri-accel")


def path_size_problem(path: str) -> str:
    """Why `path` is too long to be a path nri-accel walks ("" if it is not): over
    MAX_PATH_BYTES bytes (the kernel's PATH_MAX) or MAX_PATH_COMPONENTS components.
    Checked before any filesystem walk, whose cost grows with the components."""
    if len(path) > MAX_PATH_BYTES or len(path.encode("utf-8", "surrogatepass")) \
            > MAX_PATH_BYTES:
        return f"is longer than {MAX_PATH_BYTES} bytes (PATH_MAX)"
    if path.count("/") > MAX_PATH_COMPONENTS:
        return f"has more than {MAX_PATH_COMPONENTS} components"
    return ""


def _check_path(path: str, what: str) -> None:
    # normpath keeps a leading "//" (POSIX leaves its meaning to the system), which would
    # let "//proc" past the prefix checks below: refused.
    too_long = path_size_problem(path)
    if too_long:
        raise UnsafeEdit(f"{what} {cut(path, 64)!r} {too_long}")
    _check_utf8(path, what)
    if not path.startswith("/") or path.startswith("//") or "\0" in path:
        raise UnsafeEdit(f"{what} {path[:128]!r} is not an absolute path")
    if ".." in path.split("/"):
        raise UnsafeEdit(f"{what} {path[:128]!r} contains '..'")
    if posixpath.normpath(path) != path:
        raise UnsafeEdit(f"{what} {path[:128]!r} is not a normalised path")


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def check_node_path(path: str, what: str = "device node") -> None:
    """A device node's path (in the container or on the host): absolute, normalised, under
    /dev; else UnsafeEdit."""
    _check_path(path, what)
    if not path.startswith("/dev/"):
        raise UnsafeEdit(f"{what} {path[:128]!r} is not under /dev")


def check_access(path: str, permissions: str) -> None:
    """A device node's cgroup access (CDI `permissions`, canonical "rwm" subset or
    "none") that nri-accel can honour through NRI, else UnsafeEdit (RUNTIME_ACCESS)."""
    if permissions != NO_ACCESS and (not permissions or set(permissions) - set("rwm")):
        raise UnsafeEdit(f"device node {path!r} has cgroup access {permissions!r} (not a "
                         "combination of r, w, m)")
    if not RUNTIME_ACCESS.issubset("" if permissions == NO_ACCESS else permissions):
        raise UnsafeEdit(f"device node {path!r} has cgroup access {permissions!r}; through "
                         "NRI the runtime allows read and write ('rw') whatever is asked, "
                         "which is wider: refused")


def check_node(n: DeviceNode) -> None:
    """A device node nri-accel may emit, else UnsafeEdit."""
    check_node_path(n.path)
    check_node_path(n.source, "device node host path")
    if n.type not in ("c", "b"):
        raise UnsafeEdit(f"device node {n.path!r} has type {n.type!r} (not c or b)")
    if n.major < 0 or n.minor < 0:
        raise UnsafeEdit(f"device node {n.path!r} has a wildcard major/minor")
    check_access(n.path, n.permissions)


def is_bind_mount(mount_type: str, options: Iterable[str]) -> bool:
    """Whether the runtime bind-mounts the source: option bind or rbind, whatever the type
    (runc: MS_BIND makes the type meaningless), or a type that only names a bind (CDI
    SPEC.md: "the type is a dummy, often none"; nri-accel adds "bind" to those)."""
    return mount_type in BIND_TYPES or not _BIND_OPTIONS.isdisjoint(options)


def check_mount(m: Mount) -> Mount:
    """The mount as nri-accel emits it (options forced), else UnsafeEdit.

    Two kinds pass. A bind mount (is_bind_mount): source and destination absolute and
    normalised, the source neither under nor holding a FORBIDDEN_SOURCES path, options
    without rw, suid, dev or shared propagation and with ro, nosuid, nodev and bind; type
    "bind". A tmpfs: its source is a name ("tmpfs"), not a host path; options from the
    tmpfs allow-list, always with nosuid and nodev (it may stay writable: it is the
    container's own memory, charged to its cgroup). Every other type is refused: it would
    mount a host block device, a kernel interface (proc, sysfs, cgroup, debugfs, bpf, ...),
    an overlay of host paths named in its options, or unaccounted memory (ramfs). For both,
    the destination is absolute, normalised, not / and not under /proc, /sys or a runtime
    socket's directory.
    """
    for text in (m.host_path, m.type, *m.options):
        _check_utf8(text, f"mount {m.container_path[:64]!r}:")
    bind = is_bind_mount(m.type, m.options)
    if bind and m.type not in BIND_TYPES:
        raise UnsafeEdit(f"mount {m.container_path!r} has type {m.type!r} and option "
                         f"{'bind' if 'bind' in m.options else 'rbind'!r}: the runtime would "
                         "bind-mount its source (a bind mount's type is bind, none "
                         "or empty)")
    if not bind and m.type != TMPFS:
        raise UnsafeEdit(f"mount {m.container_path!r} has type {m.type!r}: only bind mounts "
                         "and tmpfs are emitted")
    _check_path(m.container_path, "mount destination")
    if m.container_path == "/" or _under(m.container_path, FORBIDDEN_DESTINATIONS):
        raise UnsafeEdit(f"mount destination {m.container_path!r} is /, or under /proc "
                         "or /sys")
    if _under(m.container_path, RUNTIME_SOCKETS):
        raise UnsafeEdit(f"mount destination {m.container_path!r} is a container runtime "
                         "socket or its directory")
    if bind:
        check_mount_source(m.host_path)
        opts = [_NOT_RECURSIVE.get(o, o) for o in m.options if o not in _DROPPED_MOUNT_OPTIONS]
        opts += [o for o in REQUIRED_MOUNT_OPTIONS if o not in opts]
        if _BIND_OPTIONS.isdisjoint(opts):
            opts.append("bind")
        return Mount(m.host_path, m.container_path, "bind", tuple(opts))
    if not m.host_path or m.host_path.startswith("/") or "\0" in m.host_path:
        raise UnsafeEdit(f"tmpfs {m.container_path!r} has source {m.host_path[:128]!r}: a "
                         "tmpfs source is a name such as 'tmpfs', not a host path")
    opts = []
    for o in m.options:
        if o in _DROPPED_TMPFS_OPTIONS:
            continue
        if not _tmpfs_option(o):
            raise UnsafeEdit(f"tmpfs {m.container_path!r} has option {o[:64]!r}, which "
                             "nri-accel does not pass")
        opts.append(o)
    opts += [o for o in TMPFS_REQUIRED_OPTIONS if o not in opts]
    return Mount(m.host_path, m.container_path, TMPFS, tuple(opts))


def _tmpfs_option(option: str) -> bool:
    if option in _TMPFS_FLAGS:
        return True
    key, sep, value = option.partition("=")
    return bool(sep and value) and key in _TMPFS_VALUES and "," not in value \
        and "\0" not in value


def check_mount_source(path: str) -> None:
    """A bind mount's host path: absolute, normalised, neither under nor holding a
    FORBIDDEN_SOURCES path; else UnsafeEdit naming the path and why."""
    _check_path(path, "mount source")
    # One test for every root at once (an inventory has a hundred mounts, each checked
    # against some forty roots whenever an Engine is built); the loop below finds which
    # root to name.
    if not (path in FORBIDDEN_SOURCES or path.startswith(_UNDER_FORBIDDEN)
            or path.rstrip("/") in _HOLDING_FORBIDDEN):
        return
    for root, why in FORBIDDEN_SOURCES.items():
        if _under(path, (root,)):
            raise UnsafeEdit(f"mount source {path!r} is under {root}: {why}")
        if _under(root, (path,)):
            raise UnsafeEdit(f"mount source {path!r} holds {root}: {why}")


def _check_hook(h: Hook) -> Hook:
    _check_path(h.path, "hook path")
    for text in (*h.args, *h.env):
        _check_utf8(text, f"hook {h.path!r}:")
    for kv in h.env:
        if kv.partition("=")[0] in FORBIDDEN_ENV:
            raise UnsafeEdit(f"hook {h.path!r} sets {kv.partition('=')[0]}")
    return replace(h, env=h.env or HOOK_ENV, timeout=h.timeout or HOOK_TIMEOUT)


def _lib_dirs(mounts: Iterable[Mount]) -> tuple[str, ...]:
    dirs: dict[str, None] = {}
    for m in mounts:
        base = posixpath.basename(m.container_path)
        if base.startswith("lib") and (base.endswith(".so") or ".so." in base):
            dirs.setdefault(posixpath.dirname(m.container_path), None)
    return tuple(dirs)


# ---- build ----------------------------------------------------------------------------


class _Common(Struct, frozen=True):
    """The part of a container's edits that depends only on what it was granted (memoised
    per Catalog); build() adds what depends on the container itself."""

    nodes: tuple[DeviceNode, ...]
    mounts: tuple[Mount, ...]
    hooks: tuple[Hook, ...]
    gids: tuple[int, ...]
    env: tuple[tuple[str, str], ...]  # without LD_LIBRARY_PATH and the defaults
    defaults: tuple[tuple[str, str], ...]  # set only where the container does not
    env_keys: tuple[str, ...]  # "KEY=" of every variable above and LD_LIBRARY_PATH
    lib_dirs: tuple[str, ...]
    notes: tuple[str, ...]
    facts: tuple[tuple[str, str], ...]
    node_paths: frozenset[str]  # the nodes' paths (a container's own device replaces one)
    mount_paths: frozenset[str]  # the mounts' container paths (as its own mount does)


class Built(Struct, frozen=True):
    """One container's edits, and what was left out or noted."""

    edits: ContainerEdits
    notes: tuple[str, ...] = ()
    facts: tuple[tuple[str, str], ...] = ()  # per family, for the log line and explain


def build(selection: Selection, request: Request, catalog: Catalog, *,
          container_env: Iterable[str] = (),
          spec_devices: Mapping[str, tuple[str, int, int]] = MappingProxyType({}),
          mount_destinations: frozenset[str] = frozenset()) -> Built:
    """The edits for one container. Raises AllocationError for a refused inventory edit,
    RequestError for a container LD_LIBRARY_PATH too long to extend."""
    key = (selection.device_keys, request.options, request.drivers_only, request.visible)
    common = catalog.memo.get(key)
    if common is None:
        common = _common(selection, request, catalog)
        catalog.memo.put(key, common, request.chars, request.env, request.env_chars)

    nodes, mounts = common.nodes, common.mounts
    if not spec_devices.keys().isdisjoint(common.node_paths):
        nodes = _not_in_spec(nodes, spec_devices)
    if not mount_destinations.isdisjoint(common.mount_paths):
        mounts = tuple(m for m in mounts if m.container_path not in mount_destinations)
    # The container's own entries of the variables the edits set: with the grant, all
    # that the env added depends on. Remembered by them (a workload's containers share
    # their image's env): a hit skips reading them, extending LD_LIBRARY_PATH and sorting
    # what is added, a tenth of a grant's plan (bench_hotpath.py).
    keys = common.env_keys
    own = tuple([kv for kv in container_env if kv.startswith(keys)]) if keys else ()
    plain = nodes is common.nodes and mounts is common.mounts
    memo_key = (key, own)
    edits = catalog.edits.get(memo_key) if plain else None
    if edits is None:
        edits = ContainerEdits(env=_env_added(common, _own_env(own)), device_nodes=nodes,
                               mounts=mounts, hooks=common.hooks, additional_gids=common.gids)
        if plain:
            catalog.edits.put(memo_key, edits,
                              request.chars + sum(map(len, own)) + sum(map(len, edits.env)),
                              request.env, request.env_chars)
    return Built(edits, common.notes, common.facts)


def _not_in_spec(nodes: tuple[DeviceNode, ...],
                 spec_devices: Mapping[str, tuple[str, int, int]]) -> tuple[DeviceNode, ...]:
    """The granted `nodes` the container's spec does not have already. One at a path
    the spec has is left out where it is the same device (type, major, minor), and
    refused where the spec puts another device there: a CRI device mapping the host's
    /dev/nvidia5 to /dev/nvidia0 would stand in for GPU 0."""
    kept = []
    for n in nodes:
        there = spec_devices.get(n.path)
        if there is None:
            kept.append(n)
        elif there != (n.type, n.major, n.minor):
            raise RequestError(
                f"the container's spec already has {n.path} as {there[0]} "
                f"{there[1]}:{there[2]}, not the granted device's {n.type} "
                f"{n.major}:{n.minor}: one path is one device", source=f"device {n.path}")
    return tuple(kept)


def _common(selection: Selection, request: Request, catalog: Catalog) -> _Common:
    parts: list[ContainerEdits] = []
    notes: list[str] = []
    by_family: dict[str, list[Any]] = {}
    for d in selection.devices:
        q = d.qualified_name
        parts.append(take(catalog.devices.get(q, _UNCHECKED), q, notes))
        by_family.setdefault(family_of(d.kind).name, []).append(d)
    own = len(parts)  # parts[:own]: the devices' own edits; then what their families add

    env: dict[str, str] = {}
    defaults: dict[str, str] = {}
    lib_dirs: dict[str, None] = {}
    facts: list[tuple[str, str]] = []
    for profile in PROFILES:
        devices = by_family.get(profile.name, [])
        drivers_only = bool(profile.kinds) and vendor_of(profile.kinds[0]) in request.drivers_only
        if devices or drivers_only:
            fe = profile.edits(devices, request.option(profile.name), drivers_only,
                               catalog.files)
            parts.extend(fe.parts)
            for k, v in fe.env:
                env.setdefault(k, v)
            undeclared = {k for k, _ in fe.defaults} - profile.env_defaults
            if undeclared:  # a family's bug: build() might not see the container's value
                raise ValueError(f"family {profile.name} sets defaults it does not declare "
                                 f"in env_defaults: {', '.join(sorted(undeclared))}")
            defaults.update(fe.defaults)
            lib_dirs.update(dict.fromkeys(fe.lib_dirs))
            notes.extend(fe.notes)
            facts.extend(fe.facts)
        elif profile.visibility is not None and profile.name in request.visible:
            env.update(profile.nothing_env(request.option(profile.name)))

    merged = merge_edits(parts)
    count = _size(merged)
    if count > MAX_CONTAINER_EDITS:
        shown = ", ".join(d.qualified_name for d in selection.devices[:4])
        more = f" and {len(selection.devices) - 4} more" if len(selection.devices) > 4 else ""
        raise AllocationError(f"{shown}{more} add {count} device nodes, mounts, env entries "
                              f"and hooks, over the {MAX_CONTAINER_EDITS} nri-accel gives "
                              "one container: ask for fewer devices")
    for kv in merged.env:
        key, _, value = kv.partition("=")
        if key == LD_LIBRARY_PATH:
            lib_dirs.update(dict.fromkeys(p for p in value.split(":") if p))
        elif key not in defaults:
            env.setdefault(key, value)

    # Hooks as CDI orders them for devices of one spec (pkg/cdi cache.go InjectDevices):
    # the families' (a CDI spec's own edits) before the devices' own. With devices of
    # two specs, CDI interleaves them spec by spec (A's, A's devices', B's, ...); here
    # both specs' come first. For env, nodes and mounts the devices' own come first
    # here and win, as they do there by being applied last.
    # (Merged again only where there are hooks: almost no grant has any.)
    hooks = merged.hooks and merge_edits(ContainerEdits(hooks=p.hooks)
                                         for p in (*parts[own:], *parts[:own])).hooks
    if catalog.hook_path and lib_dirs:
        hooks = (*hooks, Hook(
            hook_name="createContainer",
            path=catalog.hook_path,
            args=(posixpath.basename(catalog.hook_path), "update-ldcache",
                  *(a for d in lib_dirs for a in ("--folder", d))),
            env=HOOK_ENV,
            timeout=HOOK_TIMEOUT,
        ))
    return _Common(
        nodes=tuple(sorted(merged.device_nodes, key=lambda n: natural_key(n.path))),
        mounts=tuple(sorted(merged.mounts, key=lambda m: m.container_path)),
        node_paths=frozenset(n.path for n in merged.device_nodes),
        mount_paths=frozenset(m.container_path for m in merged.mounts),
        hooks=hooks,
        gids=tuple(sorted(merged.additional_gids)),
        env=tuple(sorted(env.items())),
        defaults=tuple(sorted(defaults.items())),
        env_keys=tuple(f"{k}=" for k in sorted({*env, *defaults,
                                               *((LD_LIBRARY_PATH,) if lib_dirs else ())})),
        lib_dirs=tuple(lib_dirs),
        notes=tuple(notes),
        facts=tuple(facts),
    )


def _env_added(common: _Common, own_env: Mapping[str, str]) -> tuple[str, ...]:
    """The env entries the edits add to a container whose own values of their variables
    are `own_env`: LD_LIBRARY_PATH extended, the defaults it does not set, and no entry
    equal to one it has. Raises RequestError for an LD_LIBRARY_PATH too long to extend."""
    env = dict(common.env)
    if common.lib_dirs:
        own = own_env.get(LD_LIBRARY_PATH, "")
        if len(own) + len(LD_LIBRARY_PATH) + 1 >= MAX_ENV_STRING:
            raise RequestError(f"{len(own)} characters: nri-accel appends the driver's "
                               "library directory to it, and a variable of "
                               f"{MAX_ENV_STRING} bytes or more cannot be passed to a "
                               "process (the kernel's MAX_ARG_STRLEN)",
                               source=f"env {LD_LIBRARY_PATH}")
        env[LD_LIBRARY_PATH] = _join_path(own, common.lib_dirs)
    for k, v in common.defaults:
        if k not in own_env:
            env[k] = v
    return tuple(f"{k}={v}" for k, v in sorted(env.items()) if own_env.get(k) != v)


def _own_env(entries: Iterable[str]) -> dict[str, str]:
    """The values of the container's env `entries`. Raises RequestError for a variable
    defined twice: the runtime applies an adjustment's value of a variable to its first
    definition and keeps a later one as it is (containerd's NRI, generate.AdjustEnv), so
    what nri-accel writes or removes there would be undone (NVIDIA_VISIBLE_DEVICES=all
    after the void it writes, for a vendor hook installed beside it)."""
    out: dict[str, str] = {}
    for kv in entries:
        key, _, value = kv.partition("=")
        if key in out:
            raise RequestError("defined more than once in the container's env, which "
                               "nri-accel rewrites and the runtime would rewrite only "
                               "once: define it once", source=f"env {key}")
        out[key] = value
    return out


def _join_path(own: str, dirs: Iterable[str]) -> str:
    parts: dict[str, None] = {p: None for p in own.split(":") if p}
    for d in dirs:
        parts.setdefault(d, None)
    return ":".join(parts)
