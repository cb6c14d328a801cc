"""The vendor profile interface: what an accelerator family owns, and the types it uses.

Owns: Profile (the base class every family subclasses), VisibleDevicesProfile (a
family asked for through one *_VISIBLE_DEVICES variable), EnvAsk and EnvSource (what a
family reads from a container's env), FamilyEdits (what a family adds for a selection), HealthWatch
(what a family's health monitor is to the device plugin) and the DriverFiles view of
the edits catalog a family reads. Imports the standard library, msgspec, nri_accel.config
(types), nri_accel.errors, nri_accel.inventory, nri_accel.syntax and
nri_accel.discover.base (Found). Pure, except discover() and probe(), which read the
host through a HostRoot, and health_monitor(), whose watch does.

A family is everything nri-accel knows about one kind of accelerator. The generic stages
(discover, request, policy, select, edits, the device plugin, explain) loop over the
registered profiles and ask each only about its own devices; nothing outside a family's
module names its kinds, its variables or its rules. The NVIDIA profile
(nri_accel/vendors/nvidia) is the worked example of every hook:

discovery (start-up and refresh; I/O only through the HostRoot)
  discover(root, config) -> Found
      The family's devices (kind, name, stable identity in uuid or pci_bus_id, device
      nodes taken with lstat, NUMA node, links, health), its Driver (shared edits by
      capability: NVIDIA's "" holds /dev/nvidiactl, "compute" the CUDA libraries) and a
      Problem for everything it could not do. Never raises for a missing driver.
  probe(root, config) -> list of (path, state)
      What changes when the node changes (driver version files, the family's /dev
      entries with their lstat identity, NVIDIA's MIG capability tree); the refresher
      rediscovers when any entry moves.
  native
      True for families with their own discoverer: their kinds are served by them alone
      (a CDI spec for nvidia.com/gpu is then ignored). False for the generic CDI family.

requests (the hot path: pure, memoised by the caller)
  env_names, env_prefixes
      The environment variables the family reads. No other variable is ever looked at.
  read_env(env) -> EnvAsk
      The family's env grammar: NVIDIA_VISIBLE_DEVICES=all|none|void|0,1|GPU-..., NV_GPU,
      NVIDIA_DRIVER_CAPABILITIES, NVIDIA_REQUIRE_*, NVIDIA_MIG_*; each device request an
      EnvSource of claims (trust is the policy's business, not the family's), each ask
      only a granting source may make listed in `privileged`, the rest of what it read
      in `options` (hashable: it keys memos). RequestError names the variable of a
      malformed device request; a malformed variable that only qualifies a grant
      (NVIDIA_DRIVER_CAPABILITIES, NVIDIA_REQUIRE_*, ...) is the ask's `problem`, which
      refuses a container granted a device of the family and no other, as the toolkit
      reads those only for a GPU container.
  option_key, settings(ask, annotation) -> options
      An annotation the family reads with NRI's precedence (NVIDIA: the capabilities
      annotation, which wins over NVIDIA_DRIVER_CAPABILITIES) and how it combines with
      the env's options.
  id_pattern
      An id form beyond CDI's device-name syntax (NVIDIA: legacy MIG-GPU-<uuid>/<gi>/<ci>).

selection (pure, over the inventory's tables)
  members
      kind -> the kinds its ids and `all` cover (NVIDIA: a nvidia.com/gpu id may name a
      MIG device, and nvidia.com/gpu=all means every GPU and MIG device).
  countable(device)
      Whether a count may choose this healthy device (NVIDIA: not a GPU in MIG mode).
  refuse_named(device, options, index) -> reason or ""
      Why a device may not be granted when named (NVIDIA: a GPU in MIG mode, whose MIG
      devices are what a workload can use).
  check(devices, specific, options, index)
      The family's rules over the whole selection (NVIDIA: MIG capabilities beside
      specific MIG devices, NVIDIA_REQUIRE_* against each granted GPU). Raises
      RequestError naming the variable or annotation.

edits (pure, over the checked catalog)
  edits(devices, options, drivers_only, files) -> FamilyEdits
      What the container needs for the family's granted devices beyond their own nodes:
      driver files by capability, the env the family's software reads
      (NVIDIA_VISIBLE_DEVICES=<uuids>, AWS_NEURON_VISIBLE_DEVICES, HABANA_VISIBLE_MODULES,
      ...), library directories for LD_LIBRARY_PATH, notes and facts for the log line.
      The default gives each used driver's "" edits.
  tables(inventory) -> anything
      What the family computes once per inventory for edits() (Neuron: each device's
      first NeuronCore in the node-wide numbering), handed back as files.table(name).
  env_defaults
      The variables edits() may set as defaults (FamilyEdits.defaults: only where the
      container does not set them); the Engine reads the container's values of these.
  visibility = (variable, value granting nothing)
      The variable a co-installed vendor hook would read (NVIDIA_VISIBLE_DEVICES, "void"):
      rewritten when the container's env sets it (or another variable by which that
      hook selects devices: NV_GPU, HABANA_VISIBLE_MODULES) and the family got no
      device, so no other hook can widen what nri-accel granted. Rewritten, never
      removed: from NRI v0.10 (containerd 2.x), the runtime drops an adjustment's
      removal of a variable that no plugin set (pkg/adaptation/result.go, adjustEnv:
      removals clear other plugins' entries and the plugins' view of the env, only
      additions reach the spec), so the image's value would stay.
  nothing_env(options) -> ((variable, value), ...)
      What that rewrite writes: the visibility variable with its "nothing" value (AMD:
      every DOCKER_RESOURCE_* the env sets too, see VisibleDevicesProfile).

device plugin and display
  resources(device, config) -> resource names under which kubelet sees the device
      (none: deliberately not advertised; ValueError: cannot be, with the reason).
      `config` is the DevicePluginConfig: a name comes from
      config.resource_name(kind, default), so [device_plugin.resource_names] renames
      any kind ("" leaves it out); NVIDIA applies mig_strategy here (mixed:
      nvidia.com/mig-<profile>; single: the GPU resource; none: whole GPUs only).
  check_resources(devices, config)
      The family's rules over all its devices together, before any is advertised;
      ValueError with the reason leaves every device of the family out (NVIDIA's
      single strategy: every GPU in MIG mode, one MIG profile, as k8s-device-plugin
      refuses otherwise).
  health_monitor(root, inventory, config, on_change) -> a HealthWatch or None
      Follows the health of the family's devices while the device plugin runs (NVIDIA:
      NVML XID, ECC and lost-GPU events through .health.HealthMonitor, when
      [health] enabled and the inventory has GPUs); None when there is nothing to
      watch. The watch calls `on_change` on the asyncio loop that started it, with
      the whole map of the family's unhealthy devices (Device.key -> reason) each time
      it changes; start() is called on that loop, stop() may block (the caller runs
      it in a thread).
  partition(device, inventory) -> how a device is partitioned, for `discover`'s MIG
      column (NVIDIA: "enabled, 3 instances", a MIG device's profile and ids)

A device with `parent` is a part of another device of its family (a MIG device of
its GPU, a NeuronCore of its Neuron device): the family's kinds list the whole's kind
first, so parent_of() (nri_accel.vendors) finds it; nri_accel.state.Holdings never
lets a whole and one of its parts be held by different containers.

Adding a family: write nri_accel/vendors/<family>.py with a Profile subclass (a module
docstring citing the upstream sources of every fact), add one line to PROFILES in
nri_accel/vendors/__init__.py, add a fake root under tests/fakes/roots/<name>/ with a
README saying what real node it stands for, and tests of its discovery and env grammar.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from msgspec import Struct
from msgspec.structs import replace

from nri_accel.discover.base import Found
from nri_accel.errors import AllocationError, RequestError
from nri_accel.inventory import ContainerEdits, Device
from nri_accel.syntax import ClaimSet, DeviceClaim, check_id

if TYPE_CHECKING:
    from nri_accel.config import Config, DevicePluginConfig
    from nri_accel.discover.hostroot import HostRoot

BASE = ""  # the Driver capability every container using the driver gets
OnHealthChange = Callable[[Mapping[str, str]], None]  # Device.key -> why unhealthy
_NO_EDITS = ContainerEdits()


class HealthWatch(Protocol):
    """What Profile.health_monitor returns (see the module docstring)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class EnvSource(Struct, frozen=True):
    """One env variable's device request, before the trust policy."""

    name: str  # "env NVIDIA_VISIBLE_DEVICES"
    claims: tuple[DeviceClaim, ...]
    text: str  # the value, for notes
    drivers_only: bool = False  # the family's driver files and no device (NVIDIA "none")


