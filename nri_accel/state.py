"""Grant state: who holds which device, the checkpoint that keeps it across restarts, and
the node state `run` shares with the device plugin.

Owns: Grant, Holdings (the allocation state and THE exclusivity rule), the checkpoint
file format, its atomic write and its writer (CheckpointWriter: after each change, off
the event loop), and the NRI side's registration record (NriStatus: its format, its
write, and a read that never blocks, never raises and reads anything malformed as
not registered, saying why).
Imports the standard library, msgspec, nri_accel.errors and nri_accel.log. Holdings is pure
in-memory state; only Checkpoint and NriStatus touch files, and nothing here runs on the
CreateContainer path except Holdings' dictionary work.

The rule (README.md, "Who holds a device"): every device a container is granted by id,
count or CDI request is held *exclusively* while that container exists; a device reached
only through `all`, through a kubelet time-slicing replica, or of a kind the configuration
shares is used *shared*, holds nothing and is never refused for being held. An exclusive
grant of a device another container holds is refused (AllocationError) naming that
container; counts never choose a held device. A device and its parts (a GPU and its MIG
devices, a Neuron device and its NeuronCores: Holdings.set_parts) count as one for this
rule where the whole is concerned: the whole is not granted exclusively while another
container holds one of its parts, nor a part while another holds the whole; two parts
of one device may go to different containers. Holdings are keyed by what stays true of
a device (Device.key: "<kind>=<UUID>", else its partition id, else its PCI bus id,
else the name a spec gives it), never by an index that a renumbering can shift.

A container's grant ends with StopContainer/RemoveContainer, with its pod sandbox
(Stop/RemovePodSandbox: CRI-O sends nothing for a container whose `runc create` failed
after the adjustment), when a new create for the same pod sandbox and container name
replaces it (kubelet's retry of that failed create), and when a Synchronize does not
list it. A sandbox is its runtime id (Grant.pod), not the pod's uid, which every
sandbox kubelet makes for one pod shares.

The checkpoint (`<state dir>/grants.json`) is written after every change, off the event
loop, atomically (a temporary file, fsync, rename, fsync of the directory: kubelet's
device-manager checkpoint does the same) and read at start:

    {"version": 1, "boot_id": "...", "known": true, "grants": [{"container_id": ...,
      "pod_uid": ..., "pod_id": ..., "name": "ns/pod/container", "exclusive": [keys],
      "shared": [keys], "wholes": {part key: whole key}}]}

("wholes", of the parts a grant holds, only where it has any: Holdings.set_parts.)

A checkpoint of another boot holds nothing (no container survives a reboot). A missing
one means nri-accel never granted anything on this boot: every `run` writes one before
it serves (Checkpoint.save on start; a state directory where it cannot be written stops
`run` there: prepare_state_dir). One that cannot be read (or whose boot id is missing)
leaves the state unknown: no device is then granted exclusively, counted or named
(StateError), until a Synchronize tells what runs. It
is kept for inspection, renamed to `grants.json.unreadable` (replacing an older one,
so the directory stays bounded), and the log line says where. The unknown state is
written down ("known": false, with whatever was granted since), so that it outlives
the unreadable file that `run` replaces: a plugin that never gets a Synchronize
(containerd 1.7 launching it) and restarts again must not read "nothing is held" into a
checkpoint that only said "not known". An absent "known" means true.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import itertools
import json
import math
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, KeysView, Mapping
from typing import Any

import msgspec
from msgspec import Struct, field, structs

from nri_accel.errors import AllocationError, ConfigError, StateError
from nri_accel.files import UnreadableFile, read_regular
from nri_accel.log import get_logger

log = get_logger(__name__)

CHECKPOINT_FILE = "grants.json"
UNREADABLE_SUFFIX = ".unreadable"  # where an unreadable checkpoint is kept: grants.json.unreadable
NRI_STATUS_FILE = "nri-plugin.json"
CHECKPOINT_VERSION = 1
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
MAX_CHECKPOINT_BYTES = 64 << 20
_MAX_LISTED = 4


class Grant(Struct, frozen=True):
    """What one container holds."""

    container_id: str
    name: str = ""  # namespace/pod/container, for messages
    pod_uid: str = ""
    pod_id: str = ""  # the runtime's sandbox id
    container_name: str = ""
    exclusive: frozenset[str] = frozenset()  # Device.key of each device held exclusively
    shared: frozenset[str] = frozenset()  # Device.key of each device used shared
    wholes: tuple[tuple[str, str], ...] = ()
    """(part key, whole key) of parts it holds, as a checkpoint recorded them
    (Holdings.to_json): a part whose device has vanished since (a MIG device whose GPU
    left MIG mode) still ties its whole, whose device node the container has."""

    @property
    def holds(self) -> bool:
        """It holds a device, exclusively or shared (a grant of nothing is not kept)."""
        return bool(self.exclusive or self.shared)

    @property
    def pod(self) -> str:
        """What names the pod sandbox: the runtime's sandbox id, else the pod's uid. Not
        the uid first: every sandbox kubelet makes for one pod has its uid (a new one
        after the old one died, while kubelet has yet to remove the old), as do crictl
        pods made from one config."""
        return self.pod_id or self.pod_uid

    def to_dict(self) -> dict[str, Any]:
        return {"container_id": self.container_id, "name": self.name,
                "pod_uid": self.pod_uid, "pod_id": self.pod_id,
                "container_name": self.container_name,
                "exclusive": sorted(self.exclusive), "shared": sorted(self.shared),
                **({"wholes": dict(self.wholes)} if self.wholes else {})}

    @classmethod
    def from_dict(cls, data: Any) -> Grant:
        if not isinstance(data, dict):
            raise ValueError("a grant must be an object")

        def text(key: str) -> str:
            value = data.get(key, "")
            if not isinstance(value, str):
                raise ValueError(f"{key} must be a string")
            return value

        def keys(key: str) -> frozenset[str]:
            value = data.get(key, [])
            if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
                raise ValueError(f"{key} must be a list of strings")
            return frozenset(value)

        def wholes() -> tuple[tuple[str, str], ...]:
            value = data.get("wholes", {})
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and isinstance(w, str) for k, w in value.items()):
                raise ValueError("wholes must map keys to keys")
            return tuple(sorted(value.items()))

        if not text("container_id"):
            raise ValueError("container_id is empty")
        return cls(text("container_id"), text("name"), text("pod_uid"), text("pod_id"),
                   text("container_name"), keys("exclusive"), keys("shared"), wholes())


class _Busy(Mapping[str, str]):
    """Holdings.busy(): which keys are busy is known at once (a count avoids them:
    keys() is a dict's, tested in C); who holds each is put together only when read (a
    refused count names them), not for every key held on the node at every count.
    `sources`: each busy key -> its holders' ids, or (the held key, the relation) for
    the whole or a part of a held key."""

    __slots__ = ("_grants", "_mine", "_sources")

    def __init__(self, sources: dict[str, set[str] | tuple[str, str]],
                 grants: Mapping[str, Grant], mine: frozenset[str]) -> None:
        self._sources, self._grants, self._mine = sources, grants, mine

    def __getitem__(self, key: str) -> str:
        source = self._sources[key]
        if isinstance(source, tuple):
            held, relation = source
            return f"{self[held]}, {relation} {held}"
        return _listed(self._grants[i] for i in source if i not in self._mine)

    def keys(self) -> KeysView[str]:
        return self._sources.keys()

    def __contains__(self, key: object) -> bool:
        return key in self._sources

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)


def _listed(grants: Iterable[Grant]) -> str:
    names = sorted({g.name if g.name == g.container_id
                    else f"{g.name or '?'} (id {g.container_id[:12]})" for g in grants})
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


class Holdings(Struct):
    """Which running container holds which device. Not thread-safe: the Engine
    serialises calls. `known` is False while the state cannot be known (an unreadable
    checkpoint, no Synchronize yet)."""

    known: bool = True
    _grants: dict[str, Grant] = field(default_factory=dict)
    _holders: dict[str, set[str]] = field(default_factory=dict)  # key -> container ids
    _by_name: dict[tuple[str, str], str] = field(default_factory=dict)  # (pod, name) -> id
    _whole: dict[str, str] = field(default_factory=dict)  # part key -> whole key
    _parts: dict[str, frozenset[str]] = field(default_factory=dict)  # whole -> part keys
    _related: frozenset[str] = frozenset()  # the keys of _whole and _parts: one set to meet
    version: int = 0  # bumped on every change: a check() made at this version holds

    def set_parts(self, parts: Mapping[str, str]) -> None:
        """Which device is a part of which (part key -> whole key), for the rule in the
        module docstring: set from each inventory (the Engine does), kept apart from the
        grants, which name devices only by key. A part still held keeps its whole when
        `parts` no longer lists it (its device vanished, or its GPU left MIG mode): its
        container still has the whole's device node, and the whole is not granted
        exclusively until it ends."""
        held = {p: w for p, w in self._whole.items() if p in self._holders}
        self._link({**held, **parts})

    def _link(self, links: Mapping[str, str]) -> None:
        wholes: dict[str, set[str]] = {}
        for part, whole in links.items():
            wholes.setdefault(whole, set()).add(part)
        self._whole = dict(links)
        self._parts = {w: frozenset(p) for w, p in wholes.items()}
        self._related = frozenset(self._whole) | frozenset(self._parts)
        self.version += 1

    def _relations(self, key: str) -> list[tuple[str, str]]:
        """(key, relation) of `key` itself (""), its whole ("device") and its parts
        ("part"): the keys whose holders an exclusive grant of `key` conflicts with."""
        out = [(key, "")]
        whole = self._whole.get(key)
        if whole is not None:
            out.append((whole, "device"))
        parts = self._parts.get(key)
        if parts:
            out.extend((p, "part") for p in sorted(parts))
        return out

    # ---- reading -----------------------------------------------------------------------

    def grants(self) -> tuple[Grant, ...]:
        """Every grant, by container id."""
        return tuple(self._grants[c] for c in sorted(self._grants))

    def snapshot(self) -> tuple[Grant, ...]:
        """Every grant, unordered, each holding a part with the part's whole (as to_json()
        writes it): a cheap copy to write out elsewhere (CheckpointWriter's). Only the
        grants of the parts held are copied again: the rest is one C call."""
        grants = self._grants
        linked = {c for part in self._whole if (ids := self._holders.get(part)) for c in ids}
        if not linked:
            return tuple(grants.values())
        out = dict(grants)
        for c in linked:
            out[c] = self._with_wholes(grants[c])
        return tuple(out.values())

    def get(self, container_id: str) -> Grant | None:
        return self._grants.get(container_id)

    def container_ids(self) -> frozenset[str]:
        """The ids of the containers a grant is recorded for."""
        return frozenset(self._grants)

    def held_keys(self) -> frozenset[str]:
        return frozenset(self._holders)

    def replaced(self, grant: Grant) -> frozenset[str]:
        """Ids of the grants `grant` would replace: its own container's earlier one, and
        that of an earlier container of the same pod sandbox (Grant.pod) and name."""
        out = set()
        if grant.container_id in self._grants:
            out.add(grant.container_id)
        if grant.pod and grant.container_name:
            earlier = self._by_name.get((grant.pod, grant.container_name))
            if earlier is not None:
                out.add(earlier)
        return frozenset(out)

    def holds(self, container_id: str, pod: str = "", container_name: str = "") -> bool:
        """Whether a grant is recorded that a create of this container would replace
        (see replaced(): its own, or that of an earlier container of the same pod and
        name)."""
        return container_id in self._grants or (
            bool(pod and container_name) and (pod, container_name) in self._by_name)

    def busy(self, grant: Grant) -> Mapping[str, str]:
        """Keys held exclusively by containers other than those `grant` replaces, and
        the wholes and parts of those keys, each with who holds it (for messages). Read
        while the holdings stay as they are (the Engine's lock)."""
        mine = self.replaced(grant)
        held = ({k: ids for k, ids in self._holders.items() if not ids <= mine} if mine
                else self._holders)  # no holder's set is empty (release drops it)
        if not held:
            return {}
        through: dict[str, tuple[str, str]] = {}  # whole or part -> (held key, relation)
        if self._whole:
            for key in held:
                whole = self._whole.get(key)
                if whole is not None and whole not in held:
                    through.setdefault(whole, (key, "which holds its part"))
                for part in self._parts.get(key, ()):
                    if part not in held:
                        through.setdefault(part, (key, "which holds its device"))
        return _Busy(held | through if through else held, self._grants, mine)

    def require_known(self, source: str) -> None:
        """StateError naming `source` (what asked for a device) while the state is
        unknown: no device is granted exclusively then, counted or named, for any of
        them may be held by a container nri-accel no longer knows of."""
        if not self.known:
            raise StateError("which devices running containers hold is not known (the "
                             "grant checkpoint could not be read and the runtime has not "
                             "synchronised yet): a device is not granted rather than "
                             "guessed free", source=source)

    def check(self, grant: Grant, source_of: Callable[[str], str] | None = None) -> None:
        """Refuse `grant` if it would take a device another container holds: the one
        exclusivity rule, which cannot be kept while the state is unknown (a grant of
        any device exclusively is then refused: require_known). `source_of(key)`: what
        asked for that device (the refusal names the first conflicting device's; asked
        only then)."""
        if grant.exclusive and not self.known:
            first = min(grant.exclusive)
            self.require_known(source_of(first) if source_of else "")
        holders, whole, parts = self._holders, self._whole, self._parts
        if holders.keys().isdisjoint(grant.exclusive) and not any(
                whole.get(key) in holders or not holders.keys().isdisjoint(parts.get(key, ()))
                for key in self._related & grant.exclusive):
            return  # most grants: nobody holds a key of theirs, its whole or its parts
        mine: frozenset[str] | None = None  # the grants `grant` replaces, once needed
        conflicts: dict[str, list[Grant]] = {}
        first = ""
        for key in sorted(grant.exclusive):
            for related, relation in self._relations(key):
                ids = holders.get(related)
                if not ids:
                    continue
                if mine is None:
                    mine = self.replaced(grant)
                others = [self._grants[i] for i in ids if i not in mine]
                if others:
                    first = first or key
                    how = f" (its {relation} {related})" if relation else ""
                    conflicts.setdefault(key + how, []).extend(others)
        if conflicts:
            shown = "; ".join(f"{k} is held by {_listed(g)}" for k, g in conflicts.items())
            raise AllocationError(f"{shown}: a device is granted to one running container "
                                  "at a time (share it through the device plugin's "
                                  "time-slicing replicas or devices.shared_kinds)",
                                  source=source_of(first) if source_of else "")

    # ---- changing ----------------------------------------------------------------------

    def record(self, grant: Grant) -> tuple[Grant, ...]:
        """Record `grant` (check() it first), replacing what it replaces; returns those."""
        gone = tuple(g for i in self.replaced(grant) if (g := self.release(i)) is not None)
        self._add(grant)
        return gone

    def _add(self, grant: Grant) -> None:
        if grant.wholes and not all(p in self._whole for p, _ in grant.wholes):
            self._link({**dict(grant.wholes), **self._whole})  # a part no inventory lists
        if grant.holds:
            self._grants[grant.container_id] = grant
            for key in grant.exclusive:
                self._holders.setdefault(key, set()).add(grant.container_id)
            if grant.pod and grant.container_name:
                self._by_name[(grant.pod, grant.container_name)] = grant.container_id
            self.version += 1

    def release(self, container_id: str) -> Grant | None:
        grant = self._grants.pop(container_id, None)
        if grant is None:
            return None
        for key in grant.exclusive:
            ids = self._holders.get(key)
            if ids is not None:
                ids.discard(container_id)
                if not ids:
                    del self._holders[key]
        if self._by_name.get((grant.pod, grant.container_name)) == container_id:
            del self._by_name[(grant.pod, grant.container_name)]
        self.version += 1
        return grant

    def release_pod(self, pod_uid: str, pod_id: str) -> tuple[Grant, ...]:
        """Release every grant of the pod sandbox: by its sandbox id, else (a request or
        a grant without one) by the pod's uid. Never by uid where both have an id: an
        older sandbox of the same pod, which kubelet removes after the new one runs,
        would take the new one's grants with it."""
        ids = [g.container_id for g in self._grants.values()
               if (g.pod_id == pod_id if pod_id and g.pod_id
                   else bool(pod_uid) and g.pod_uid == pod_uid)]
        return tuple(g for i in ids if (g := self.release(i)) is not None)

    def replace_all(self, grants: Iterable[Grant], *, known: bool = True) -> None:
        """Start over from `grants` (a checkpoint, a Synchronize): every one of them,
        none replacing another (what runs holds what it was granted, whatever the order
        in which the runtime lists two containers of one sandbox and name)."""
        self._grants.clear()
        self._holders.clear()
        self._by_name.clear()
        self.known = known
        for g in grants:
            self.release(g.container_id)  # a container listed twice: its later grant
            self._add(g)
        self.version += 1

    # ---- the checkpoint's form -------------------------------------------------------

    def to_json(self, boot_id: str) -> str:
        return json.dumps({"version": CHECKPOINT_VERSION, "boot_id": boot_id,
                           "known": self.known,
                           "grants": [self._with_wholes(g).to_dict()
                                      for g in self.grants()]},
                          separators=(",", ":")) + "\n"

    def _with_wholes(self, grant: Grant) -> Grant:
        """`grant` with the whole of each part it holds exclusively, as known now."""
        wholes = tuple((k, self._whole[k]) for k in sorted(grant.exclusive) if k in self._whole)
        return grant if wholes == grant.wholes else structs.replace(grant, wholes=wholes)


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    """This boot's id (the kernel's random boot_id); "" when it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


class Checkpoint:
    """The grants checkpoint file in the state directory."""

    def __init__(self, state_dir: str, *, boot_id: str | None = None) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, CHECKPOINT_FILE)
        self.boot_id = read_boot_id() if boot_id is None else boot_id

    def load(self) -> tuple[list[Grant], bool]:
        """(grants, known): the grants of this boot; ([], True) when there is no
        checkpoint or it is another boot's; ([], False) when it cannot be read, with an
        error logged saying why; (grants, False) when it says the state was not known
        (written while unknown)."""
        try:  # what `run` writes is a regular file: a FIFO is never waited on, a link
            # (which `run` never makes) never followed
            data = read_regular(self.path, MAX_CHECKPOINT_BYTES, follow=False, own=True)
        except FileNotFoundError:
            log.info("checkpoint_absent", path=self.path,
                     meaning="nothing was granted on this boot")
            return [], True
        except OSError as e:
            why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror or str(e)
            self._unreadable(why)
            return [], False
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("version") != CHECKPOINT_VERSION:
                raise ValueError(f"not a version {CHECKPOINT_VERSION} checkpoint")
            if not isinstance(doc.get("grants"), list):
                raise ValueError("grants must be a list")
            if not isinstance(doc.get("known", True), bool):
                raise ValueError("known must be true or false")
            grants = [Grant.from_dict(g) for g in doc["grants"]]
        except ValueError as e:
            self._unreadable(str(e))
            return [], False
        except RecursionError:  # JSON nested deeper than the parser goes
            self._unreadable("not valid JSON: nested too deeply")
            return [], False
        boot = doc.get("boot_id", "")
        if self.boot_id and not (isinstance(boot, str) and boot):
            self._unreadable("boot_id must be the boot's id, a non-empty string")
            return [], False
        if self.boot_id and boot != self.boot_id:
            log.info("checkpoint_of_another_boot", path=self.path, grants=len(grants),
                     meaning="no container survives a reboot: nothing is held")
            return [], True
        known = doc.get("known", True)
        if not known:
            log.warning("checkpoint_state_unknown", path=self.path, grants=len(grants),
                        meaning="an earlier run could not read its checkpoint and no "
                                "Synchronize has told what runs since: no device is granted "
                                "exclusively")
        log.info("checkpoint_loaded", path=self.path, grants=len(grants), known=known)
        return grants, known

    def _unreadable(self, error: str) -> None:
        """Log that the checkpoint cannot be read, and keep it for inspection: renamed
        to <path>.unreadable (replacing an older one), out of the way of the checkpoint
        `run` writes next."""
        kept: str | None = self.path + UNREADABLE_SUFFIX
        failed: dict[str, str] = {}
        try:
            os.replace(self.path, kept)
        except OSError as e:
            kept, failed = None, {"keep_error": e.strerror or str(e)}
        log.error("checkpoint_unreadable", path=self.path, error=error, kept=kept, **failed,
                  meaning="no device is granted exclusively until a Synchronize tells what runs")

    def save(self, text: str) -> None:
        """Write `text` (Holdings.to_json) atomically. Raises OSError."""
        os.makedirs(self.state_dir, mode=0o755, exist_ok=True)
        fd, tmp = _new_file(self.state_dir, ".grants-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def lock_state_dir(path: str, *, source: str) -> int:
    """Hold the state directory `path` for this `run` (an exclusive flock on it, which
    the kernel drops when the process exits, however it exits): its fd, kept open as long
    as the process serves. Raises ConfigError while another process holds it: a second
    `run` on one state directory would restore the same grants and write its own over
    the other's (one exclusive device in two containers), and both would answer each
    create that grants (the runtime then fails it: two plugins set one annotation)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        other = NriStatus.load(path).pid
        raise ConfigError(
            f"another `nri-accel run` (pid {other or 'unknown'}) serves with the state "
            f"directory {path}: one `run` per node, per state directory", source=source
        ) from None
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"cannot lock the state directory {path}: {e.strerror or e}",
                          source=source) from e
    return fd


def prepare_state_dir(path: str, *, source: str, create: bool = True) -> None:
    """Make sure the state directory `path` is a directory this process owns and no one
    else may write to: with `create` (`run`, which writes there), created where absent
    (mode 0755, parents too) and writable; without (`device-plugin`, which only reads),
    absent is fine until `run` creates it. Raises
    ConfigError naming `source` (the flag or config key that chose `path`), so that a
    daemon stops at start instead of failing each write."""
    try:
        if create:
            os.makedirs(path, mode=0o755, exist_ok=True)
        elif not os.path.lexists(path):
            return
    except FileExistsError:  # makedirs: it exists and is not a directory
        pass
    except OSError as e:
        raise ConfigError(f"cannot create the state directory {path}: {e.strerror or e}",
                          source=source) from e
    if not os.path.isdir(path):
        raise ConfigError(f"{path} is not a directory (the state directory holds the grant "
                          "checkpoint and the record `run` keeps for `device-plugin`)",
                          source=source)
    if create and not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"the state directory {path} is not writable", source=source)
    st = os.stat(path)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        # whoever else may write there could forge the grants `run` restores (a device
        # held twice) or the record the device plugin trusts
        raise ConfigError(
            f"the state directory {path} is owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}: it must be this process's (uid "
            f"{os.geteuid()}) and writable by no one else (chmod go-w)", source=source)


