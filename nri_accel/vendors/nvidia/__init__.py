"""The NVIDIA family: GPUs and MIG devices, the worked example of a vendor profile.

Owns: the NVIDIA kinds, the NVIDIA env grammar (NVIDIA_VISIBLE_DEVICES, NV_GPU,
NVIDIA_DRIVER_CAPABILITIES and the capabilities annotation, NVIDIA_REQUIRE_* through
.requirements, NVIDIA_MIG_CONFIG_DEVICES, NVIDIA_MIG_MONITOR_DEVICES), the MIG selection
rules, the env and driver files a selection brings, and the device plugin's NVIDIA
resource names. Discovery lives in .discover (NVML through nri_accel.discover.nvml),
imported only when the node is discovered, and device health in .health, imported only
when the device plugin watches it. Imports the standard library, msgspec, nri_accel.errors,
nri_accel.inventory, nri_accel.syntax, nri_accel.vendors.base and this package's
requirements; pure except discover(), probe() and health_monitor().

The env grammar follows nvidia-container-toolkit (internal/config/image) and
libnvidia-container:

- NVIDIA_VISIBLE_DEVICES: comma-separated, blanks trimmed, empty tokens skipped; void
  (or empty, or unset) means no GPU and no driver, none means the driver without a GPU,
  all (any case: libnvidia-container's select_devices) means every GPU, and when they
  are mixed void > none > all, whatever their order,
  other ids beside them ignored (devices.go NewVisibleDevices); otherwise indices, GPU-/
  MIG- UUIDs, PCI bus ids, "gpu:mig" pairs, or CDI qualified names (as the toolkit
  accepts in CDI mode, "<kind>=all" beside ids of that kind being all of them), among
  them runtime.nvidia.com/gpu=<id>, the toolkit's just-in-time CDI devices, mapped onto
  this node's GPUs and MIG devices for exactly the ids jit-CDI generates a device for
  (all, GPU index, MIG index, GPU-/MIG- UUID). Unset in a legacy image (CUDA_VERSION
  without NVIDIA_REQUIRE_CUDA) means all. NV_GPU (nvidia-docker 2: ids separated by
  blanks or commas) is read when NVIDIA_VISIBLE_DEVICES is unset.
- NVIDIA_DRIVER_CAPABILITIES (or the capabilities.nri-accel.io annotation, which wins):
  comma-separated capabilities; unset or empty means utility,compute; a value of only
  blanks and commas means no capability (the toolkit's hook takes any non-empty value
  as the list); all means every one; unknown names are refused. Unset in a legacy image
  means all. compat32 adds the 32-bit builds of the libraries the other capabilities
  requested select (libnvidia-container filters libs32 as it filters libs), nothing
  alone.
- NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES: "" asks nothing, "all" asks for
  the capability, anything else is refused (migCapsDevices.Validate). Only a source that
  may grant devices may ask them (the toolkit: a privileged container).

Selection (libnvidia-container select_devices): a nvidia.com/gpu id may name a MIG device
and nvidia.com/gpu=all is every healthy GPU and MIG device; a GPU in MIG mode is never
counted and is refused when named, except for a container asking for MIG config or
monitor capabilities, which in turn are refused beside specific MIG devices; every
granted GPU or MIG device (a MIG device has its parent's arch and brand) must satisfy
NVIDIA_REQUIRE_*, and with NVIDIA_VISIBLE_DEVICES=none the driver facts alone are checked.

Edits: the driver's "" files, the files of each requested capability the driver has,
with compat32 then each of their "compat32/<capability>" 32-bit builds (64-bit first, so
LD_LIBRARY_PATH lists lib64 first), mig-config/mig-monitor when asked,
NVIDIA_VISIBLE_DEVICES rewritten to the UUIDs injected ("none" for the driver alone,
"void" when the image asked and nothing was granted) and NVIDIA_DRIVER_CAPABILITIES to
the capabilities given (left as it is when none is).

Device plugin ([device_plugin] mig_strategy, as NVIDIA's k8s-device-plugin
internal/rm/device_map.go; the resource names are [device_plugin.resource_names]' for
nvidia.com/gpu and nvidia.com/mig, by default those kinds):
- "mixed" (the default): nvidia.com/gpu for whole GPUs not in MIG mode,
  nvidia.com/mig-<profile> for MIG devices (nvidia.com/mig-1g.10gb.me for the
  media-extension profile 1g.10gb+me); a GPU in MIG mode only as its MIG devices.
- "single": the MIG devices under nvidia.com/gpu, when every GPU is in MIG mode, each
  with MIG devices, all of one profile; otherwise, as k8s-device-plugin refuses to
  start ("all devices on the node must be configured with the same migEnabled value",
  "more than one MIG device type present on node", "device has an invalid MIG
  configuration"), no NVIDIA device is advertised and the reason is logged. A node
  with no GPU in MIG mode is served as with "none".
- "none": nvidia.com/gpu for whole GPUs, MIG devices ignored. A GPU in MIG mode is left
  out with a reason, where k8s-device-plugin hands it out whole: a workload cannot
  compute on a GPU in MIG mode, and `run` refuses it when named (selection rules above).
Health: .health.HealthMonitor over NVML events (health_monitor), while [health] enabled.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from msgspec import Struct

from nri_accel.errors import RequestError, cut
from nri_accel.inventory import Device
from nri_accel.memo import memoized
from nri_accel.syntax import ClaimSet, DeviceClaim, check_id, check_kind, check_text
from nri_accel.vendors.base import (
    BASE,
    DriverFiles,
    EnvAsk,
    EnvSource,
    FamilyEdits,
    HealthWatch,
    OnHealthChange,
    Profile,
)
from nri_accel.vendors.nvidia.requirements import (
    CUDA_VERSION,
    DISABLE_REQUIRE,
    REQUIRE_PREFIX,
    Requirements,
    legacy_cuda_image,
    requirements_from_env,
)

if TYPE_CHECKING:
    from nri_accel.config import Config, DevicePluginConfig
    from nri_accel.discover.base import Found
    from nri_accel.discover.hostroot import HostRoot

VENDOR = "nvidia"
KIND_GPU = "nvidia.com/gpu"
KIND_MIG = "nvidia.com/mig"

ENV_VISIBLE = "NVIDIA_VISIBLE_DEVICES"
ENV_NV_GPU = "NV_GPU"
ENV_CAPABILITIES = "NVIDIA_DRIVER_CAPABILITIES"
ENV_MIG_CONFIG = "NVIDIA_MIG_CONFIG_DEVICES"
ENV_MIG_MONITOR = "NVIDIA_MIG_MONITOR_DEVICES"
ENV_IMEX = "NVIDIA_IMEX_CHANNELS"
CAPABILITIES_KEY = "capabilities.nri-accel.io"

# libnvidia-container / nvidia-container-toolkit driver capabilities.
ALL_CAPABILITIES = frozenset(
    {"compute", "compat32", "graphics", "utility", "video", "display", "ngx"})
DEFAULT_CAPABILITIES = frozenset({"utility", "compute"})
CAPABILITY_ORDER = ("utility", "compute", "video", "graphics", "display", "ngx")
COMPAT32 = "compat32"
# The Driver capability holding the 32-bit builds of one capability's libraries:
# "compat32/compute" (discovery writes one per capability on nodes with a 32-bit ABI).
COMPAT32_PREFIX = COMPAT32 + "/"
# The Driver capability holding one GPU's DRM nodes (/dev/dri/card<N>, renderD<N>):
# "drm/0000:07:00.0", by its PCI bus id; given beside graphics or display to a container
# granted that GPU, as the toolkit's graphics modifier gives them (a MIG device has none).
DRM_PREFIX = "drm/"
GRAPHICS_CAPABILITIES = frozenset({"graphics", "display"})
MIG_CONFIG = "mig-config"  # Driver capabilities that are not driver capabilities of a
MIG_MONITOR = "mig-monitor"  # request: the MIG management nodes
NOT_CAPABILITIES = frozenset({BASE, MIG_CONFIG, MIG_MONITOR})
# The Driver capability holding IMEX channel N's node: "imex-channel/0" (discovery
# writes one for each /dev/nvidia-caps-imex-channels/channel<N> the host has).
IMEX_CHANNEL_PREFIX = "imex-channel/"
IMEX_CHANNEL = r"0|[1-9][0-9]{0,6}"  # a channel number, in NVIDIA_IMEX_CHANNELS and /dev
MAX_IMEX_CHANNELS = 64  # channels one container may ask for (a node has up to 2048)

# The one id with '/': R450-era MIG UUIDs, MIG-GPU-<gpu uuid>/<gi>/<ci>.
LEGACY_MIG_RE = re.compile(r"MIG-GPU-[0-9A-Fa-f-]{36}/[0-9]{1,3}/[0-9]{1,3}")
# The CDI kind of nvidia-container-toolkit's just-in-time CDI mode (internal/modifier/
# cdi.go automaticDeviceKind): a spec is generated for the ids named, which are what
# pkg/nvcdi GetDeviceSpecsBy takes (go-nvlib device.Identifier): all, a GPU index, a MIG
# index "<gpu>:<mig>", a GPU UUID, a MIG UUID (either form).
KIND_JIT = "runtime.nvidia.com/gpu"
_UUID = r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}"
_JIT_UUID_RE = re.compile(rf"GPU-{_UUID}|MIG-{_UUID}|MIG-GPU-{_UUID}/[0-9]+/[0-9]+")
_JIT_INDEX_RE = re.compile(r"([0-9]{1,10})(?::([0-9]{1,10}))?")
_MAX_LISTED = 16


def mig_enabled(device: Device) -> bool:
    """A GPU in MIG mode: only its MIG devices are usable by a workload."""
    return device.kind == KIND_GPU and device.attributes.get("mig_mode") == "enabled"


class EnvOptions(Struct, frozen=True):
    """What the NVIDIA env says beyond device requests (memoised with the env)."""

    capabilities: tuple[str, str] | None = None  # (source, value) of the env variable
    requirements: Requirements | None = None
    legacy: bool = False  # CUDA_VERSION without NVIDIA_REQUIRE_CUDA
    mig_config: bool = False
    mig_monitor: bool = False
    imex_channels: tuple[str, ...] = ()  # NVIDIA_IMEX_CHANNELS: numbers, or ("all",)


class Options(Struct, frozen=True, cache_hash=True):
    """What select() and edits() see of a container's NVIDIA settings. Options key the
    edits memo on every create: the hash, which walks the requirements (2 us for a CUDA
    image's), is computed once per object (and the parse that makes them is memoised)."""

    capabilities: frozenset[str] = DEFAULT_CAPABILITIES
    capabilities_source: str = ""  # "" = the default (utility,compute)
    requirements: Requirements | None = None
    mig_config: bool = False
    mig_monitor: bool = False
    imex_channels: tuple[str, ...] = ()


DEFAULT_OPTIONS = Options()


class NvidiaProfile(Profile):
    name = VENDOR
    kinds = (KIND_GPU, KIND_MIG)
    env_names = frozenset({ENV_VISIBLE, ENV_NV_GPU, ENV_CAPABILITIES, ENV_MIG_CONFIG,
                           ENV_MIG_MONITOR, ENV_IMEX, CUDA_VERSION, DISABLE_REQUIRE})
    env_prefixes = (REQUIRE_PREFIX,)
    option_key = CAPABILITIES_KEY
    id_pattern = LEGACY_MIG_RE
    members = MappingProxyType({KIND_GPU: (KIND_GPU, KIND_MIG)})
    visibility = (ENV_VISIBLE, "void")

    # ---- discovery ------------------------------------------------------------------

    def discover(self, root: HostRoot, config: Config) -> Found:
        from nri_accel.vendors.nvidia.discover import discover_nvidia

        return discover_nvidia(
            root, create_device_nodes=config.discovery.create_device_nodes)

    def probe(self, root: HostRoot, config: Config) -> list[tuple[str, Any]]:
        from nri_accel.vendors.nvidia.discover import probe

        return probe(root)

    # ---- requests -------------------------------------------------------------------

    def read_env(self, env: Mapping[str, str]) -> EnvAsk:
        visible = _visible_devices(env)
        sources = (visible,) if visible is not None else ()
        legacy = legacy_cuda_image(env)
        shown = ENV_VISIBLE in env or ENV_NV_GPU in env or legacy
        caps = env.get(ENV_CAPABILITIES)
        try:  # what qualifies a grant: nvidia-container-toolkit reads it for a GPU
            # container only (getNvidiaConfig returns first where no device is asked)
            if caps is not None:
                parse_capabilities(caps, f"env {ENV_CAPABILITIES}")
            options = EnvOptions(
                capabilities=None if caps is None else (f"env {ENV_CAPABILITIES}", caps),
                requirements=requirements_from_env(env),
                legacy=legacy,
                mig_config=_mig_caps(env, ENV_MIG_CONFIG),
                mig_monitor=_mig_caps(env, ENV_MIG_MONITOR),
                imex_channels=parse_imex_channels(env.get(ENV_IMEX, ""), f"env {ENV_IMEX}"),
            )
        except RequestError as e:
            return EnvAsk(sources=sources, visible=shown, problem=(e.source, e.message))
        privileged = tuple(f"env {var}" for var, asked in (
            (ENV_MIG_CONFIG, options.mig_config), (ENV_MIG_MONITOR, options.mig_monitor),
            (ENV_IMEX, options.imex_channels)) if asked)
        return EnvAsk(sources=sources, privileged=privileged, options=options, visible=shown)

    def read_option(self, value: str, source: str) -> Hashable:
        return parse_capabilities(value, source)

    def settings(self, ask: EnvAsk, option: Hashable) -> Hashable:
        env = ask.options if isinstance(ask.options, EnvOptions) else EnvOptions()
        if option is not None:
            caps, source = option  # type: ignore[misc]
        elif env.capabilities is not None:
            caps, source = parse_capabilities(env.capabilities[1], env.capabilities[0])
        elif env.legacy:
            caps, source = ALL_CAPABILITIES, f"env {CUDA_VERSION} (legacy image: all capabilities)"
        else:
            caps, source = DEFAULT_CAPABILITIES, ""
        if (caps, source) == (DEFAULT_CAPABILITIES, "") and env == EnvOptions():
            return DEFAULT_OPTIONS
        return Options(capabilities=caps, capabilities_source=source,
                       requirements=env.requirements, mig_config=env.mig_config,
                       mig_monitor=env.mig_monitor, imex_channels=env.imex_channels)

    # ---- selection ------------------------------------------------------------------

    def countable(self, device: Device) -> bool:
        return not mig_enabled(device)

    def refuse_named(self, device: Device, options: Hashable, index: Any) -> str:
        opts = _options(options)
        if not mig_enabled(device) or opts.mig_config or opts.mig_monitor:
            return ""
        migs = [d.qualified_name for d in index.inventory.of_kind(KIND_MIG)
                if d.parent == device.name]
        hint = f" ({', '.join(migs)})" if migs else " (it has none configured)"
        return (f"{device.qualified_name} is in MIG mode: request its MIG devices{hint} "
                "instead of the whole GPU")

    def check(self, devices: Sequence[Device], specific: Sequence[Device], options: Hashable,
              index: Any) -> None:
        opts = _options(options)
        if opts.mig_config or opts.mig_monitor:
            _refuse_mig_caps_beside_mig_devices(opts, specific)
        if opts.requirements is not None:
            _check_requirements(index, opts.requirements, devices)
        if opts.imex_channels:
            driver = index.inventory.driver(VENDOR)
            have = driver.capabilities if driver is not None else {}
            if opts.imex_channels == ("all",):
                n = sum(1 for c in have if c.startswith(IMEX_CHANNEL_PREFIX))
                if n > MAX_IMEX_CHANNELS:
                    raise RequestError(f"'all' is this node's {n} IMEX channels, more than the "
                                       f"{MAX_IMEX_CHANNELS} one container may be given: name "
                                       "the channels", source=f"env {ENV_IMEX}")
            elif absent := [n for n in opts.imex_channels
                            if IMEX_CHANNEL_PREFIX + n not in have]:
                raise RequestError(f"no IMEX channel {', '.join(absent)} on this node (/dev/"
                                   "nvidia-caps-imex-channels/channel<N>, made by the "
                                   "IMEX daemon or nvidia-modprobe -i N)",
                                   source=f"env {ENV_IMEX}")

    # ---- edits ----------------------------------------------------------------------

    def edits(self, devices: Sequence[Device], options: Hashable, drivers_only: bool,
              files: DriverFiles) -> FamilyEdits:
        opts = _options(options)
        notes: list[str] = []
        lib_dirs: dict[str, None] = {}
        parts = []

        def add(cap: str) -> None:
            edits, dirs = files.take(VENDOR, cap, notes)
            parts.append(edits)
            lib_dirs.update(dict.fromkeys(dirs))

        add(BASE)
        given: list[str] = []  # the capabilities given, for NVIDIA_DRIVER_CAPABILITIES
        have = files.capabilities(VENDOR)
        if have:
            wanted = opts.capabilities - NOT_CAPABILITIES
            others = sorted(wanted - {COMPAT32}, key=_capability_order)
            missing = [c for c in others if c not in have]
            given = [c for c in others if c in have]
            if not wanted:
                notes.append("no driver capabilities requested: only the driver's shared "
                             "files")
            if COMPAT32 in wanted:
                if any(c.startswith(COMPAT32_PREFIX) for c in have):
                    given.append(COMPAT32)
                    if not others:
                        notes.append("compat32 adds the 32-bit builds of the libraries the "
                                     "other capabilities requested select: none requested")
                else:
                    missing.append(COMPAT32)
            if missing:
                notes.append("driver capabilities with no files on this node: "
                             f"{', '.join(missing)}")
            for cap in given:
                if cap != COMPAT32:
                    add(cap)
            if GRAPHICS_CAPABILITIES.intersection(given):
                for d in devices:
                    if d.kind == KIND_GPU and DRM_PREFIX + d.pci_bus_id in have:
                        add(DRM_PREFIX + d.pci_bus_id)
            # 64-bit before 32-bit, so that LD_LIBRARY_PATH lists lib64 first
            if COMPAT32 in given:
                for cap in others:
                    if COMPAT32_PREFIX + cap in have:
                        add(COMPAT32_PREFIX + cap)
        else:
            notes.append("no NVIDIA driver files on this node: only device nodes and env")
        if opts.mig_config:
            add(MIG_CONFIG)
        if opts.mig_monitor:
            add(MIG_MONITOR)
        if opts.imex_channels:
            channels = opts.imex_channels
            if channels == ("all",):  # every channel the node has
                channels = tuple(sorted((c[len(IMEX_CHANNEL_PREFIX):] for c in have
                                         if c.startswith(IMEX_CHANNEL_PREFIX)), key=int))
            for n in channels:
                add(IMEX_CHANNEL_PREFIX + n)
        env = [(ENV_VISIBLE, ",".join(d.uuid or d.name for d in devices) or "none")]
        if given:
            env.append((ENV_CAPABILITIES, ",".join(sorted(given))))
        facts = (("capabilities", ",".join(sorted(opts.capabilities))),)
        return FamilyEdits(parts=tuple(parts), env=tuple(env), lib_dirs=tuple(lib_dirs),
                           notes=tuple(notes), facts=facts)

    # ---- device plugin --------------------------------------------------------------

    def resources(self, device: Device, config: DevicePluginConfig) -> tuple[str, ...]:
        strategy = config.mig_strategy
        gpu = config.resource_name(KIND_GPU)
        if device.kind == KIND_GPU:
            if not mig_enabled(device):
                return (gpu,) if gpu else ()
            if strategy == "none":
                raise ValueError("in MIG mode, and mig_strategy \"none\" advertises whole "
                                 "GPUs only, which a workload cannot use in MIG mode: use "
                                 "mig_strategy \"mixed\" or \"single\", or disable MIG")
            return ()  # granted as its MIG devices only
        if device.kind != KIND_MIG or strategy == "none":
            return ()
        if strategy == "single":
            return (gpu,) if gpu else ()
        base = config.resource_name(KIND_MIG)
        if not base:
            return ()
        profile = device.attributes.get("mig_profile", "")
        if not profile:
            raise ValueError("MIG device without a mig_profile attribute")
        # A profile's "+" (the media extension "1g.10gb+me") cannot appear in a
        # resource name: it becomes ".", nvidia.com/mig-1g.10gb.me.
        return (f"{base}-{profile.replace('+', '.')}",)

    def check_resources(self, devices: Sequence[Device], config: DevicePluginConfig) -> None:
        """mig_strategy "single": every GPU in MIG mode (or none), each with MIG devices,
        all of one profile (k8s-device-plugin's assertions, same meaning)."""
        if config.mig_strategy != "single":
            return
        gpus = [d for d in devices if d.kind == KIND_GPU]
        in_mig = [g for g in gpus if mig_enabled(g)]
        if not in_mig:
            return
        if len(in_mig) != len(gpus):
            whole = ", ".join(g.name for g in gpus if not mig_enabled(g))
            raise ValueError("mig_strategy \"single\" needs every GPU in MIG mode or none, "
                             f"and GPU {whole} is not (all devices on the node must be "
                             "configured with the same migEnabled value)")
        migs = [d for d in devices if d.kind == KIND_MIG]
        for g in in_mig:
            if not any(m.parent == g.name for m in migs):
                raise ValueError(f"mig_strategy \"single\": GPU {g.name} is in MIG mode with "
                                 "no MIG devices (an invalid MIG configuration)")
        profiles = sorted({m.attributes.get("mig_profile", "") for m in migs})
        if len(profiles) > 1:
            raise ValueError("mig_strategy \"single\" needs one MIG profile on the node, "
                             f"found {', '.join(p or '(none)' for p in profiles)} (more than "
                             "one MIG device type present on node): use \"mixed\"")

    def health_monitor(self, root: HostRoot, inventory: Any, config: Config,
                       on_change: OnHealthChange,
                       marked: Mapping[str, str] = MappingProxyType({}),
                       ) -> HealthWatch | None:
        """NVML events of the inventory's GPUs and MIG devices (.health), through the
        NVML library discovery loads, `marked` (Device.key -> reason) unhealthy from the
        start; None when [health] is off, there is no GPU or no libnvidia-ml."""
        if not config.health.enabled:
            return None
        from nri_accel.vendors.nvidia.discover import nvml_library
        from nri_accel.vendors.nvidia.health import HealthMonitor, watched_devices

        watched = watched_devices(inventory.devices)
        if not watched:
            return None
        library = nvml_library(root)
        if library is None:
            return None
        keys = {d.uuid: d.key for d in inventory.devices if d.kind in self.kinds and d.uuid}

        def deliver(unhealthy: Mapping[str, str]) -> None:
            on_change({keys[u]: why for u, why in unhealthy.items() if u in keys})

        return HealthMonitor(library, watched, on_change=deliver,
                             ignored_xids=config.health.ignored_xids,
                             recheck_interval=config.health.recheck_interval,
                             marked={u: marked[k] for u, k in keys.items() if k in marked})


    def partition(self, device: Device, inventory: Any) -> str:
        a = device.attributes
        if device.kind == KIND_MIG:
            ids = "/".join(f"{k[:2]}{a[k]}" for k in ("gi_id", "ci_id") if k in a)
            text = " ".join(x for x in (a.get("mig_profile", ""), ids) if x)
            return " ".join(x for x in (text, f"(gpu {device.parent})" if device.parent
                                        else "") if x)
        mode = a.get("mig_mode", "")
        if mode == "enabled":
            n = sum(1 for m in inventory.of_kind(KIND_MIG) if m.parent == device.name)
            return f"enabled, {n} instance{'s' if n != 1 else ''}"
        return mode


PROFILE = NvidiaProfile()


def _options(options: Hashable) -> Options:
    return options if isinstance(options, Options) else DEFAULT_OPTIONS


def _capability_order(cap: str) -> tuple[int, str]:
    """The order capabilities' files are merged in (their 32-bit builds follow, in the
    same order)."""
    return (CAPABILITY_ORDER.index(cap) if cap in CAPABILITY_ORDER else len(CAPABILITY_ORDER),
            cap)


# ---- env grammar ---------------------------------------------------------------------


def _visible_devices(env: Mapping[str, str]) -> EnvSource | None:
    """NVIDIA_VISIBLE_DEVICES (else NV_GPU, else the legacy default) as a device request."""
    if ENV_VISIBLE in env:
        var, value = ENV_VISIBLE, env[ENV_VISIBLE]
        tokens = value.split(",")
    elif env.get(ENV_NV_GPU, "").strip():
        var, value = ENV_NV_GPU, env[ENV_NV_GPU]
        tokens = value.replace(" ", ",").split(",")
    elif legacy_cuda_image(env):
        return EnvSource(f"env {ENV_VISIBLE}", (DeviceClaim(
            KIND_GPU, all=True, source=f"env {ENV_VISIBLE} (unset in a legacy CUDA image)"),),
            "(unset, legacy CUDA_VERSION image)")
    else:
        return None
    name = f"env {var}"
    tokens = [t.strip() for t in tokens if t.strip()]
    if not tokens or "void" in tokens:
        return None
    if "none" in tokens:
        return EnvSource(name, (), value, drivers_only=True)
    if any(t.lower() == "all" for t in tokens):  # "ALL" too: libnvidia-container's
        # select_devices compares it case-insensitively (str_case_equal)
        return EnvSource(name, (DeviceClaim(KIND_GPU, all=True, source=name),), value)
    ids: list[tuple[str, str]] = []
    for token in tokens:
        kind, eq, ident = token.partition("=")
        if not eq:
            ids.append((KIND_GPU, check_id(token, name, LEGACY_MIG_RE)))
        elif kind == KIND_JIT:  # the toolkit's just-in-time CDI devices: this node's
            ids.append((KIND_GPU, _jit_id(ident, token, name)))
        else:  # a CDI qualified name, as the toolkit accepts in CDI mode
            ids.append((check_kind(kind, name), check_id(ident, name, LEGACY_MIG_RE)))
    # The toolkit hands every name to CDI, which injects their union: "<kind>=all" beside
    # ids of the same kind is all of them.
    alls = {kind for kind, ident in ids if ident == "all"}
    acc = ClaimSet(name)
    for kind, ident in ids:
        if kind not in alls or ident == "all":
            acc.add_id(kind, ident)
    return EnvSource(name, acc.claims(), value)


def _jit_id(ident: str, token: str, source: str) -> str:
    """The nvidia.com/gpu id of `runtime.nvidia.com/gpu=<ident>`: the ids the toolkit's
    jit-CDI mode generates a device for (an index as NVML reads it: "01" is GPU 1), and
    nothing else (no PCI bus id, no mode=...: refused, naming the variable)."""
    if ident == "all" or _JIT_UUID_RE.fullmatch(ident):
        return ident
    m = _JIT_INDEX_RE.fullmatch(ident)
    if m is not None:
        gpu, mig = m.groups()
        return str(int(gpu)) if mig is None else f"{int(gpu)}:{int(mig)}"
    shown = cut(token, 80)
    raise RequestError(f"invalid device {shown!r}: {KIND_JIT} takes what the NVIDIA "
                       "Container Toolkit's just-in-time CDI mode accepts: all, a GPU index "
                       "(0), a MIG index (0:1), GPU-<uuid> or MIG-<uuid>", source=source)


@memoized(256, 64 * 1024)
def parse_capabilities(value: str, source: str) -> tuple[frozenset[str], str]:
    """Toolkit semantics (cmd/nvidia-container-runtime-hook getDriverCapabilities, and
    internal/config/image NewDriverCapabilities): an empty value is the default
    utility,compute; any other value is split on commas, blanks trimmed and empty items
    skipped, so a value of blanks or commas alone (" ", ",") is no capability at all;
    "all" -> every capability, whatever else is listed; other unknown names are
    refused."""
    check_text(value, source)
    if value == "":
        return DEFAULT_CAPABILITIES, source
    names = {t.strip() for t in value.split(",")} - {""}
    if not names:
        return frozenset(), source
    if "all" in names:
        return ALL_CAPABILITIES, source
    unknown = sorted(names - ALL_CAPABILITIES)
    if unknown:
        raise RequestError(f"unknown driver capabilities {', '.join(unknown)} (known: all, "
                           f"{', '.join(sorted(ALL_CAPABILITIES))})", source=source)
    return frozenset(names), source


_CHANNEL_RE = re.compile(IMEX_CHANNEL)


@memoized(256, 16 * 1024)
def parse_imex_channels(value: str, source: str) -> tuple[str, ...]:
    """NVIDIA_IMEX_CHANNELS (nvidia-container-toolkit's ImexChannelRequests): channel
    numbers separated by commas, blanks trimmed and empty items skipped, or "all" (every
    channel the node has); empty or "void" asks none. The channels, sorted, or
    ("all",)."""
    tokens = {t.strip() for t in value.split(",")} - {""}
    if not tokens or "void" in tokens:
        return ()
    if "all" in tokens:
        return ("all",)
    if len(tokens) > MAX_IMEX_CHANNELS:
        raise RequestError(f"{len(tokens)} channels, more than the {MAX_IMEX_CHANNELS} "
                           "one container may ask for", source=source)
    for t in tokens:
        if not _CHANNEL_RE.fullmatch(t):
            raise RequestError(f"{cut(t, 32)!r} is not an IMEX channel number; expected "
                               "numbers such as 0,1, or 'all'", source=source)
    return tuple(sorted(tokens, key=int))


def _mig_caps(env: Mapping[str, str], var: str) -> bool:
    """NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES: "" asks nothing, "all" asks
    for the capability, other values are refused, as in nvidia-container-toolkit
    (migCapsDevices.Validate)."""
    value = env.get(var, "")
    if value not in ("", "all"):
        raise RequestError(f"only 'all' is supported, not {value!r}", source=f"env {var}")
    return value == "all"


# ---- selection rules -------------------------------------------------------------------


def _refuse_mig_caps_beside_mig_devices(opts: Options, specific: Sequence[Device]) -> None:
    """NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES act on whole GPUs: refused
    when the container gets specific MIG devices (named, counted, or what a narrowing
    request left of `all`), as nvidia-container-toolkit's migCapsDevices.Validate does."""
    migs = sorted(d.qualified_name for d in specific if d.kind == KIND_MIG)
    if migs:
        var = ENV_MIG_CONFIG if opts.mig_config else ENV_MIG_MONITOR
        shown = ", ".join(migs[:_MAX_LISTED])
        raise RequestError(f"cannot be combined with specific MIG devices ({shown}): the MIG "
                           "configuration and monitoring capabilities act on whole GPUs; "
                           "request whole GPUs or all", source=f"env {var}")


def _check_requirements(index: Any, reqs: Requirements, devices: Sequence[Device]) -> None:
    """NVIDIA_REQUIRE_*: every granted GPU or MIG device must satisfy them; with no GPU
    (NVIDIA_VISIBLE_DEVICES=none) only the driver facts are checked. RequestError names
    the variable that fails."""
    if not devices:
        failed = _unsatisfied(index, reqs, _facts(index, None))
        if failed is not None:
            raise RequestError(f"the driver: {failed[1]}", source=failed[0])
        return
    # A whole grant is looked up at once (a node's few grants recur), by its devices'
    # identities in the index, which lives as long as the memo. Requirements cache
    # their hash, and a memoised parse hands the same object to every create of an image.
    memo = index.memo(VENDOR, _MEMO_SIZE, _MEMO_CHARS)
    key = (reqs, tuple(map(id, devices)))
    failure = memo.get(key, _UNKNOWN)
    if failure is _UNKNOWN:
        failure = next(((d.qualified_name, *failed) for d in devices
                        if (failed := _unsatisfied(index, reqs, _facts(index, d))) is not None),
                       None)
        memo.put(key, failure, 0, reqs, reqs.chars)
    if failure is not None:
        name, source, why = failure
        raise RequestError(f"{name}: {why}", source=source)


_MEMO_SIZE = 4096  # requirement checks remembered per inventory before starting over
_MEMO_CHARS = 256 * 1024  # ... and the characters of the requirements they hold
_UNKNOWN = object()  # not in the memo (None there: the requirements hold)

_Facts = tuple[tuple[str, str], ...]


def _unsatisfied(index: Any, reqs: Requirements, facts: _Facts) -> tuple[str, str] | None:
    """reqs.unsatisfied(facts), remembered per (requirements, facts) in the inventory's
    index (beside _check_requirements' grants, keyed by device identities): images repeat
    the same requirements, and a node's GPUs share a few sets of facts (one, where they
    are all of one model), so a grant of hundreds of GPUs costs one evaluation per set,
    not one per GPU."""
    memo = index.memo(VENDOR, _MEMO_SIZE, _MEMO_CHARS)
    key = (reqs, facts)
    result = memo.get(key, _UNKNOWN)
    if result is _UNKNOWN:
        result = reqs.unsatisfied(dict(facts))
        memo.put(key, result, 0, reqs, reqs.chars)
    return result  # type: ignore[no-any-return]


def _facts(index: Any, device: Device | None) -> _Facts:
    """What NVIDIA_REQUIRE_* compares for `device` (None: the driver alone), as
    (fact, value) pairs: cuda, driver, and a device's arch and brand."""
    driver = index.inventory.driver(VENDOR)
    facts = (("cuda", driver.cuda_version if driver else ""),
             ("driver", driver.version if driver else ""))
    if device is None:
        return facts
    parent = index.inventory.find(KIND_GPU, device.parent) if device.parent else None
    arch, brand = (device.attributes.get(attr)
                   or (parent.attributes.get(attr, "") if parent else "")
                   for attr in ("compute_capability", "brand"))
    return (*facts, ("arch", arch), ("brand", brand))