class EnvAsk(Struct, frozen=True):
    """What a family read from one container's env (memoised per env)."""

    sources: tuple[EnvSource, ...] = ()
    privileged: tuple[str, ...] = ()  # sources of asks only a granting origin may make
    options: Hashable = None  # the family's own reading, handed to settings()
    visible: bool = False  # the env sets the family's visibility variable (or implies it)
    problem: tuple[str, str] = ()  # (source, message): a variable that only qualifies a
    # grant of the family is malformed; the container is refused where it gets one


NO_ASK = EnvAsk()


class FamilyEdits(Struct, frozen=True):
    """What a family adds to a container for its granted devices, beyond their nodes."""

    parts: tuple[ContainerEdits, ...] = ()  # driver files, merged in this order
    env: tuple[tuple[str, str], ...] = ()  # variables the family sets
    defaults: tuple[tuple[str, str], ...] = ()  # set only where the container does not
    lib_dirs: tuple[str, ...] = ()  # container directories of mounted libraries
    notes: tuple[str, ...] = ()
    facts: tuple[tuple[str, str], ...] = ()  # for the log line and explain


class Checked(Struct, frozen=True):
    """One device's or driver capability's edits after the safety checks: either the
    edits or why they may not be emitted."""

    edits: ContainerEdits = _NO_EDITS
    refused: str = ""  # why these edits may not be emitted
    lib_dirs: tuple[str, ...] = ()  # container dirs holding mounted shared libraries
    dropped_hooks: int = 0  # hooks left out because devices.hooks is off


