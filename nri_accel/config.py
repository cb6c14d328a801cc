"""Configuration: the TOML file (default /etc/nri-accel/config.toml) as a frozen Config.

Owns: the config keys, their defaults and validation. Imports the standard library, msgspec,
nri_accel.errors and nri_accel.inventory (the CDI syntax of static device kinds and
names, which requests must be able to name) and nri_accel.metrics (the address
syntax; not its server module, which loads prometheus_client). Reads one file.

Keys (all optional; unknown keys are errors so typos do not pass silently):

    state_dir = "/run/nri-accel" # grant checkpoint and the state `run` shares with
                                 # `device-plugin` (--state-dir overrides)

    [policy]
    mode = "kubernetes"          # or "standalone"
    trusted_namespaces = []      # may grant through pod annotations/env in kubernetes mode

    [nri]
    socket = "/var/run/nri/nri.sock"  # absolute, at most 107 bytes (a unix socket address)
    name = "nri-accel"
    idx = "40"                   # two digits: ordering among NRI plugins
    event_loop = "auto"          # run's event loop: auto (uvloop where it imports, else
                                 # asyncio's own), uvloop (fail if it cannot) or asyncio

    [devices]
    cdi_passthrough = false      # hand CDI requests to the runtime as CDI device names
    hooks = false                # true allows the one optional OCI hook (ld.so.cache update)
    hook_path = ""               # absolute host path of that hook binary
    shared_kinds = []            # kinds whose grants are shared, never exclusive

    [discovery]
    cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
    driver_root = "/"            # host path of the NVIDIA driver's files
    refresh_interval = 10.0      # seconds between cheap change checks, 0 to 86400;
                                 # 0 disables
    create_device_nodes = false  # create the /dev/nvidia-caps/nvidia-cap<N> nodes MIG
                                 # devices need, and the /dev/char/<major>:<minor> links
                                 # of NVIDIA nodes, where the host lacks them (see below)

    [health]                     # NVIDIA device health from NVML events
                                 # (nri_accel.vendors.nvidia.health)
    enabled = true
    ignored_xids = []            # XIDs that leave a device healthy, besides the
                                 # application XIDs 13, 31, 43, 45, 68, 109
    recheck_interval = 60.0      # seconds an unhealthy device stays quiet before a
                                 # recheck (over 0, at most 86400)

    [device_plugin]              # how `device-plugin` advertises the devices to kubelet
    mig_strategy = "mixed"       # none | single | mixed (NVIDIA's k8s-device-plugin names)
    [device_plugin.resource_names]   # inventory kind -> kubelet resource ("" = none);
    "nvidia.com/gpu" = "nri-accel.io/gpu"  # e.g. beside NVIDIA's device plugin
    [device_plugin.replicas]     # resource -> time-slicing replicas (2 or more)
    "nvidia.com/gpu" = 4

    [log]
    level = "info"               # debug, info, warning, error
    format = "auto"              # auto (JSON unless stderr is a TTY), json, console

    [metrics]
    address = ""                 # HOST:PORT serving /metrics, /healthz, /readyz; "" = off
                                 # (--metrics-address overrides it)

    [[static.devices]]           # hardware with no discoverer
    kind = "acme.example/npu"    # vendor/class
    name = "npu0"
    device_nodes = ["/dev/npu0"] # host paths; major/minor come from lstat of the node
    env = ["ACME_VISIBLE=0"]

discovery.create_device_nodes is off by default because it modifies the host: it
writes into the host's /dev, which belongs to the driver's own tools (nvidia-modprobe
creates nvidia-caps nodes on demand, `nvidia-ctk system create-device-nodes` and
`create-dev-char-symlinks` do it at boot). Off, nothing is lost for most containers:
a MIG device whose nodes are missing is granted anyway (the runtime creates a device
node inside the container from its type, major and minor), with a Problem saying so.
On, discovery and refresh (never a CreateContainer) create, through the HostRoot,
the missing nvidia-caps nodes (mode from the capability's DeviceFileMode) and
/dev/char links, which two setups need: containers in a user namespace (runc
bind-mounts device nodes from the host there) and runc's systemd cgroup driver (it
allows a device through its /dev/char link, so a `systemctl daemon-reload` revokes
one without it). It needs CAP_MKNOD and a writable host /dev.

Numbers are finite: TOML's nan and inf are refused with the key (an interval of nan
would make a sleep that never ends). A file that is not UTF-8, not TOML, or nested
too deeply for the reader to follow is refused naming the file.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from typing import Any

from msgspec import Struct, field

from nri_accel.errors import ConfigError
from nri_accel.inventory import KIND_RE, is_device_name
from nri_accel.metrics import parse_address
from nri_accel.nri import DEFAULT_SOCKET

DEFAULT_CONFIG_PATH = "/etc/nri-accel/config.toml"
DEFAULT_STATE_DIR = "/run/nri-accel"
MAX_INTERVAL = 86400.0  # seconds: the longest refresh or recheck interval (a day)
UNIX_PATH_MAX = 107
"""Bytes of a unix socket path: Linux's sun_path holds 108, the terminating NUL included."""
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
"""The values of nri.event_loop (nri_accel.app.App.run_loop)."""