def state_dir_source(flag: str | None, config_path: str) -> str:
    """What chose the state directory, for messages: --state-dir, the config file's
    state_dir, or the default."""
    if flag:
        return "--state-dir"
    return f"{config_path}: state_dir" if config_path else "state_dir (default)"


def _new_file(directory: str, prefix: str) -> tuple[int, str]:
    """A new file (mode 0600) in `directory` to be renamed over the one it replaces, as
    tempfile.mkstemp makes one; without tempfile, whose import (random, shutil) `run`
    would pay for before it registers (it writes the checkpoint first)."""
    for n in itertools.count():
        path = os.path.join(directory, f"{prefix}{os.getpid()}-{n}")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                           0o600), path
        except FileExistsError:  # left by an earlier process of the same pid
            continue
    raise AssertionError("unreachable")


def boottime() -> float:
    """Seconds since boot, including suspend: the one clock every process of the node
    shares that never jumps (CLOCK_BOOTTIME)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class _NriRecord(Struct, frozen=True):
    """The fields of `<state dir>/nri-plugin.json`, all required, of these types."""

    registered: bool
    runtime: str
    plugin: str
    pid: int
    heartbeat: float


class NriStatus(Struct, frozen=True):
    """The NRI side's registration as `run` records it for the device plugin
    (`<state dir>/nri-plugin.json`): written on every change and refreshed every
    HEARTBEAT seconds while it runs, always by rename, so the file is a regular file of
    about 120 bytes.

    load() reads it without trusting it: opened non-blocking and without following a
    symbolic link, it must be a regular file of at most MAX_BYTES holding a JSON object
    with every field of the right type and a finite heartbeat. Anything else (a FIFO, a
    device, a directory, a symlink, a huge or truncated file, bad JSON) reads as not
    registered, `problem` saying what is wrong with the file, and never raises: the
    device plugin reads it on its event loop at every poll and request."""

    registered: bool
    runtime: str = ""  # "containerd v2.3.4"
    plugin: str = ""  # "40-nri-accel"
    pid: int = 0
    heartbeat: float = 0.0  # boottime() of the last write
    problem: str = ""  # load(): why the file there is not a record (never saved)

    HEARTBEAT = 2.0  # seconds between writes while `run` lives
    STALE = 10.0  # a record older than this means `run` is gone (the grace period)
    FUTURE = 1.0  # a record this far ahead of the clock is not believed
    MAX_BYTES = 64 << 10  # the largest record read; `run` writes about 120 bytes

    def fresh(self, now: float | None = None) -> bool:
        age = (boottime() if now is None else now) - self.heartbeat
        return -self.FUTURE <= age <= self.STALE

    def usable(self, now: float | None = None) -> bool:
        """The NRI side is registered with the runtime and alive."""
        return self.registered and self.fresh(now)

    def why_not(self, now: float | None = None) -> str:
        if self.problem:
            return self.problem
        if not self.heartbeat:
            return "no `nri-accel run` has recorded its state on this node"
        age = (boottime() if now is None else now) - self.heartbeat
        if age < -self.FUTURE:
            return (f"`nri-accel run` (pid {self.pid}) recorded its state {-age:.0f} s in "
                    "the future of this node's boot clock (a record from an earlier boot, "
                    "or a writer with another clock); not believed until `run` writes it "
                    "again")
        if not self.fresh(now):
            return f"`nri-accel run` (pid {self.pid}) stopped updating its state {age:.0f} s ago"
        if not self.registered:
            return "`nri-accel run` is not registered with the container runtime"
        return ""

    def save(self, state_dir: str) -> None:
        os.makedirs(state_dir, mode=0o755, exist_ok=True)
        data = {"registered": self.registered, "runtime": self.runtime,
                "plugin": self.plugin, "pid": self.pid, "heartbeat": self.heartbeat}
        fd, tmp = _new_file(state_dir, ".nri-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, os.path.join(state_dir, NRI_STATUS_FILE))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, state_dir: str) -> NriStatus:
        """The recorded status. An absent record reads as not registered (no `problem`:
        `run` has not written one yet), one that cannot be read or is not a record as
        not registered with a `problem` naming the file and what is wrong with it."""
        path = os.path.join(state_dir, NRI_STATUS_FILE)
        try:  # `run` renames a regular file into place: a link there is never its record
            data = read_regular(path, cls.MAX_BYTES, follow=False)
        except FileNotFoundError:
            return cls(registered=False)
        except UnreadableFile as e:  # a FIFO, /dev/zero: never waited on, never read whole
            return cls._malformed(path, f"is {e.strerror}")
        except OSError as e:
            if e.errno == errno.ELOOP:
                return cls._malformed(path, "is a symbolic link, not a regular file")
            return cls._malformed(path, f"cannot be read: {e.strerror or e}")
        try:
            rec = _NRI_DECODER.decode(data)
        except (ValueError, RecursionError) as e:  # msgspec's errors are ValueErrors
            return cls._malformed(path, f"is not a valid record: {str(e)[:200]}")
        if not math.isfinite(rec.heartbeat) or rec.heartbeat <= 0:
            return cls._malformed(path, f"is not a valid record: heartbeat {rec.heartbeat}")
        return cls(registered=rec.registered, runtime=rec.runtime, plugin=rec.plugin,
                   pid=rec.pid, heartbeat=rec.heartbeat)

    @classmethod
    def _malformed(cls, path: str, what: str) -> NriStatus:
        return cls(registered=False, problem=(
            f"{path} exists but {what}: not a record of `nri-accel run` (which writes a "
            "small JSON file there every few seconds while it runs)"))


_NRI_DECODER = msgspec.json.Decoder(_NriRecord)


class CheckpointWriter:
    """Writes the checkpoint after changes, off the event loop, one write at a time:
    changes made while a write is in flight are written by the next one (so a burst of
    creates costs a few writes, not one each). `snapshot` returns the grants to write
    and `known` whether the state is known (Holdings.known: the checkpoint keeps it;
    always, when not given), both cheap and taken on the loop; serialising and writing
    happen in a worker thread."""

    def __init__(self, checkpoint: Checkpoint, snapshot: Callable[[], Iterable[Grant]],
                 known: Callable[[], bool] | None = None) -> None:
        self.checkpoint = checkpoint
        self._snapshot = snapshot
        self._known = known or (lambda: True)
        self._dirty = False
        self._task: asyncio.Task[None] | None = None
        self._changes = 0  # changes so far
        self._waiting: list[tuple[int, asyncio.Future[bool]]] = []  # (change, its write)
        self.failures = 0

    def changed(self) -> asyncio.Future[bool]:
        """Something changed: write soon. Call from the event loop. Returns a future
        done once a write that took its snapshot after this change has finished: True,
        or False where it failed (which is logged). What an answer waits for that must
        not reach the runtime before the grant it reports is in the checkpoint."""
        self._dirty = True
        self._changes += 1
        loop = asyncio.get_running_loop()
        written = loop.create_future()
        self._waiting.append((self._changes, written))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain())
        return written

    async def flush(self) -> None:
        """Wait until what changed so far is written (or failed)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _drain(self) -> None:
        while self._dirty:
            self._dirty = False
            covered = self._changes
            grants, known = tuple(self._snapshot()), self._known()
            ok = False
            try:
                await asyncio.to_thread(self._write, grants, known)
                ok = True
            except Exception as e:  # OSError: the disk's; any other, a bug: failed all the same
                self.failures += 1
                log.error("checkpoint_write_failed", path=self.checkpoint.path,
                          error=(isinstance(e, OSError) and e.strerror) or str(e),
                          risk="a restart without Synchronize would not know these grants")
            else:
                self.failures = 0
            finally:
                waiting, self._waiting = self._waiting, []
                for change, written in waiting:
                    if change > covered:
                        self._waiting.append((change, written))
                    elif not written.done():
                        written.set_result(ok)

    def _write(self, grants: tuple[Grant, ...], known: bool) -> None:
        holdings = Holdings()
        holdings.replace_all(grants, known=known)
        self.checkpoint.save(holdings.to_json(self.checkpoint.boot_id))