class DriverFiles(Struct, frozen=True):
    """The checked driver edits of one inventory, as families read them: (driver vendor,
    capability) -> Checked; and each family's tables() of that inventory."""

    checked: Mapping[tuple[str, str], Checked] = MappingProxyType({})
    tables: Mapping[str, Any] = MappingProxyType({})

    def table(self, family: str) -> Any:
        return self.tables.get(family)

    def capabilities(self, vendor: str) -> frozenset[str]:
        """The capabilities the driver `vendor` has files for (BASE included)."""
        return frozenset(cap for v, cap in self.checked if v == vendor)

    def take(self, vendor: str, cap: str, notes: list[str]) -> tuple[ContainerEdits,
                                                                     tuple[str, ...]]:
        """The edits of `vendor`'s capability `cap` and their library directories (empty
        when the driver has none); AllocationError when they were refused."""
        checked = self.checked.get((vendor, cap))
        if checked is None:
            return ContainerEdits(), ()
        where = f"driver {vendor}" + (f" capability {cap}" if cap else "")
        return take(checked, where, notes), checked.lib_dirs


def take(checked: Checked, source: str, notes: list[str]) -> ContainerEdits:
    """Checked edits, or AllocationError naming `source` when they were refused; a note
    when hooks were left out."""
    if checked.refused:
        raise AllocationError(f"refused the inventory's edits: {checked.refused}", source=source)
    if checked.dropped_hooks:
        notes.append(f"{source}: {checked.dropped_hooks} hook(s) not emitted "
                     "(devices.hooks is off)")
    return checked.edits