_K8S_NS_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


NOT_ABSOLUTE = "must be an absolute path without '..'"


def absolute_without_dotdot(path: str) -> bool:
    """Whether `path` names one place whatever the working directory and its links
    upward: absolute, no '..' component (state_dir, hook_path, static device nodes,
    --state-dir; else NOT_ABSOLUTE)."""
    return path.startswith("/") and ".." not in path.split("/")


def unix_socket_path_problem(path: str) -> str | None:
    """Why `path` cannot be the address of a unix socket (None if it can): empty, a NUL
    byte, or longer than UNIX_PATH_MAX bytes (connect() and bind() would fail with
    "AF_UNIX path too long", or the kernel would cut it). Whether it must be absolute
    is the caller's rule."""
    if not path:
        return "is empty: a unix socket path is needed"
    if "\x00" in path:
        return "contains a NUL byte"
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX:
        return (f"is {size} bytes long, over the {UNIX_PATH_MAX}-byte limit of a unix "
                "socket path")
    return None


class PolicyConfig(Struct, frozen=True):
    mode: str = "kubernetes"
    trusted_namespaces: frozenset[str] = frozenset()


class NriConfig(Struct, frozen=True):
    socket: str = DEFAULT_SOCKET
    name: str = "nri-accel"
    idx: str = "40"
    event_loop: str = "auto"  # one of EVENT_LOOPS


class DevicesConfig(Struct, frozen=True):
    cdi_passthrough: bool = False
    hooks: bool = False
    hook_path: str = ""
    shared_kinds: frozenset[str] = frozenset()


MIG_STRATEGIES = ("none", "single", "mixed")
MAX_REPLICAS = 1024


class DevicePluginConfig(Struct, frozen=True):
    """[device_plugin]: how the kubelet device plugin advertises the devices.

    mig_strategy: NVIDIA's (k8s-device-plugin): "none" advertises whole GPUs only,
      "single" the MIG devices under the GPU resource where every GPU is in MIG mode
      with one profile, "mixed" one resource per MIG profile (the NVIDIA profile,
      nri_accel.vendors.nvidia, applies it).
    resource_names: inventory kind -> the kubelet resource it is advertised as ("" = not
      advertised); a kind not listed keeps its family's default name. Sorted pairs.
    replicas: resource name (as advertised) -> time-slicing replicas: each device of
      the resource is advertised that many times, as "<id>::<n>". Sorted pairs.
    """

    mig_strategy: str = "mixed"
    resource_names: tuple[tuple[str, str], ...] = ()
    replicas: tuple[tuple[str, int], ...] = ()

    def resource_name(self, kind: str, default: str | None = None) -> str:
        """The resource `kind` is advertised as: the configured name, else `default`,
        else the kind itself; "" when it is configured not to be advertised."""
        for k, name in self.resource_names:
            if k == kind:
                return name
        return kind if default is None else default

    def replicas_of(self, resource: str) -> int:
        """Time-slicing replicas of `resource`: 1 when it is not shared."""
        for name, n in self.replicas:
            if name == resource:
                return n
        return 1


def extended_resource_name_error(name: str) -> str:
    """Why kubelet would refuse `name` as an extended resource name ("" if it would not):
    a DNS subdomain prefix outside kubernetes.io, "/", then a qualified name of 1-63
    characters (k8s.io/apimachinery validation, IsExtendedResourceName)."""
    prefix, sep, local = name.partition("/")
    if not sep:
        return f"resource name {name!r} has no domain prefix"
    if len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix):
        return f"resource name {name!r}: {prefix!r} is not a DNS subdomain"
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        return f"resource name {name!r} is in the kubernetes.io domain"
    if len(local) > 63 or not _QUALIFIED_NAME.match(local):
        return (f"resource name {name!r}: {local!r} must be 1-63 letters, digits, '-', '_' "
                "or '.', starting and ending with a letter or digit")
    return ""


class DiscoveryConfig(Struct, frozen=True):
    cdi_spec_dirs: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")
    driver_root: str = "/"
    refresh_interval: float = 10.0
    create_device_nodes: bool = False  # create missing nvidia-caps nodes, /dev/char links


