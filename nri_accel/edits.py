"""Edits: what a Selection means for the container (device nodes, mounts, env, hooks).

Owns: the Catalog (every device's and driver capability's edits, checked and normalised
once per inventory, and each family's tables), build() (Selection x Request x container
-> ContainerEdits: the final order, de-duplicated once), the safety rules for emitted
paths, and the container env the edits write. Imports the standard library,
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
  that variable rewritten to the family's "nothing" value or removed, so a co-installed
  vendor hook cannot widen the grant;
- LD_LIBRARY_PATH: the container's own value followed by the directories the driver
  libraries are mounted in, without duplicates (libraries become loadable without
  running anything in the container's root filesystem); a container value too long to
  extend (MAX_ENV_STRING, the kernel's limit on one env string) is refused;
- CDI devices: their device edits plus their spec's container edits (Driver "cdi:...").
- Hooks: none by default. With config devices.hooks and hook_path, one createContainer
  hook `<hook_path> update-ldcache --folder DIR...` (the nvidia-cdi-hook syntax) with
  PATH as its only env and a timeout; hooks that come with CDI specs are emitted only when
  devices.hooks is on. A hook never receives anything from the container's env.

Safety (defence in depth: discovery already guarantees it, a hand-written inventory JSON
may not): every path is absolute, normalised and free of "..", device nodes live under
/dev with a real major/minor and cgroup access within "rwm", mounts are bind mounts that
always carry ro, nosuid, nodev, no mount lands on / or under /proc or /sys, nothing
mounts a runtime socket or a directory holding one (a read-only bind of a socket still
lets a process connect to it), and inventory env may not set LD_PRELOAD or LD_AUDIT. An
edit breaking these is refused when a container needs it, with an AllocationError naming
the device or capability; other containers are unaffected. Device nodes and mounts
already in the container spec are not emitted again (two NRI plugins setting one path
fail the container). Output is deterministic: env sorted by name, nodes by path in
natural order, mounts by destination, gids ascending; nri.adjust keeps that order.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from operator import methodcaller
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from nri_accel.errors import RequestError
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
from nri_accel.select import Selection
from nri_accel.vendors import PROFILES, family_of
from nri_accel.vendors.base import Checked, DriverFiles, take

if TYPE_CHECKING:
    from nri_accel.config import DevicesConfig
    from nri_accel.policy import Request

HOOK_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
HOOK_TIMEOUT = 10  # seconds
REQUIRED_MOUNT_OPTIONS = ("ro", "nosuid", "nodev")
_DROPPED_MOUNT_OPTIONS = frozenset({"rw", "suid", "dev"})
FORBIDDEN_DESTINATIONS = ("/proc", "/sys")
RUNTIME_SOCKETS = (
    "/run/containerd", "/var/run/containerd", "/run/crio", "/var/run/crio",
    "/run/docker.sock", "/var/run/docker.sock", "/run/docker", "/var/run/docker",
    "/run/nri", "/var/run/nri", "/run/podman", "/var/run/podman",
    "/run/cri-dockerd.sock", "/var/run/cri-dockerd.sock", "/var/run/dockershim.sock",
)
FORBIDDEN_ENV = frozenset({"LD_PRELOAD", "LD_AUDIT"})
MEMO_SIZE = 4096  # grants remembered per inventory before the memo starts over
LD_LIBRARY_PATH = "LD_LIBRARY_PATH"
# The longest "KEY=VALUE" string execve(2) accepts (MAX_ARG_STRLEN, 32 pages): a longer
# LD_LIBRARY_PATH could not reach the container's process anyway, and extending one
# costs time in proportion to its length, so it is refused before any work.
MAX_ENV_STRING = 32 * 4096


class UnsafeEdit(ValueError):
    """An inventory edit breaks a safety rule (message says which path and why)."""


@dataclass(frozen=True, slots=True)
class Catalog:
    """Every edit the inventory can contribute, checked once (per inventory and config)."""

    devices: Mapping[str, Checked]  # qualified name -> its device edits
    files: DriverFiles  # (vendor, capability) -> driver edits; the families' tables
    hook_path: str  # the ld.so.cache hook binary; "" when no hook may be emitted
    # build()'s memo of the grant-dependent part of the edits, per grant.
    memo: dict[tuple[Any, ...], _Common] = field(default_factory=dict, compare=False,
                                                  repr=False)


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
    for kv in edits.env:
        key, sep, _ = kv.partition("=")
        if not sep or not key or "\0" in kv:
            raise UnsafeEdit(f"env entry {kv[:64]!r} is not KEY=VALUE")
        if key in FORBIDDEN_ENV:
            raise UnsafeEdit(f"env {key} may not be set by nri-accel")
    for n in edits.device_nodes:
        _check_node(n)
    mounts = tuple(_check_mount(m) for m in edits.mounts)
    hooks: tuple[Hook, ...] = ()
    if hooks_enabled:
        hooks = tuple(_check_hook(h) for h in edits.hooks)
    return replace(edits, mounts=mounts, hooks=hooks)


def _check_path(path: str, what: str) -> None:
    # normpath keeps a leading "//" (POSIX leaves its meaning to the system), which would
    # let "//proc" past the prefix checks below: refused.
    if not path.startswith("/") or path.startswith("//") or "\0" in path:
        raise UnsafeEdit(f"{what} {path[:128]!r} is not an absolute path")
    if ".." in path.split("/"):
        raise UnsafeEdit(f"{what} {path[:128]!r} contains '..'")
    if posixpath.normpath(path) != path:
        raise UnsafeEdit(f"{what} {path[:128]!r} is not a normalised path")


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _check_node(n: DeviceNode) -> None:
    for p, what in ((n.path, "device node"), (n.source, "device node host path")):
        _check_path(p, what)
        if not p.startswith("/dev/"):
            raise UnsafeEdit(f"{what} {p!r} is not under /dev")
    if n.type not in ("c", "b"):
        raise UnsafeEdit(f"device node {n.path!r} has type {n.type!r} (not c or b)")
    if n.major < 0 or n.minor < 0:
        raise UnsafeEdit(f"device node {n.path!r} has a wildcard major/minor")
    if not n.permissions or set(n.permissions) - set("rwm"):
        raise UnsafeEdit(f"device node {n.path!r} has cgroup access {n.permissions!r}")


def _check_mount(m: Mount) -> Mount:
    if m.type not in ("bind", ""):
        raise UnsafeEdit(f"mount {m.container_path!r} has type {m.type!r}: only bind mounts")
    _check_path(m.host_path, "mount source")
    _check_path(m.container_path, "mount destination")
    if m.container_path == "/" or _under(m.container_path, FORBIDDEN_DESTINATIONS):
        raise UnsafeEdit(f"mount destination {m.container_path!r} is /, or under /proc "
                         "or /sys")
    if _under(m.host_path, ("/proc",)):
        raise UnsafeEdit(f"mount source {m.host_path!r} is under /proc")
    for p in (m.host_path, m.container_path):
        if _under(p, RUNTIME_SOCKETS):
            raise UnsafeEdit(f"mount {p!r} is a container runtime socket or its directory")
    if any(_under(s, (m.host_path,)) for s in RUNTIME_SOCKETS):
        raise UnsafeEdit(f"mount source {m.host_path!r} holds a container runtime socket")
    opts = [o for o in m.options if o not in _DROPPED_MOUNT_OPTIONS]
    opts += [o for o in REQUIRED_MOUNT_OPTIONS if o not in opts]
    if "bind" not in opts and "rbind" not in opts:
        opts.append("bind")
    return Mount(m.host_path, m.container_path, "bind", tuple(opts))


def _check_hook(h: Hook) -> Hook:
    _check_path(h.path, "hook path")
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


@dataclass(frozen=True, slots=True)
class _Common:
    """The part of a container's edits that depends only on what it was granted (memoised
    per Catalog); build() adds what depends on the container itself."""

    nodes: tuple[DeviceNode, ...]
    mounts: tuple[Mount, ...]
    hooks: tuple[Hook, ...]
    gids: tuple[int, ...]
    env: tuple[tuple[str, str], ...]  # without LD_LIBRARY_PATH and the defaults
    defaults: tuple[tuple[str, str], ...]  # set only where the container does not
    unset: tuple[str, ...]  # removed where the container sets them
    env_keys: tuple[str, ...]  # "KEY=" of every variable above and LD_LIBRARY_PATH
    lib_dirs: tuple[str, ...]
    notes: tuple[str, ...]
    facts: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Built:
    """One container's edits, what its env loses, and what was left out or noted."""

    edits: ContainerEdits
    unset_env: tuple[str, ...] = ()  # variables to remove from the container's env
    notes: tuple[str, ...] = ()
    facts: tuple[tuple[str, str], ...] = ()  # per family, for the log line and explain


