"""Edits: what a Selection means for the container (device nodes, mounts, env, hooks).

Owns: the Catalog (every device's and driver capability's edits, checked and normalised
once per inventory), build() (Selection x Request x container -> ContainerEdits), the
safety rules for emitted paths, and the container env the edits write. Imports the
standard library, nri_accel.config, nri_accel.errors, nri_accel.inventory,
nri_accel.select and (for types) nri_accel.request. Pure: no I/O, no logging.

What a container gets:
- the device nodes of each granted device (a MIG device also gets its parent GPU's node);
- for each vendor used, that Driver's "" edits (what every container of the vendor needs,
  such as /dev/nvidiactl);
- NVIDIA (a GPU or MIG device granted, or NVIDIA_VISIBLE_DEVICES=none): the edits of
  each requested driver capability, and of "mig-config"/"mig-monitor" when asked;
  NVIDIA_VISIBLE_DEVICES rewritten to the UUIDs actually injected ("none" for none),
  NVIDIA_DRIVER_CAPABILITIES to the capabilities given;
- LD_LIBRARY_PATH: the container's own value followed by the directories the driver
  libraries are mounted in, without duplicates (libraries become loadable without
  running anything in the container's root filesystem);
- Neuron: AWS_NEURON_VISIBLE_DEVICES = the device indices (the oci-neuron-hook syntax)
  and NEURON_RT_VISIBLE_CORES = their NeuronCores in the runtime's node-wide numbering
  (device i's cores follow those of devices 0..i-1), as ranges "a-b" joined by commas;
  left alone when the container already sets it (the Neuron device plugin sets it for
  core-level allocations, narrower than the whole device);
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
fail the container). Output is deterministic: env sorted by name, nodes by path, mounts
by destination, gids ascending.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from nri_accel.config import DevicesConfig
from nri_accel.errors import AllocationError
from nri_accel.inventory import (
    KIND_GPU,
    KIND_MIG,
    KIND_NEURON,
    ContainerEdits,
    DeviceNode,
    Hook,
    Inventory,
    Mount,
    merge_edits,
    natural_key,
)
from nri_accel.select import Selection

if TYPE_CHECKING:
    from nri_accel.request import Request

NVIDIA = "nvidia"
BASE = ""  # the Driver capability every container using the vendor gets
MIG_CONFIG = "mig-config"
MIG_MONITOR = "mig-monitor"
NOT_CAPABILITIES = frozenset({BASE, MIG_CONFIG, MIG_MONITOR})
CAPABILITY_ORDER = ("utility", "compute", "video", "graphics", "display", "ngx", "compat32")

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
_NO_EDITS = ContainerEdits()


class UnsafeEdit(ValueError):
    """An inventory edit breaks a safety rule (message says which path and why)."""


@dataclass(frozen=True, slots=True)
class Checked:
    """One device's or capability's edits after checking: either edits or a refusal."""

    edits: ContainerEdits = _NO_EDITS
    refused: str = ""  # why these edits may not be emitted
    lib_dirs: tuple[str, ...] = ()  # container dirs holding mounted shared libraries
    dropped_hooks: int = 0  # hooks left out because devices.hooks is off


@dataclass(frozen=True, slots=True)
class Catalog:
    """Every edit the inventory can contribute, checked once (per inventory and config)."""

    devices: Mapping[str, Checked]  # qualified name -> its nodes (MIG: + parent GPU node)
    drivers: Mapping[tuple[str, str], Checked]  # (vendor, capability) -> edits
    vendors: Mapping[str, str]  # qualified name -> Driver vendor
    neuron_cores: Mapping[str, tuple[int, int]]  # qualified name -> (first core, count)
    hook_path: str  # the ld.so.cache hook binary; "" when no hook may be emitted
    # build()'s memo of the grant-dependent part of the edits, per grant.
    memo: dict[tuple[Any, ...], _Common] = field(default_factory=dict, compare=False,
                                                  repr=False)


_UNCHECKED = Checked(refused="the device is not in the catalog of this inventory")


def compile_catalog(inventory: Inventory, devices: DevicesConfig) -> Catalog:
    """Check and normalise every edit of `inventory` once."""
    hooks_enabled = devices.hooks
    by_name = {(d.kind, d.name): d for d in inventory.devices}
    dev_edits: dict[str, Checked] = {}
    vendors: dict[str, str] = {}
    for d in inventory.devices:
        edits = d.edits
        if d.kind == KIND_MIG and d.parent:
            parent = by_name.get((KIND_GPU, d.parent))
            if parent is not None:
                edits = edits.merged(ContainerEdits(device_nodes=parent.edits.device_nodes))
        dev_edits[d.qualified_name] = _check(edits, hooks_enabled)
        vendors[d.qualified_name] = d.vendor
    drv: dict[tuple[str, str], Checked] = {}
    for vendor, driver in inventory.drivers.items():
        for cap, edits in driver.capabilities.items():
            drv[(vendor, cap)] = _check(edits, hooks_enabled)
    cores: dict[str, tuple[int, int]] = {}
    first = 0
    for d in inventory.of_kind(KIND_NEURON):
        n = d.attributes.get("cores", "")
        if not n.isdigit():
            break  # numbering unknown from here on
        cores[d.qualified_name] = (first, int(n))
        first += int(n)
    return Catalog(
        devices=MappingProxyType(dev_edits),
        drivers=MappingProxyType(drv),
        vendors=MappingProxyType(vendors),
        neuron_cores=MappingProxyType(cores),
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
    env: tuple[tuple[str, str], ...]  # without LD_LIBRARY_PATH and NEURON_RT_VISIBLE_CORES
    lib_dirs: tuple[str, ...]
    neuron_cores: str  # "" when not known or no Neuron device
    notes: tuple[str, ...]


def build(selection: Selection, request: Request, catalog: Catalog, *,
          container_env: Iterable[str] = (), device_paths: frozenset[str] = frozenset(),
          mount_destinations: frozenset[str] = frozenset()
          ) -> tuple[ContainerEdits, tuple[str, ...]]:
    """The edits for one container and notes on what was left out. Raises AllocationError
    for a refused inventory edit.
    """
    key = (tuple((d.kind, d.name) for d in selection.devices), request.capabilities,
           request.nvidia_none, request.mig_config, request.mig_monitor)
    common = catalog.memo.get(key)
    if common is None:
        common = _common(selection, request, catalog)
        if len(catalog.memo) >= MEMO_SIZE:
            catalog.memo.clear()
        catalog.memo[key] = common

    own_env = _env_map(container_env)
    env = dict(common.env)
    if common.lib_dirs:
        env["LD_LIBRARY_PATH"] = _join_path(own_env.get("LD_LIBRARY_PATH", ""), common.lib_dirs)
    if common.neuron_cores and "NEURON_RT_VISIBLE_CORES" not in own_env:
        env["NEURON_RT_VISIBLE_CORES"] = common.neuron_cores
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
    return edits, common.notes


def _common(selection: Selection, request: Request, catalog: Catalog) -> _Common:
    parts: list[ContainerEdits] = []
    notes: list[str] = []
    lib_dirs: dict[str, None] = {}
    env: dict[str, str] = {}

    vendors: dict[str, None] = {}
    nvidia_uuids: list[str] = []
    neuron: list[str] = []
    for d in selection.devices:
        q = d.qualified_name
        parts.append(_take(catalog.devices.get(q, _UNCHECKED), q, notes))
        vendor = catalog.vendors.get(q, "")
        if vendor:
            vendors.setdefault(vendor, None)
        if d.kind in (KIND_GPU, KIND_MIG):
            nvidia_uuids.append(d.uuid or d.name)
        elif d.kind == KIND_NEURON:
            neuron.append(q)

    use_nvidia = bool(nvidia_uuids) or request.nvidia_none
    if use_nvidia:
        vendors.setdefault(NVIDIA, None)
    for vendor in vendors:
        parts.append(_driver(catalog, vendor, BASE, lib_dirs, notes))

    if use_nvidia:
        caps: tuple[str, ...] = ()
        if any(vendor == NVIDIA for vendor, _ in catalog.drivers):
            caps = _capabilities(catalog, request.capabilities, notes)
        else:
            notes.append("no NVIDIA driver files on this node: only device nodes and env")
        for cap in sorted(caps, key=_capability_order):
            parts.append(_driver(catalog, NVIDIA, cap, lib_dirs, notes))
        if request.mig_config:
            parts.append(_driver(catalog, NVIDIA, MIG_CONFIG, lib_dirs, notes))
        if request.mig_monitor:
            parts.append(_driver(catalog, NVIDIA, MIG_MONITOR, lib_dirs, notes))
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(nvidia_uuids) or "none"
        if caps:
            env["NVIDIA_DRIVER_CAPABILITIES"] = ",".join(caps)

    neuron_cores = ""
    if neuron:
        env["AWS_NEURON_VISIBLE_DEVICES"] = ",".join(q.partition("=")[2] for q in neuron)
        cores = [catalog.neuron_cores.get(q) for q in neuron]
        if all(c is not None for c in cores):
            neuron_cores = _core_ranges(c for c in cores if c is not None)

    merged = merge_edits(parts)
    for kv in merged.env:
        key, _, value = kv.partition("=")
        if key == "LD_LIBRARY_PATH":
            for part in value.split(":"):
                if part:
                    lib_dirs.setdefault(part, None)
        elif key != "NEURON_RT_VISIBLE_CORES":
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
        lib_dirs=tuple(lib_dirs),
        neuron_cores=neuron_cores,
        notes=tuple(notes),
    )


def _take(checked: Checked, source: str, notes: list[str]) -> ContainerEdits:
    if checked.refused:
        raise AllocationError(f"refused the inventory's edits: {checked.refused}", source=source)
    if checked.dropped_hooks:
        notes.append(f"{source}: {checked.dropped_hooks} hook(s) not emitted "
                     "(devices.hooks is off)")
    return checked.edits


def _driver(catalog: Catalog, vendor: str, cap: str, lib_dirs: dict[str, None],
            notes: list[str]) -> ContainerEdits:
    checked = catalog.drivers.get((vendor, cap))
    if checked is None:
        return ContainerEdits()
    where = f"driver {vendor}" + (f" capability {cap}" if cap else "")
    edits = _take(checked, where, notes)
    if vendor == NVIDIA:
        for d in checked.lib_dirs:
            lib_dirs.setdefault(d, None)
    return edits


def _capabilities(catalog: Catalog, requested: frozenset[str],
                  notes: list[str]) -> tuple[str, ...]:
    """The requested NVIDIA driver capabilities this driver has."""
    have = {cap for (vendor, cap) in catalog.drivers if vendor == NVIDIA} - NOT_CAPABILITIES
    wanted = requested - NOT_CAPABILITIES
    missing = sorted(wanted - have)
    if missing:
        notes.append(f"driver capabilities with no files on this node: {', '.join(missing)}")
    return tuple(sorted(wanted & have))


def _capability_order(cap: str) -> tuple[int, str]:
    """The order capabilities' files are merged in: 64-bit before compat32, so that
    LD_LIBRARY_PATH lists lib64 first."""
    return (CAPABILITY_ORDER.index(cap) if cap in CAPABILITY_ORDER else len(CAPABILITY_ORDER),
            cap)


def _env_map(env: Iterable[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for kv in env:
        key, _, value = kv.partition("=")
        out[key] = value
    return out


def _join_path(own: str, dirs: Iterable[str]) -> str:
    parts: dict[str, None] = {p: None for p in own.split(":") if p}
    for d in dirs:
        parts.setdefault(d, None)
    return ":".join(parts)


def _core_ranges(cores: Iterable[tuple[int, int]]) -> str:
    ids = sorted({c for first, n in cores for c in range(first, first + n)})
    ranges: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        ranges.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(ranges)