class HealthConfig(Struct, frozen=True):
    enabled: bool = True
    ignored_xids: frozenset[int] = frozenset()
    recheck_interval: float = 60.0


class LogConfig(Struct, frozen=True):
    level: str = "info"
    format: str = "auto"


class MetricsConfig(Struct, frozen=True):
    address: str = ""  # validated HOST:PORT (nri_accel.metrics.parse_address); "" = off


class StaticDevice(Struct, frozen=True):
    kind: str
    name: str
    device_nodes: tuple[str, ...] = ()
    env: tuple[str, ...] = ()


class Config(Struct, frozen=True):
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    nri: NriConfig = field(default_factory=NriConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    log: LogConfig = field(default_factory=LogConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    static_devices: tuple[StaticDevice, ...] = ()
    device_plugin: DevicePluginConfig = field(default_factory=DevicePluginConfig)
    state_dir: str = DEFAULT_STATE_DIR
    path: str = ""  # file it was read from; "" for built-in defaults


def load_config(path: str | None) -> Config:
    """Read `path`, or the default path if it exists, or return the defaults.

    An explicitly given path that does not exist is an error; a missing default is not.
    """
    if path is None:
        if not os.path.exists(DEFAULT_CONFIG_PATH):
            return Config()
        path = DEFAULT_CONFIG_PATH
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(e.strerror or str(e), source=path) from e
    except UnicodeDecodeError as e:  # tomllib decodes the whole file first
        raise ConfigError(f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start}): a TOML file is UTF-8", source=path) from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"not valid TOML: {e}", source=path) from e
    except RecursionError as e:  # tomllib parses nested arrays and tables recursively
        raise ConfigError("not readable TOML: arrays or tables nested too deeply",
                          source=path) from e
    return parse_config(data, path=path)


def parse_config(data: dict[str, Any], *, path: str = "") -> Config:
    r = _Reader(data, path)
    tables = {"policy", "nri", "devices", "discovery", "health", "log", "metrics", "static",
              "device_plugin", "state_dir"}
    r.no_unknown(data, tables, "")
    state_dir = r.get(data, "state_dir", str, DEFAULT_STATE_DIR)
    if not absolute_without_dotdot(state_dir):
        raise ConfigError(NOT_ABSOLUTE, source=r.src("state_dir"))

    pol = r.table("policy", {"mode", "trusted_namespaces"})
    mode = r.get(pol, "policy.mode", str, "kubernetes")
    if mode not in ("kubernetes", "standalone"):
        raise ConfigError(f"must be \"kubernetes\" or \"standalone\", not {mode!r}",
                          source=r.src("policy.mode"))
    namespaces = r.str_list(pol, "policy.trusted_namespaces", [])
    for ns in namespaces:
        if not _K8S_NS_RE.match(ns):
            raise ConfigError(f"{ns!r} is not a Kubernetes namespace name",
                              source=r.src("policy.trusted_namespaces"))

    nri = r.table("nri", {"socket", "name", "idx", "event_loop"})
    socket = r.get(nri, "nri.socket", str, DEFAULT_SOCKET)
    why = unix_socket_path_problem(socket)
    if why is None and not socket.startswith("/"):
        why = f"{socket!r} must be an absolute path"
    if why is not None:
        raise ConfigError(why, source=r.src("nri.socket"))
    name = r.get(nri, "nri.name", str, "nri-accel")
    idx = r.get(nri, "nri.idx", str, "40")
    if not re.fullmatch(r"[0-9]{2}", idx):
        raise ConfigError(f"must be two digits such as \"40\", not {idx!r}",
                          source=r.src("nri.idx"))
    if not re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*", name):
        raise ConfigError(f"invalid plugin name {name!r}", source=r.src("nri.name"))
    event_loop = r.get(nri, "nri.event_loop", str, "auto")
    if event_loop not in EVENT_LOOPS:
        raise ConfigError(f"must be one of {', '.join(map(repr, EVENT_LOOPS))}, not "
                          f"{event_loop!r}", source=r.src("nri.event_loop"))

    dev = r.table("devices", {"cdi_passthrough", "hooks", "hook_path", "shared_kinds"})
    shared_kinds = r.str_list(dev, "devices.shared_kinds", [])
    for kind in shared_kinds:
        if not KIND_RE.fullmatch(kind):
            raise ConfigError(f"{kind!r} is not a device kind (vendor/class)",
                              source=r.src("devices.shared_kinds"))
    hook_path = r.get(dev, "devices.hook_path", str, "")
    if hook_path and not absolute_without_dotdot(hook_path):
        raise ConfigError(NOT_ABSOLUTE, source=r.src("devices.hook_path"))

    disc = r.table("discovery", {"cdi_spec_dirs", "driver_root", "refresh_interval",
                                 "create_device_nodes"})
    spec_dirs = r.str_list(disc, "discovery.cdi_spec_dirs", ["/etc/cdi", "/var/run/cdi"])
    for d in spec_dirs:
        if not d.startswith("/"):
            raise ConfigError(f"{d!r} must be absolute", source=r.src("discovery.cdi_spec_dirs"))
    driver_root = r.get(disc, "discovery.driver_root", str, "/")
    if not driver_root.startswith("/"):
        raise ConfigError("must be absolute", source=r.src("discovery.driver_root"))
    interval = r.seconds(disc, "discovery.refresh_interval", 10.0, zero=True)

    health = r.table("health", {"enabled", "ignored_xids", "recheck_interval"})
    xids = health.get("ignored_xids", [])
    if not isinstance(xids, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in xids):
        raise ConfigError("expected an array of XID numbers (positive integers)",
                          source=r.src("health.ignored_xids"))
    recheck = r.seconds(health, "health.recheck_interval", 60.0, zero=False)

    device_plugin = _device_plugin(r)

    log = r.table("log", {"level", "format"})
    level = r.get(log, "log.level", str, "info").lower()
    if level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"unknown level {level!r}", source=r.src("log.level"))
    fmt = r.get(log, "log.format", str, "auto")
    if fmt not in ("auto", "json", "console"):
        raise ConfigError(f"unknown format {fmt!r}", source=r.src("log.format"))

    metrics_address = r.get(r.table("metrics", {"address"}), "metrics.address", str, "")
    if metrics_address:
        parse_address(metrics_address, source=r.src("metrics.address"))

    static = r.table("static", {"devices"})
    raw_devs = static.get("devices", [])
    if not isinstance(raw_devs, list):
        raise ConfigError("must be an array of tables", source=r.src("static.devices"))
    statics = []
    for i, d in enumerate(raw_devs):
        where = f"static.devices[{i}]"
        if not isinstance(d, dict):
            raise ConfigError("must be a table", source=r.src(where))
        r.no_unknown(d, {"kind", "name", "device_nodes", "env"}, where)
        kind = r.get(d, f"{where}.kind", str, None)
        dname = r.get(d, f"{where}.name", str, None)
        if not kind or not KIND_RE.fullmatch(kind):
            raise ConfigError("must be vendor/class, e.g. \"acme.example/npu\"",
                              source=r.src(f"{where}.kind"))
        if not dname or not is_device_name(dname):
            raise ConfigError("must be a device name such as \"npu0\" (letters, digits, "
                              "'_', '-', '.', ':'; a letter or digit first and last; no '::', "
                              "which kubelet's time-slicing replica ids use)",
                              source=r.src(f"{where}.name"))
        nodes = r.str_list(d, f"{where}.device_nodes", [])
        for n in nodes:
            # Syntax only; where a node may be (under /dev) is nri_accel.edits' rule,
            # applied when the device is discovered (a Problem) and again when granted.
            if not absolute_without_dotdot(n):
                raise ConfigError(f"{n!r} {NOT_ABSOLUTE}", source=r.src(f"{where}.device_nodes"))
        env = r.str_list(d, f"{where}.env", [])
        for kv in env:
            if "=" not in kv or not kv.partition("=")[0]:
                raise ConfigError(f"{kv!r} must be KEY=VALUE", source=r.src(f"{where}.env"))
        statics.append(StaticDevice(kind, dname, tuple(nodes), tuple(env)))

    return Config(
        policy=PolicyConfig(mode, frozenset(namespaces)),
        nri=NriConfig(socket, name, idx, event_loop),
        devices=DevicesConfig(
            cdi_passthrough=r.get(dev, "devices.cdi_passthrough", bool, False),
            hooks=r.get(dev, "devices.hooks", bool, False),
            hook_path=hook_path,
            shared_kinds=frozenset(shared_kinds),
        ),
        discovery=DiscoveryConfig(tuple(spec_dirs), driver_root, interval,
                                  r.get(disc, "discovery.create_device_nodes", bool, False)),
        health=HealthConfig(r.get(health, "health.enabled", bool, True), frozenset(xids),
                            recheck),
        log=LogConfig(level, fmt),
        metrics=MetricsConfig(metrics_address),
        static_devices=tuple(statics),
        device_plugin=device_plugin,
        state_dir=state_dir,
        path=path,
    )