def build(selection: Selection, request: Request, catalog: Catalog, *,
          container_env: Iterable[str] = (), device_paths: frozenset[str] = frozenset(),
          mount_destinations: frozenset[str] = frozenset()) -> Built:
    """The edits for one container. Raises AllocationError for a refused inventory edit,
    RequestError for a container LD_LIBRARY_PATH too long to extend."""
    key = (tuple(d.key for d in selection.devices), request.options, request.drivers_only,
           request.visible)
    common = catalog.memo.get(key)
    if common is None:
        common = _common(selection, request, catalog)
        if len(catalog.memo) >= MEMO_SIZE:
            catalog.memo.clear()
        catalog.memo[key] = common

    own_env = _own_env(container_env, common.env_keys)
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
    nodes, mounts = common.nodes, common.mounts
    if device_paths:
        nodes = tuple(n for n in nodes if n.path not in device_paths)
    if mount_destinations:
        mounts = tuple(m for m in mounts if m.container_path not in mount_destinations)
    edits = ContainerEdits(
        env=tuple(f"{k}={v}" for k, v in sorted(env.items()) if own_env.get(k) != v),
        device_nodes=nodes,
        mounts=mounts,
        hooks=common.hooks,
        additional_gids=common.gids,
    )
    return Built(edits, tuple(k for k in common.unset if k in own_env), common.notes,
                 common.facts)


