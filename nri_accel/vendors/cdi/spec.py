"""CDI (Container Device Interface) spec files: read them into devices, write them out.

Owns: discover_cdi(root, spec_dirs) -> Found (reading, validation, priorities),
generate_specs(inventory) / render_spec(spec) / spec_file_name(kind) (writing), and
min_version(spec), the CDI version a spec's content needs. Imports the standard
library, msgspec, PyYAML, nri_accel.edits (the safety rules), nri_accel.errors,
nri_accel.inventory, nri_accel.log, nri_accel.discover.{base, hostroot} and, to write
specs, nri_accel.vendors. Facts from cncf-tags/container-device-interface (SPEC.md,
pkg/cdi container-edits.go, pkg/parser, specs-go/config.go and version.go).

Reading follows what containerd and CRI-O do through pkg/cdi:

- Spec files are the `*.json` and `*.yaml` files directly inside each spec directory
  (subdirectories skipped), in name order. Directories come in priority order: a later
  directory wins (the default `/etc/cdi`, `/var/run/cdi` lets generated specs override
  static ones). A device defined at the same highest priority by two files is a
  conflict: it is dropped, with a Problem on both files. Lower-priority duplicates are
  shadowed silently, as upstream does.
- Ownership (stricter than upstream, which reads any file there): a spec directory, a
  spec file and the directory a symlinked spec file leads to must be owned by root (or
  the user nri-accel runs as) and writable by no group or others (sticky or not); else
  the directory or file is a Problem and not read. Its mounts, device nodes and hooks
  are applied with the runtime's privileges.
- Parsing is strict: unknown fields are errors. `cdiVersion` must be a released
  version from 0.3.0 (the first with `containerEdits`) to 1.1.0 and at least the
  version the content needs (specs-go/version.go: a mount `type`, so any tmpfs, 0.4.0;
  `hostPath` on a device node or a device name starting with a digit 0.5.0; annotations
  or a dot in the class 0.6.0; `additionalGids` 0.7.0; device `permissions`, "none"
  included, are in every version). `intelRdt` and `netDevices` are rejected: nri-accel
  cannot apply them through NRI, and a device granted without them would be wrong.
- Well-formed CDI: kind `vendor/class` and device names with the upstream character
  rules, non-empty edits per device, `KEY=VALUE` env, known hook names, absolute paths
  without `..` (a bind mount's `hostPath` included), device `permissions` as pkg/cdi
  reads them ("" is "rwm", "none" an empty rule, else r, w, m in any order and number,
  kept as the canonical subset of "rwm"). A malformed file is one Problem naming the
  file and the field; it never stops the other files.
- Mounts: a bind mount (option bind or rbind, or type bind, none or none given) keeps
  the options the spec gives (spec files are host configuration, owned by root like the
  runtime's); one with none gets nri-accel's default, read-only `nosuid,nodev` bind. Any
  other mount is a filesystem of its `type` whose `hostPath` is its source, a name such
  as "tmpfs" (SPEC.md), kept with its options (none: `nosuid,nodev`).
- What may be emitted is not decided here: nri_accel.edits' rules (check_env,
  check_node_path, check_access, check_mount, check_mount_source: the ones the catalog
  applies again) are called on every env entry, node and mount, and on the target of a
  bind source that is a symlink (the runtime follows it). A refusal in a device's edits
  leaves that device out with a Problem naming the file and field (a node asking for
  cgroup access "r", a mount of /var/lib/kubelet, a `proc` mount, ...); in the spec's
  own edits it makes the file unusable, since every device would carry it.
- Device nodes are host nodes: type, major and minor come from lstat of the host node
  (symlinks refused); numbers written in the spec must agree with it. A missing node
  drops that device (or, for a spec-level node, the whole file) with a Problem.

Each CDI device becomes a Device (kind and name from the spec, edits = its
containerEdits, attribute origin = the spec file's host path). A spec's own
containerEdits become a Driver named `cdi:<spec file host path>` (version = the
spec's cdiVersion) with capabilities {"": edits}, and its devices point at it through
Device.vendor, so the edits stage merges them whenever one of its devices is granted:
one driver per file, because spec-level edits belong to the file that declares them.
A device named `all` is not listed: `kind=all` is the request keyword for every device
of a kind, and granting each device gives what the composite one would. Hooks are kept
as written; whether a hook may be emitted is the edits stage's decision.

Writing (`nri-accel cdi generate`): one spec per device kind of each native family
(NVIDIA, Neuron, ...), each device's edits (a MIG instance's include its parent GPU's
node) as device edits, plus the composite device `all` with all of them merged (a
runtime's own CDI injection resolves `nvidia.com/gpu=all` to a device of that name, as
nvidia-ctk and amd-ctk write it), and as spec edits the driver files its family adds for
the default request (NVIDIA: the driver's "" edits plus utility and compute, the default
of NVIDIA_DRIVER_CAPABILITIES). `cdiVersion` is the lowest
version the content needs (min_version; 0.5.0 for names such as "0"), not the newest:
containerd 1.7 and CRI-O 1.26 ship CDI libraries that reject versions newer than they
know, and every version from 0.5.0 is accepted by both.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import PurePosixPath
from types import MappingProxyType
from typing import Any

import yaml
from msgspec import Struct
from msgspec.structs import replace

from nri_accel.discover.base import Found, host_device_node
from nri_accel.discover.hostroot import HostRoot, walk_in_root
from nri_accel.edits import (
    NO_ACCESS,
    TMPFS_REQUIRED_OPTIONS,
    UnsafeEdit,
    check_access,
    check_edit_count,
    check_env,
    check_mount,
    check_mount_source,
    check_node_path,
    is_bind_mount,
    path_size_problem,
)
from nri_accel.errors import DiscoveryError, cut
from nri_accel.files import UnreadableFile, read_regular
from nri_accel.inventory import (
    ContainerEdits,
    Device,
    DeviceNode,
    Driver,
    Hook,
    Inventory,
    Mount,
    Problem,
    is_device_name,
    merge_edits,
)
from nri_accel.log import get_logger

log = get_logger(__name__)

SPEC_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
EARLIEST_VERSION = "0.3.0"
DRIVER_PREFIX = "cdi:"
MAX_SPEC_BYTES = 4 << 20
# A spec of nvidia-ctk for 8 GPUs with every MIG profile holds some 2,000 YAML nodes and
# 64 devices; these bound the work a hostile or broken spec under MAX_SPEC_BYTES costs
# (4 MiB of "[a,a,...]" is 2 million nodes: 15 s and 800 MB composed).
MAX_SPEC_NODES = 100_000  # per file: scalars, sequences, mappings, aliases
MAX_SPEC_DEVICES = 1024  # per file: the rest are left out with a Problem
MAX_SPEC_FILES = 1024  # in all the spec directories: the rest are not read (a Problem)
CACHE_NODES = 500_000  # parsed specs kept between discoveries, counted in nodes
MAX_SHOWN = 64  # characters of a spec's value quoted in a message
ALL_DEVICE = "all"  # the composite device, every device of the spec's kind
HOOK_NAMES = frozenset({"prestart", "createRuntime", "createContainer", "startContainer",
                        "poststart", "poststop"})

_QUALIFIER_CHARS = re.compile(r"^[A-Za-z0-9_.-]*$")
_SPEC_KEYS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
_DEVICE_KEYS = {"name", "annotations", "containerEdits"}
_EDITS_KEYS = {"env", "deviceNodes", "hooks", "mounts", "additionalGids", "intelRdt",
               "netDevices"}
_NODE_KEYS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions",
              "uid", "gid"}
_MOUNT_KEYS = {"hostPath", "containerPath", "options", "type"}
_HOOK_KEYS = {"hookName", "path", "args", "env", "timeout"}
_UINT32_MAX = 2**32 - 1


class SpecError(Exception):
    """A spec file is invalid; the message names the field (JSON path) and the fault."""


# ---- reading ------------------------------------------------------------------------


class _Spec(Struct, frozen=True):
    path: str  # host path of the file
    priority: int
    kind: str
    devices: tuple[Device, ...]
    driver: Driver | None


class _ParseCache:
    """Parsed spec files by (host root, host path), each with the identity of the file it
    was read from (device, inode, size, mtime, ctime): a rediscovery parses again only
    what changed (a refresh re-reads every spec when any one changes). What depends on
    the host besides the file (device nodes, mount sources) is checked again each time.
    Bounded: at most CACHE_NODES nodes (the oldest go first), and each discovery drops
    the files its directories no longer list. Thread-safe (a refresh runs in a worker
    thread)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], tuple[tuple[int, ...], Any, str, int]] = {}
        self._nodes = 0
        self._lock = threading.Lock()
        self.parses = 0  # files parsed since start (tests count them)

    def parsed(self, root: str, host_path: str, st: os.stat_result,
               parse: Callable[[], tuple[Any, int]]) -> Any:
        """The raw spec of the file `st` describes, parsed once while it is unchanged;
        raises the SpecError its parse raised."""
        key = (root, host_path)
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and hit[0] == ident:
            raw, error = hit[1], hit[2]
        else:
            self.parses += 1
            try:
                raw, nodes = parse()
                error = ""
            except SpecError as e:
                raw, error, nodes = None, str(e), 1
            self._store(key, (ident, raw, error, nodes))
        if error:
            raise SpecError(error)
        return raw

    def _store(self, key: tuple[str, str],
               entry: tuple[tuple[int, ...], Any, str, int]) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._nodes -= old[3]
            if entry[3] > CACHE_NODES:
                return
            while self._entries and self._nodes + entry[3] > CACHE_NODES:
                self._nodes -= self._entries.pop(next(iter(self._entries)))[3]
            self._entries[key] = entry
            self._nodes += entry[3]

    def forget(self, root: str, keep: set[str]) -> None:
        """Drop the entries of `root` whose file is not in `keep` (vanished files)."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == root and k[1] not in keep]:
                self._nodes -= self._entries.pop(key)[3]

    def __len__(self) -> int:
        return len(self._entries)


_CACHE = _ParseCache()


def discover_cdi(root: HostRoot, spec_dirs: Sequence[str]) -> Found:
    """Every valid CDI device in `spec_dirs` (host paths, later directories win)."""
    problems: list[Problem] = []
    specs: list[_Spec] = []
    seen: set[str] = set()
    budget = MAX_SPEC_FILES
    for priority, spec_dir in enumerate(spec_dirs):
        names, why = _list_spec_dir(root, spec_dir)
        if why:
            problems.append(Problem(spec_dir, f"spec directory cannot be read: {why}"))
        names = [n for n in names if n.endswith((".json", ".yaml"))]
        if len(names) > budget:
            problems.append(Problem(spec_dir, (
                f"{len(names) - budget} spec file(s) not read (from {_shown(names[budget])} "
                f"on): nri-accel reads at most {MAX_SPEC_FILES} in all its spec directories")))
            names = names[:budget]
        budget -= len(names)
        for name in names:
            host_path = str(PurePosixPath(spec_dir) / name)
            seen.add(host_path)
            try:
                loaded = _load_spec(root, host_path, priority)
            except SpecError as e:
                # A Problem in the Inventory: the daemon logs it when it first appears.
                problems.append(Problem(host_path, str(e)))
                log.debug("cdi_spec_invalid", path=host_path, error=str(e))
                continue
            if loaded is not None:
                specs.append(loaded[0])
                problems += loaded[1]
    _CACHE.forget(root.root, seen)

    candidates: dict[str, list[tuple[_Spec, Device]]] = {}
    for spec in specs:
        for d in spec.devices:
            candidates.setdefault(d.qualified_name, []).append((spec, d))
    kept: list[Device] = []
    used: set[str] = set()
    for qualified, entries in candidates.items():
        top = max(s.priority for s, _ in entries)
        winners = [(s, d) for s, d in entries if s.priority == top]
        if len(winners) > 1:
            paths = sorted(s.path for s, _ in winners)
            for p in paths:
                others = ", ".join(o for o in paths if o != p)
                problems.append(Problem(p, f"device {qualified} is also defined in {others} "
                                           "(same priority): it is left out"))
            continue
        spec, device = winners[0]
        for s, _ in entries:
            if s is not spec:
                log.info("cdi_device_shadowed", device=qualified, used=spec.path, ignored=s.path)
        kept.append(device)
        used.add(spec.path)
    drivers = tuple(s.driver for s in specs if s.driver is not None and s.path in used)
    return Found(devices=tuple(kept), drivers=drivers,
                 problems=tuple(sorted(problems, key=lambda p: (p.source, p.message))))


def _list_spec_dir(root: HostRoot, spec_dir: str) -> tuple[list[str], str]:
    """The entries of a spec directory, in name order, and why it cannot be listed: ""
    when it can or does not exist (a missing directory holds no spec, as upstream)."""
    try:
        # Its symlinks followed inside the host root, as the host sees them.
        local = root.local(root.resolve(spec_dir))
        who = _writers(os.stat(local))
        if who:
            return [], f"{who}: its specs could grant any host path or hook"
        return sorted(os.listdir(local)), ""
    except FileNotFoundError:
        return [], ""
    except OSError as e:  # a symlink loop (ELOOP), not a directory, no permission
        return [], e.strerror or str(e)
    except ValueError as e:  # HostRoot refused the path, or the OS cannot take it
        return [], str(e)


def _load_spec(root: HostRoot, host_path: str,
               priority: int) -> tuple[_Spec, list[Problem]] | None:
    found = _stat_spec_file(root, host_path)
    if found is None:
        return None
    local, st = found
    raw = _CACHE.parsed(root.root, host_path, st, lambda: _parse(
        _read_spec_file(local), host_path))
    return _build_spec(root, raw, host_path, priority)


def _parse(text: str, host_path: str) -> tuple[Any, int]:
    """The raw spec and its size in nodes (for JSON, an upper bound); SpecError when it
    is not valid JSON or YAML or holds more than MAX_SPEC_NODES nodes."""
    fmt = "JSON" if host_path.endswith(".json") else "YAML"
    try:
        if host_path.endswith(".json"):
            # Every node but the first follows a ',' or ':' or opens a '[' or '{' (in a
            # string too: an upper bound), counted in C before anything is built.
            nodes = 1 + sum(text.count(c) for c in ",:[{")
            if nodes > MAX_SPEC_NODES:
                raise SpecError(_TOO_BIG)
            raw = json.loads(text)
        else:
            nodes = _check_yaml(text)
            raw = yaml.load(text, Loader=_YAML_LOADER)
    except (ValueError, yaml.YAMLError) as e:
        raise SpecError(f"not valid {fmt}: {cut(_one_line(e), 200)}") from e
    except RecursionError:
        raise SpecError(f"not valid {fmt}: nested too deeply") from None
    return raw, nodes


def _stat_spec_file(root: HostRoot, host_path: str) -> tuple[str, os.stat_result] | None:
    """The local path of a spec file (a symlink followed one level inside the host root)
    and its lstat; None for a directory (skipped, as upstream does)."""
    try:
        local = root.local(host_path)
        st = os.lstat(local)
        if stat.S_ISLNK(st.st_mode):
            # Followed one level inside the host root, as the kernel follows it when the
            # runtime reads the spec: an absolute target names a host path, a relative
            # one goes on from the directory the link is really in (reached through
            # links itself: /etc/cdi -> /opt/vendor/cdi).
            target_host = walk_in_root(root.root or "/", os.readlink(local),
                                       start=root.resolve(os.path.dirname(host_path)),
                                       follow_last=False, must_exist=False)
            local = root.local(target_host)
            st = os.lstat(local)
            if stat.S_ISLNK(st.st_mode):
                raise SpecError(f"symlink to a symlink ({target_host}) is not followed")
        if stat.S_ISDIR(st.st_mode):
            return None
        if not stat.S_ISREG(st.st_mode):
            raise SpecError("not a regular file")
        who = _writers(st)
        if not who and local != root.local(host_path):  # the directory the link leads to
            who = _writers(os.stat(os.path.dirname(local)))
        if who:
            raise SpecError(f"{who}: not read (a spec grants host paths and hooks)")
        if st.st_size > MAX_SPEC_BYTES:
            raise SpecError(f"larger than {MAX_SPEC_BYTES} bytes")
    except OSError as e:
        raise SpecError(f"cannot read: {e.strerror or e}") from e
    except ValueError as e:  # HostRoot refused the path ('..')
        raise SpecError(str(e)) from e
    return local, st


def _writers(st: os.stat_result) -> str:
    """Who besides root (or this process's user) could write the spec file or directory
    `st` describes, as a refusal's text; "" when no one could. A spec is host
    configuration like the runtime's: its mounts and hooks run with the runtime's
    privileges, so a file an unprivileged user wrote (or could rewrite, or plant in a
    writable directory, even a sticky one) would hand host files and root hooks to
    every container granted its devices."""
    if st.st_uid not in (0, os.geteuid()):
        return f"owned by uid {st.st_uid}, not by root"
    if st.st_mode & 0o022:
        return f"writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def _read_spec_file(local: str) -> str:
    """The text of a regular file found by _stat_spec_file."""
    try:  # what _stat_spec_file found may have been replaced since (by a FIFO): checked again
        data = read_regular(local, MAX_SPEC_BYTES, follow=False)
    except UnreadableFile as e:
        raise SpecError(str(e.strerror)) from e
    except OSError as e:
        raise SpecError(f"cannot read: {e.strerror or e}") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"not UTF-8: {e.reason} at byte {e.start}") from e


def _build_spec(root: HostRoot, raw: Any, host_path: str,
                priority: int) -> tuple[_Spec, list[Problem]]:
    """The validated spec and a Problem for each device whose host nodes are unusable."""
    if not isinstance(raw, dict):
        raise SpecError("the spec must be a mapping with cdiVersion, kind and devices")
    _no_unknown(raw, _SPEC_KEYS, "")
    version = _string(raw, "cdiVersion", "", required=True)
    if version.removeprefix("v") not in SPEC_VERSIONS:
        raise SpecError(f"cdiVersion: {_shown(version)} is not a CDI version nri-accel reads "
                        f"({', '.join(SPEC_VERSIONS)})")
    kind = _string(raw, "kind", "", required=True)
    _check_kind(kind)
    _annotations(raw.get("annotations"), "annotations")
    raw_devices = raw.get("devices")
    if not isinstance(raw_devices, list) or not raw_devices:
        raise SpecError("devices: a spec must define at least one device")
    problems: list[Problem] = []
    # The composite `all` is not listed (module docstring), so not counted: `cdi generate`
    # writes it beside as many as MAX_SPEC_DEVICES devices of a kind.
    cap = MAX_SPEC_DEVICES + any(isinstance(d, dict) and d.get("name") == ALL_DEVICE
                                 for d in raw_devices[:MAX_SPEC_DEVICES + 1])
    if len(raw_devices) > cap:
        problems.append(Problem(host_path, (
            f"devices[{cap}:]: {len(raw_devices) - cap} devices left out: nri-accel reads "
            f"at most {MAX_SPEC_DEVICES} devices per spec, and the composite {ALL_DEVICE!r}")))
        raw_devices = raw_devices[:cap]
        raw = {**raw, "devices": raw_devices}  # a copy: `raw` may be the cache's

    spec_edits = _edits(root, raw.get("containerEdits"), "containerEdits", device_level=False)
    parsed: list[tuple[str, _RawEdits, str]] = []
    names: set[str] = set()
    for where, rd in _mappings(raw_devices, "devices", _DEVICE_KEYS):
        name = _string(rd, "name", where, required=True)
        _check_device_name(name, f"{where}.name")
        if name in names:
            raise SpecError(f"{where}.name: device {_shown(name)} is defined twice")
        names.add(name)
        _annotations(rd.get("annotations"), f"{where}.annotations")
        parsed.append((name, _edits(root, rd.get("containerEdits"), f"{where}.containerEdits",
                                    device_level=True), where))

    needed = min_version(raw)
    if _vtuple(needed) > _vtuple(version):
        raise SpecError(f"cdiVersion: {version} is too old for what the spec uses "
                        f"(needs at least {needed})")

    if spec_edits.refused:
        # Every device of the file would carry it: the file is unusable.
        raise SpecError(spec_edits.refused)
    try:
        shared = _to_edits(root, spec_edits)
    except DiscoveryError as e:
        raise SpecError(f"containerEdits: device node {e.source}: {e.message}") from e
    driver = None
    vendor = ""
    if shared:
        vendor = DRIVER_PREFIX + host_path
        driver = Driver(vendor=vendor, version=version.removeprefix("v"),
                        capabilities=MappingProxyType({"": shared}))

    devices: list[Device] = []
    for name, edits, where in parsed:
        if name == ALL_DEVICE:
            log.debug("cdi_composite_device_skipped", path=host_path, device=f"{kind}={name}")
            continue
        if edits.refused:
            # Safe to read but not to grant (nri_accel.edits' rules): this device only.
            problems.append(Problem(host_path, f"device {kind}={name} left out: "
                                               f"{edits.refused}"))
            continue
        try:
            device_edits = _to_edits(root, edits)
        except DiscoveryError as e:
            # Not a malformed file: this one device is unusable on this node now.
            if not isinstance(e.__cause__, FileNotFoundError):
                problems.append(Problem(host_path, f"device {kind}={name} left out: {where}: "
                                                   f"device node {e.source}: {e.message}"))
                continue
            # Described but its node is gone: listed unhealthy (kubelet sees it Unhealthy,
            # no container is granted it) until the node is back.
            why = f"device node {e.source} does not exist"
            problems.append(Problem(host_path, f"device {kind}={name} is unhealthy: {why}"))
            devices.append(Device(kind=kind, name=name, healthy=False, vendor=vendor,
                                  attributes=MappingProxyType({"origin": host_path,
                                                               "health": why})))
            continue
        devices.append(Device(kind=kind, name=name, edits=device_edits,
                              attributes=MappingProxyType({"origin": host_path}),
                              vendor=vendor))
    return _Spec(host_path, priority, kind, tuple(devices), driver), problems


def _no_unknown(obj: Mapping[str, Any], allowed: set[str], where: str) -> None:
    for key in obj:
        if key not in allowed:
            shown = cut(key, MAX_SHOWN) if isinstance(key, str) else _shown(key)
            raise SpecError(f"{where}.{shown}: unknown field" if where
                            else f"{shown}: unknown field")


def _string(obj: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> str:
    loc = f"{where}.{key}" if where else key
    v = obj.get(key)
    if v is None:
        if required:
            raise SpecError(f"{loc}: required")
        return ""
    if not isinstance(v, str):
        raise SpecError(f"{loc}: must be a string, not {type(v).__name__}")
    return v


def _strings(v: Any, loc: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise SpecError(f"{loc}: must be a list of strings")
    return tuple(v)


def _uint(v: Any, loc: str, *, positive: bool = False) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < (1 if positive else 0) \
            or v > _UINT32_MAX:
        raise SpecError(f"{loc}: must be an integer {'> 0' if positive else '>= 0'} "
                        f"and at most {_UINT32_MAX}, not {_shown(v)}")
    return v


def _annotations(v: Any, loc: str) -> None:
    if v is None:
        return
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str)
                                          for k, x in v.items()):
        raise SpecError(f"{loc}: must map strings to strings")


def _check_qualifier(part: str, what: str) -> None:
    if not part:
        raise SpecError(f"kind: empty {what}")
    if not part[0].isascii() or not part[0].isalpha():
        raise SpecError(f"kind: {what} {_shown(part)} must start with a letter")
    if not _QUALIFIER_CHARS.match(part):
        raise SpecError(f"kind: {what} {_shown(part)} may hold only letters, digits, '_', "
                        "'-', '.'")
    if not part[-1].isascii() or not part[-1].isalnum():
        raise SpecError(f"kind: {what} {_shown(part)} must end with a letter or digit")


def _check_kind(kind: str) -> None:
    vendor, sep, cls = kind.partition("/")
    if not sep or "/" in cls:
        raise SpecError(f"kind: {_shown(kind)} must be vendor/class, e.g. "
                        "\"acme.example/npu\"")
    _check_qualifier(vendor, "vendor")
    _check_qualifier(cls, "class")


def _check_device_name(name: str, loc: str) -> None:
    if not is_device_name(name):
        raise SpecError(f"{loc}: {_shown(name)} is not a device name (letters, digits, '_', '-', "
                        "'.', ':'; starting and ending with a letter or digit; no '::', which "
                        "kubelet's time-slicing replica ids use)")


def _check_path(v: Any, loc: str) -> str:
    if not isinstance(v, str) or not v:
        raise SpecError(f"{loc}: required, an absolute path")
    # Before anything else, and before any walk on the host: the cost of each grows with it.
    too_long = path_size_problem(v)
    if too_long:
        raise SpecError(f"{loc}: {_shown(v)} {too_long}")
    p = PurePosixPath(v)
    if not p.is_absolute() or ".." in p.parts or "\0" in v:
        raise SpecError(f"{loc}: {_shown(v)} must be an absolute path without '..'")
    return str(p)


def _check_env(values: tuple[str, ...], loc: str) -> None:
    for kv in values:
        if kv.find("=") <= 0:
            raise SpecError(f"{loc}: {_shown(kv)} is not KEY=VALUE")


_EDIT_LISTS = ("env", "deviceNodes", "mounts", "hooks")
"""The lists of a containerEdits whose entries nri_accel.edits.MAX_EDITS counts."""


class _RawNode(Struct, frozen=True):
    path: str
    host_path: str
    type: str
    major: int | None
    minor: int | None
    file_mode: int | None
    permissions: str
    uid: int | None
    gid: int | None
    where: str


class _RawEdits(Struct, frozen=True):
    env: tuple[str, ...]
    nodes: tuple[_RawNode, ...]
    mounts: tuple[Mount, ...]
    hooks: tuple[Hook, ...]
    gids: tuple[int, ...]
    refused: str = ""  # the first edit nri_accel.edits refuses, with its JSON path


class _Refusals:
    """The first refusal of nri_accel.edits' rules among the edits of one containerEdits."""

    def __init__(self) -> None:
        self.first = ""

    def check(self, loc: str, rule: Callable[..., object], *args: Any) -> None:
        if self.first:
            return
        try:
            rule(*args)
        except UnsafeEdit as e:
            self.first = f"{loc}: {e}"


def _permissions(perms: str, loc: str) -> str:
    """CDI's permissions (pkg/cdi DeviceNode.Validate): "" means "rwm", "none" an empty
    cgroup rule, else letters of r, w, m in any order and number, kept here as the
    canonical subset of "rwm"."""
    if not perms:
        return "rwm"
    if perms == NO_ACCESS:
        return perms
    if perms.strip("rwm"):
        raise SpecError(f"{loc}: {_shown(perms)} must be made of r, w, m, or be \"none\"")
    return "".join(c for c in "rwm" if c in perms)


def _edits(root: HostRoot, v: Any, where: str, *, device_level: bool) -> _RawEdits:
    if v is None:
        v = {}
    if not isinstance(v, dict):
        raise SpecError(f"{where}: must be a mapping")
    _no_unknown(v, _EDITS_KEYS, where)
    for unsupported in ("intelRdt", "netDevices"):
        if v.get(unsupported) is not None:
            raise SpecError(f"{where}.{unsupported}: not supported by nri-accel (NRI cannot "
                            "apply it)")
    env = _strings(v.get("env"), f"{where}.env")
    _check_env(env, f"{where}.env")
    # What the spec says is well-formed CDI; whether nri-accel may emit it is decided by
    # nri_accel.edits (the rules the catalog applies again), called here so that `discover`
    # names the file and field.
    safety = _Refusals()
    # First: past the limit, the checks below are skipped (the first refusal is kept),
    # the resolution of each mount source on the host among them.
    safety.check(where, check_edit_count, sum(
        len(items) for key in _EDIT_LISTS if isinstance(items := v.get(key), list)))
    for i, kv in enumerate(env):
        safety.check(f"{where}.env[{i}]", check_env, kv)

    nodes = []
    for loc, rn in _mappings(v.get("deviceNodes"), f"{where}.deviceNodes", _NODE_KEYS):
        path = _check_path(rn.get("path"), f"{loc}.path")
        host = rn.get("hostPath")
        host = _check_path(host, f"{loc}.hostPath") if host is not None else ""
        typ = _string(rn, "type", loc)
        if typ not in ("", "c", "u", "b", "p"):
            raise SpecError(f"{loc}.type: {_shown(typ)} is not b, c, u or p")
        if typ == "p":
            raise SpecError(f"{loc}.type: FIFO device nodes are not supported")
        perms = _permissions(_string(rn, "permissions", loc), f"{loc}.permissions")
        safety.check(f"{loc}.path", check_node_path, path)
        if host:
            safety.check(f"{loc}.hostPath", check_node_path, host, "device node host path")
        safety.check(f"{loc}.permissions", check_access, path, perms)
        nodes.append(_RawNode(
            path=path, host_path=host, type="c" if typ == "u" else typ,
            major=_uint(rn.get("major"), f"{loc}.major"),
            minor=_uint(rn.get("minor"), f"{loc}.minor"),
            file_mode=_uint(rn.get("fileMode"), f"{loc}.fileMode"),
            permissions=perms,
            uid=_uint(rn.get("uid"), f"{loc}.uid"),
            gid=_uint(rn.get("gid"), f"{loc}.gid"),
            where=loc,
        ))

    mounts = []
    for loc, rm in _mappings(v.get("mounts"), f"{where}.mounts", _MOUNT_KEYS):
        host = _string(rm, "hostPath", loc, required=True)
        dest = _check_path(rm.get("containerPath"), f"{loc}.containerPath")
        typ = _string(rm, "type", loc)
        options = _strings(rm.get("options"), f"{loc}.options")
        if is_bind_mount(typ, options):
            # Without options a bind gets nri-accel's default: ro, nosuid, nodev, bind.
            mount = Mount(host_path=_check_path(host, f"{loc}.hostPath"),
                          container_path=dest, type=typ or "bind")
        else:
            # tmpfs and other filesystems (CDI SPEC.md: `type` is the filesystem type):
            # hostPath is the mount's source, a name such as "tmpfs", not a path.
            if not host:
                raise SpecError(f"{loc}.hostPath: required (the source, e.g. \"tmpfs\")")
            mount = Mount(host_path=host, container_path=dest, type=typ,
                          options=TMPFS_REQUIRED_OPTIONS)
        mount = replace(mount, options=options) if options else mount
        safety.check(loc, check_mount, mount)
        if is_bind_mount(mount.type, mount.options):
            safety.check(f"{loc}.hostPath", _check_resolved_source, root, mount.host_path)
        mounts.append(mount)

    hooks = []
    for loc, rh in _mappings(v.get("hooks"), f"{where}.hooks", _HOOK_KEYS):
        name = _string(rh, "hookName", loc, required=True)
        if name not in HOOK_NAMES:
            raise SpecError(f"{loc}.hookName: {_shown(name)} is not one of "
                            f"{', '.join(sorted(HOOK_NAMES))}")
        hook_env = _strings(rh.get("env"), f"{loc}.env")
        _check_env(hook_env, f"{loc}.env")
        hooks.append(Hook(hook_name=name, path=_check_path(rh.get("path"), f"{loc}.path"),
                          args=_strings(rh.get("args"), f"{loc}.args"), env=hook_env,
                          timeout=_uint(rh.get("timeout"), f"{loc}.timeout", positive=True)))

    gids = []
    for i, g in enumerate(_list(v.get("additionalGids"), f"{where}.additionalGids")):
        gid = _uint(g, f"{where}.additionalGids[{i}]")
        if gid:  # 0 is ignored, as the spec says
            gids.append(gid)

    edits = _RawEdits(env, tuple(nodes), tuple(mounts), tuple(hooks), tuple(gids),
                      refused=safety.first)
    if device_level and not (env or nodes or mounts or hooks or v.get("additionalGids")):
        raise SpecError(f"{where}: a device needs at least one edit")
    return edits


def _check_resolved_source(root: HostRoot, host_path: str) -> None:
    """A bind source that is a symlink is checked again where it leads: the runtime
    follows it (a link to /var/lib/kubelet is /var/lib/kubelet)."""
    try:
        resolved = root.resolve(host_path)
    except (OSError, ValueError) as e:  # ValueError: a path the OS cannot take
        raise UnsafeEdit(f"mount source {_shown(host_path)} cannot be resolved: "
                         f"{getattr(e, 'strerror', None) or e}") from e
    if resolved != host_path:
        try:
            check_mount_source(resolved)
        except UnsafeEdit as e:
            raise UnsafeEdit(f"mount source {_shown(host_path)} leads to {_shown(resolved)}: "
                             f"{e}") from e


def _list(v: Any, loc: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise SpecError(f"{loc}: must be a list")
    return v


def _mappings(v: Any, where: str, allowed: set[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, entry) for each entry of the list `v`: mappings with `allowed` keys only."""
    for i, entry in enumerate(_list(v, where)):
        loc = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise SpecError(f"{loc}: must be a mapping")
        _no_unknown(entry, allowed, loc)
        yield loc, entry


def _to_edits(root: HostRoot, raw: _RawEdits) -> ContainerEdits:
    """Resolve device nodes against the host; raises DiscoveryError naming the node."""
    nodes = []
    for rn in raw.nodes:
        host = rn.host_path or rn.path
        node = host_device_node(root, host, container_path=rn.path, permissions=rn.permissions)
        if rn.type and rn.type != node.type:
            raise DiscoveryError(f"the spec says type {rn.type!r}, the host node is "
                                 f"{node.type!r}", source=host)
        # Upstream treats major 0 as "not given" and then fills both numbers from the host.
        if rn.major and (rn.major, rn.minor or 0) != (node.major, node.minor):
            raise DiscoveryError(f"the spec says {rn.major}:{rn.minor or 0}, the host node is "
                                 f"{node.major}:{node.minor}", source=host)
        nodes.append(replace(node, file_mode=rn.file_mode, uid=rn.uid, gid=rn.gid))
    return ContainerEdits(env=raw.env, device_nodes=tuple(nodes), mounts=raw.mounts,
                          hooks=raw.hooks, additional_gids=raw.gids)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def _shown(v: Any) -> str:
    """A value from a spec as a message quotes it, bounded whatever it is: a string cut
    to MAX_SHOWN characters, an integer too long to print in decimal (Python refuses
    one of over 4300 digits: a YAML 0x... of any length is read) by its size, any other
    container by its type."""
    if isinstance(v, str):
        return repr(cut(v, MAX_SHOWN))
    if isinstance(v, bool) or v is None or isinstance(v, float):
        return repr(v)
    if isinstance(v, int):
        return repr(v) if v.bit_length() <= 64 else f"an integer of {v.bit_length()} bits"
    return f"a {type(v).__name__}"


def _vtuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.removeprefix("v").split("."))


_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MAX_YAML_DEPTH = 32  # a CDI spec nests 7 levels (spec, devices, device, edits, hooks, ...)
_TOO_DEEP = f"nested deeper than {_MAX_YAML_DEPTH} levels"
_TOO_BIG = (f"more than {MAX_SPEC_NODES} values (scalars, lists, mappings): not read "
            "(a CDI spec holds a few thousand)")
_NODE_EVENTS = (yaml.ScalarEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent,
                yaml.AliasEvent)


def _check_yaml(text: str) -> int:
    """The number of YAML nodes in `text` (scalars, sequences, mappings, aliases);
    SpecError past MAX_SPEC_NODES (counted as the events come: parsing stops there)
    or when nested deeper than _MAX_YAML_DEPTH.

    Depth is refused before the document is composed: libyaml's
    composer (CSafeLoader) recurses in C once per level, so 100,000 '[' overflow the
    stack and kill the process (no exception to catch). Parse events are read in a loop.
    The libyaml of PyYAML 6.0.4 and later also stops at 1,000 flow levels, in its
    scanner, which reads a run of '[' ahead before the first event comes out: that
    refusal is reported as this one, the same depth problem."""
    depth = 0
    nodes = 0
    try:
        for event in yaml.parse(text, Loader=_YAML_LOADER):
            if isinstance(event, _NODE_EVENTS):
                nodes += 1
                if nodes > MAX_SPEC_NODES:
                    raise SpecError(_TOO_BIG)
            if isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
                depth += 1
                if depth > _MAX_YAML_DEPTH:
                    raise SpecError(_TOO_DEEP)
            elif isinstance(event, yaml.SequenceEndEvent | yaml.MappingEndEvent):
                depth -= 1
    except yaml.MarkedYAMLError as exc:
        if exc.problem == "exceeded maximum nesting depth":
            raise SpecError(_TOO_DEEP) from None
        raise
    return nodes


# ---- the version a spec needs (reading and writing) -----------------------------------


def min_version(spec: Mapping[str, Any]) -> str:
    """The lowest CDI version whose schema has every feature `spec` (raw form) uses."""
    edits = [spec.get("containerEdits") or {}]
    devices = spec.get("devices") or []
    edits += [(d.get("containerEdits") or {}) for d in devices if isinstance(d, dict)]
    edits = [e for e in edits if isinstance(e, dict)]
    kind = spec.get("kind") or ""
    cls = kind.partition("/")[2] if isinstance(kind, str) else ""

    def all_of(key: str) -> list[Any]:
        return [x for e in edits for x in (e.get(key) or []) if isinstance(x, dict)]

    if any(e.get("additionalGids") for e in edits):
        return "0.7.0"
    if spec.get("annotations") or any(isinstance(d, dict) and d.get("annotations")
                                      for d in devices) or "." in cls:
        return "0.6.0"
    if any(n.get("hostPath") for n in all_of("deviceNodes")) or any(
            isinstance(d, dict) and isinstance(d.get("name"), str) and d["name"][:1].isdigit()
            for d in devices):
        return "0.5.0"
    if any(m.get("type") for m in all_of("mounts")):
        return "0.4.0"
    return EARLIEST_VERSION


# ---- writing ----------------------------------------------------------------------------


def generate_specs(inventory: Inventory) -> list[dict[str, Any]]:
    """One CDI spec (raw form, ready for render_spec) per device kind of each native
    family: its devices' own edits as device edits, the device `all` merging them, and
    as spec edits what its profile adds for them with the default request (NVIDIA: the
    driver's shared files plus utility and compute, the default of
    NVIDIA_DRIVER_CAPABILITIES)."""
    from nri_accel.vendors import PROFILES
    from nri_accel.vendors.base import NO_ASK, Checked, DriverFiles

    files = DriverFiles(MappingProxyType({
        (vendor, cap): Checked(edits=edits) for vendor, driver in inventory.drivers.items()
        for cap, edits in driver.capabilities.items()}))
    specs = []
    for profile in PROFILES:
        if not profile.native:
            continue
        for kind in profile.kinds:
            # what the family discovered itself (a CDI spec's devices are its own file's)
            devices = tuple(d for d in inventory.of_kind(kind) if d.vendor == profile.name)
            if not devices:
                continue
            raw_devices = [{"name": d.name, "containerEdits": _edits_to_raw(d.edits)}
                           for d in devices]
            if all(d.name != ALL_DEVICE for d in devices):
                raw_devices.append({"name": ALL_DEVICE, "containerEdits": _edits_to_raw(
                    merge_edits(d.edits for d in devices))})
            added = profile.edits(devices, profile.settings(NO_ASK, None), False, files)
            shared = merge_edits(added.parts)
            spec: dict[str, Any] = {"cdiVersion": "", "kind": kind, "devices": raw_devices}
            if shared:
                spec["containerEdits"] = _edits_to_raw(shared)
            spec["cdiVersion"] = min_version(spec)
            specs.append(spec)
    return specs


def _edits_to_raw(e: ContainerEdits) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if e.env:
        out["env"] = list(e.env)
    if e.device_nodes:
        out["deviceNodes"] = [_node_to_raw(n) for n in e.device_nodes]
    if e.mounts:
        out["mounts"] = [{"hostPath": m.host_path, "containerPath": m.container_path,
                          "type": m.type, "options": list(m.options)} for m in e.mounts]
    if e.hooks:
        out["hooks"] = [_hook_to_raw(h) for h in e.hooks]
    if e.additional_gids:
        out["additionalGids"] = list(e.additional_gids)
    return out


def _node_to_raw(n: DeviceNode) -> dict[str, Any]:
    out: dict[str, Any] = {"path": n.path}
    if n.host_path:
        out["hostPath"] = n.host_path
    out.update(type=n.type, major=n.major, minor=n.minor)
    if n.permissions != "rwm":
        out["permissions"] = n.permissions
    for key, value in (("fileMode", n.file_mode), ("uid", n.uid), ("gid", n.gid)):
        if value is not None:
            out[key] = value
    return out


def _hook_to_raw(h: Hook) -> dict[str, Any]:
    out: dict[str, Any] = {"hookName": h.hook_name, "path": h.path}
    if h.args:
        out["args"] = list(h.args)
    if h.env:
        out["env"] = list(h.env)
    if h.timeout is not None:
        out["timeout"] = h.timeout
    return out


def render_spec(spec: Mapping[str, Any]) -> str:
    """The spec as YAML, the format CDI tools write by default."""
    header = (f"# CDI spec for {spec['kind']} generated by `nri-accel cdi generate`.\n"
              "# Regenerate it when the node's devices or driver change.\n")
    return header + yaml.safe_dump(dict(spec), sort_keys=False, default_flow_style=False,
                                   width=1000)


def spec_file_name(kind: str) -> str:
    """File name for a kind's spec, as CDI's GenerateSpecName does: vendor-class.yaml."""
    vendor, _, cls = kind.partition("/")
    return f"{vendor}-{cls}.yaml"