def _device_plugin(r: _Reader) -> DevicePluginConfig:
    dp = r.table("device_plugin", {"mig_strategy", "resource_names", "replicas"})
    strategy = r.get(dp, "device_plugin.mig_strategy", str, "mixed")
    if strategy not in MIG_STRATEGIES:
        raise ConfigError(f"must be one of {', '.join(MIG_STRATEGIES)}, not {strategy!r}",
                          source=r.src("device_plugin.mig_strategy"))
    names = r.subtable(dp, "device_plugin.resource_names")
    seen: dict[str, str] = {}
    for kind, name in names.items():
        where = r.src(f"device_plugin.resource_names.{kind}")
        if not KIND_RE.fullmatch(kind):
            raise ConfigError("the key must be a device kind (vendor/class) such as "
                              "\"nvidia.com/gpu\"", source=where)
        if not isinstance(name, str):
            raise ConfigError(f"expected a string, got {type(name).__name__}", source=where)
        if name:
            why = extended_resource_name_error(name)
            if why:
                raise ConfigError(why, source=where)
            if name in seen:
                raise ConfigError(f"{name!r} is already the resource of {seen[name]!r}: "
                                  "one resource per kind", source=where)
            seen[name] = kind
    replicas = r.subtable(dp, "device_plugin.replicas")
    for name, n in replicas.items():
        where = r.src(f"device_plugin.replicas.{name}")
        why = extended_resource_name_error(name)
        if why:
            raise ConfigError(why, source=where)
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_REPLICAS:
            raise ConfigError(f"expected a number of replicas from 2 to {MAX_REPLICAS} "
                              "(leave a resource out not to share it)", source=where)
    return DevicePluginConfig(strategy, tuple(sorted(names.items())),
                              tuple(sorted(replicas.items())))