class Profile:
    """One accelerator family. Subclasses set the class attributes and override the
    hooks they need; the defaults describe a family of plain devices (every node its
    own, no env grammar, no rules)."""

    name: ClassVar[str] = ""  # the family: Device.vendor and Driver.vendor of its devices
    kinds: ClassVar[tuple[str, ...]] = ()  # kinds it discovers
    native: ClassVar[bool] = True
    env_names: ClassVar[frozenset[str]] = frozenset()
    env_prefixes: ClassVar[tuple[str, ...]] = ()
    option_key: ClassVar[str] = ""
    id_pattern: ClassVar[re.Pattern[str] | None] = None
    members: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({})
    visibility: ClassVar[tuple[str, str] | None] = None
    env_defaults: ClassVar[frozenset[str]] = frozenset()  # FamilyEdits.defaults' names

    # ---- discovery ------------------------------------------------------------------

    def discover(self, root: HostRoot, config: Config) -> Found:
        return Found()

    def probe(self, root: HostRoot, config: Config) -> list[tuple[str, Any]]:
        return []

    # ---- requests -------------------------------------------------------------------

    def read_env(self, env: Mapping[str, str]) -> EnvAsk:
        return NO_ASK

    def read_option(self, value: str, source: str) -> Hashable:
        """The family's annotation (option_key) parsed; RequestError names `source`."""
        return None

    def settings(self, ask: EnvAsk, option: Hashable) -> Hashable:
        """The options select() and edits() see, from the env's reading and the
        annotation's (None when the pod does not set it)."""
        return ask.options

    # ---- selection ------------------------------------------------------------------

    def countable(self, device: Device) -> bool:
        return True

    def unknown_hint(self, ident: str, inventory: Any) -> str:
        """Why `ident`, which names none of the family's devices, names none, where more
        can be said than what the node has ("" where nothing can)."""
        return ""

    def refuse_named(self, device: Device, options: Hashable, inventory: Any) -> str:
        return ""

    def check(self, devices: Sequence[Device], specific: Sequence[Device], options: Hashable,
              inventory: Any) -> None:
        """`devices`: the family's granted devices; `specific`: those of them named or
        counted (not only reached through `all`)."""

    # ---- edits ----------------------------------------------------------------------

    def tables(self, inventory: Any) -> Any:
        return None

    def nothing_env(self, options: Hashable) -> tuple[tuple[str, str], ...]:
        """The env of a container granted none of the family's devices whose env sets
        its visibility variable (or implies it): that variable with the value that
        grants nothing (see `visibility`; only for a family that has one)."""
        assert self.visibility is not None
        return (self.visibility,)

    def edits(self, devices: Sequence[Device], options: Hashable, drivers_only: bool,
              files: DriverFiles) -> FamilyEdits:
        notes: list[str] = []
        parts = tuple(files.take(vendor, BASE, notes)[0]
                      for vendor in dict.fromkeys(d.vendor for d in devices if d.vendor))
        return FamilyEdits(parts=parts, notes=tuple(notes))

    # ---- device plugin --------------------------------------------------------------

    def resources(self, device: Device, config: DevicePluginConfig) -> tuple[str, ...]:
        name = config.resource_name(device.kind)
        return (name,) if name else ()

    def check_resources(self, devices: Sequence[Device], config: DevicePluginConfig) -> None:
        """Raise ValueError when the family's `devices` cannot be advertised as configured."""

    def health_monitor(self, root: HostRoot, inventory: Any, config: Config,
                       on_change: OnHealthChange,
                       marked: Mapping[str, str] = MappingProxyType({}),
                       ) -> HealthWatch | None:
        return None

    def partition(self, device: Device, inventory: Any) -> str:
        return ""

    # ---- parts ----------------------------------------------------------------------

    def partition_whole(self, device: Device) -> Device:
        """The PCI function a partition (Device.partition) is a part of, which no
        inventory lists while it is partitioned, under the key the family gives that
        function whole (here its PCI bus id)."""
        return Device(kind=device.kind, name=device.pci_bus_id, pci_bus_id=device.pci_bus_id)

    # ---- grants ---------------------------------------------------------------------

    def current_key(self, key: str, inventory: Any) -> str:
        """The key that names now the device a grant (an annotation, a checkpoint)
        recorded as `key`, a key of one of the family's kinds that `inventory` does not
        know: where the family once keyed devices otherwise, the device's key now;
        else `key` (a device that vanished)."""
        return key