def _common(selection: Selection, request: Request, catalog: Catalog) -> _Common:
    parts: list[ContainerEdits] = []
    notes: list[str] = []
    by_family: dict[str, list[Any]] = {}
    for d in selection.devices:
        q = d.qualified_name
        parts.append(take(catalog.devices.get(q, _UNCHECKED), q, notes))
        by_family.setdefault(family_of(d.kind).name, []).append(d)

    env: dict[str, str] = {}
    defaults: dict[str, str] = {}
    unset: list[str] = []
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
            defaults.update(fe.defaults)
            lib_dirs.update(dict.fromkeys(fe.lib_dirs))
            notes.extend(fe.notes)
            facts.extend(fe.facts)
        elif profile.visibility is not None and profile.name in request.visible:
            var, nothing = profile.visibility
            if nothing is None:
                unset.append(var)
            else:
                env[var] = nothing

    merged = merge_edits(parts)
    for kv in merged.env:
        key, _, value = kv.partition("=")
        if key == LD_LIBRARY_PATH:
            lib_dirs.update(dict.fromkeys(p for p in value.split(":") if p))
        elif key not in defaults:
            env.setdefault(key, value)

    hooks = merged.hooks
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
        hooks=hooks,
        gids=tuple(sorted(merged.additional_gids)),
        env=tuple(sorted(env.items())),
        defaults=tuple(sorted(defaults.items())),
        unset=tuple(unset),
        env_keys=tuple(f"{k}=" for k in sorted({*env, *defaults, *unset,
                                               *((LD_LIBRARY_PATH,) if lib_dirs else ())})),
        lib_dirs=tuple(lib_dirs),
        notes=tuple(notes),
        facts=tuple(facts),
    )


def _own_env(env: Iterable[str], keys: tuple[str, ...]) -> dict[str, str]:
    """The container's values of the variables `keys` ("KEY=" prefixes), the last
    definition winning. The entries are filtered in C (str.startswith with a tuple): an
    env of tens of thousands of entries costs a few milliseconds, not a Python loop."""
    out: dict[str, str] = {}
    if keys:
        for kv in filter(methodcaller("startswith", keys), env):
            key, _, value = kv.partition("=")
            out[key] = value
    return out


def _join_path(own: str, dirs: Iterable[str]) -> str:
    parts: dict[str, None] = {p: None for p in own.split(":") if p}
    for d in dirs:
        parts.setdefault(d, None)
    return ":".join(parts)