class _Reader:
    def __init__(self, data: dict[str, Any], path: str) -> None:
        self.data = data
        self.path = path

    def src(self, key: str) -> str:
        return f"{self.path}: {key}" if self.path else key

    def no_unknown(self, table: dict[str, Any], allowed: set[str], where: str) -> None:
        for k in table:
            if k not in allowed:
                full = f"{where}.{k}" if where else k
                raise ConfigError(f"unknown key (known: {', '.join(sorted(allowed))})",
                                  source=self.src(full))

    def table(self, name: str, allowed: set[str]) -> dict[str, Any]:
        t = self.data.get(name, {})
        if not isinstance(t, dict):
            raise ConfigError("must be a table", source=self.src(name))
        self.no_unknown(t, allowed, name)
        return t

    def subtable(self, table: dict[str, Any], key: str) -> dict[str, Any]:
        """The table `key` (dotted, for messages) inside `table`; {} when absent."""
        t = table.get(key.rsplit(".", 1)[-1], {})
        if not isinstance(t, dict):
            raise ConfigError("must be a table", source=self.src(key))
        return t

    def get(self, table: dict[str, Any], key: str, typ: Any, default: Any) -> Any:
        v = table.get(key.rsplit(".", 1)[-1], default)
        if v is default:
            return v
        if isinstance(v, bool) and typ is not bool:
            raise ConfigError(f"expected {_tname(typ)}, got a boolean", source=self.src(key))
        if not isinstance(v, typ):
            raise ConfigError(f"expected {_tname(typ)}, got {type(v).__name__}",
                              source=self.src(key))
        return v

    def seconds(self, table: dict[str, Any], key: str, default: float, *,
                zero: bool) -> float:
        """A finite number of seconds up to MAX_INTERVAL, from 0 when `zero` (which
        means off), else over 0. TOML's nan and inf are numbers, and refused."""
        v = self.get(table, key, (int, float), default)
        # (an int is finite; math.isfinite would overflow on a huge one)
        if not ((isinstance(v, int) or math.isfinite(v)) and 0 <= v <= MAX_INTERVAL
                and (v or zero)):
            shown = repr(v) if len(repr(v)) <= 24 else repr(v)[:20] + "..."
            low = "from 0 (off)" if zero else "over 0 and"
            raise ConfigError(f"expected a number of seconds {low} up to {MAX_INTERVAL:g}, "
                              f"not {shown}", source=self.src(key))
        return float(v)

    def str_list(self, table: dict[str, Any], key: str, default: list[str]) -> list[str]:
        v = table.get(key.rsplit(".", 1)[-1], default)
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ConfigError("expected an array of strings", source=self.src(key))
        return v


def _tname(typ: Any) -> str:
    if isinstance(typ, tuple):
        return "a number"
    return {str: "a string", bool: "a boolean", int: "an integer"}.get(typ, typ.__name__)