class VisibleDevicesProfile(Profile):
    """The usual shape of a family asked for through one visibility variable
    (HABANA_VISIBLE_DEVICES, AMD_VISIBLE_DEVICES) whose container env follows from the
    granted devices alone. A subclass sets `visible_var` and `visible_none` (the value
    that grants nothing, written where nothing is granted), optionally `selectors` and
    `selector_prefixes`, and implements parse_visible() and container_env()."""

    visible_var: ClassVar[str] = ""
    visible_none: ClassVar[str] = ""
    selectors: ClassVar[tuple[str, ...]] = ()
    """Other variables the vendor's runtime selects devices by where `visible_var` is
    unset. nri-accel grants nothing for them, but one set implies `visible_var`, so that
    a container granted nothing gets `visible_none` there (the runtime reads it first)."""
    selector_prefixes: ClassVar[tuple[str, ...]] = ()
    """Variables, by the start of their names, that the vendor's runtime reads as
    `visible_var` itself, in the env's order, the last one winning (AMD's
    DOCKER_RESOURCE_*). One set implies `visible_var`, as a selector does, and each one
    set is written with the value `visible_var` gets (the devices granted, or
    `visible_none`): rewriting `visible_var` alone, in its place, would leave one after it
    to widen the grant. Their names are the family's settings (read_env's options)."""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.env_names = frozenset({cls.visible_var, *cls.selectors})
        cls.env_prefixes = cls.selector_prefixes
        cls.visibility = (cls.visible_var, cls.visible_none)

    def parse_visible(self, value: str) -> str | tuple[str, ...] | None:
        """The variable's value: None when it asks no device, "all", or device ids;
        ValueError for anything else."""
        raise NotImplementedError

    def container_env(self, granted: Sequence[Device]) -> Mapping[str, str]:
        """The variables the container gets for `granted` (none for an empty grant)."""
        raise NotImplementedError

    def read_env(self, env: Mapping[str, str]) -> EnvAsk:
        """Unset asks nothing (`visible` where a selector is set); a value asking no
        device still sets the variable (`visible`); a malformed one is a RequestError
        naming the variable. Options: the names of the variables set that start with
        one of `selector_prefixes`, sorted (None for none)."""
        prefixed = tuple(sorted(k for k in env if k.startswith(self.selector_prefixes))
                         ) if self.selector_prefixes else ()
        ask = self._read_visible(env, selected=bool(prefixed))
        return replace(ask, options=prefixed) if prefixed else ask

    def _read_visible(self, env: Mapping[str, str], selected: bool) -> EnvAsk:
        """read_env() but for its options; `selected`: a prefixed variable is set."""
        var = self.visible_var
        if var not in env:
            selected = selected or any(s in env for s in self.selectors)
            return EnvAsk(visible=True) if selected else NO_ASK
        name = f"env {var}"
        value = env[var]
        try:
            parsed = self.parse_visible(value)
        except ValueError as e:
            raise RequestError(str(e), source=name) from e
        if parsed is None:
            return EnvAsk(visible=True)
        kind = self.kinds[0]
        if parsed == "all":
            claims: tuple[DeviceClaim, ...] = (DeviceClaim(kind, all=True, source=name),)
        else:
            acc = ClaimSet(name)
            for ident in parsed:
                acc.add_id(kind, check_id(ident, name))
            claims = acc.claims()
        return EnvAsk(sources=(EnvSource(name, claims, value),), visible=True)

    def edits(self, devices: Sequence[Device], options: Hashable, drivers_only: bool,
              files: DriverFiles) -> FamilyEdits:
        base = super().edits(devices, options, drivers_only, files)
        env = self.container_env(devices)
        value = env.get(self.visible_var)
        also = tuple((name, value) for name in options or ()) if value else ()
        return FamilyEdits(parts=base.parts, notes=base.notes, env=(*env.items(), *also))

    def nothing_env(self, options: Hashable) -> tuple[tuple[str, str], ...]:
        nothing = self.visible_none
        return (*super().nothing_env(options), *((name, nothing) for name in options or ()))


def joined_ranges(numbers: Iterable[int]) -> str:
    """Sorted, de-duplicated numbers as ranges "a-b" joined by commas ("0-3,6")."""
    ids = sorted(set(numbers))
    out: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)
