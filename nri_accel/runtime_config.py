"""What the container runtime's own configuration files say about NRI.

Owns: reading containerd's and CRI-O's configuration through a HostRoot (so that
`check --root /host` reads the node's files from a DaemonSet), the NRI settings they
give (NriView), and the findings `check` prints about them. Imports the standard library and
msgspec only (the HostRoot comes from the caller). Never raises for a file's content: a file
that is not valid TOML, or a key of the wrong type, is a finding that names the file.

A finding is a (level, text) pair, level "ok", "info", "warn" or "error". These are
statements about files, which the running runtime may not have loaded yet (edited since
it started, or started with another --config): `check` tells what the runtime does from
its NRI socket, and these only warn.

Upstream facts this relies on:

containerd, section [plugins."io.containerd.nri.v1.nri"] (config version 2: containerd
1.7, pkg/nri/config.go; version 3: 2.x, internal/nri/config.go; in 1.7, version 1, or
no version key, names it by the plugin's short ID, [plugins.nri]; 2.x reads the URI name
in a file of any version, and never [plugins.nri]):
  disable                      1.7: true (NRI off), 2.x: false
  disable_connections          false; true: no socket at all, only plugins the runtime
                               launches from plugin_path (nri pkg/adaptation startListener)
  socket_path                  "/var/run/nri/nri.sock" ("" = the default)
  plugin_path                  "/opt/nri/plugins": executables named NN-name, launched at
                               start (adaptation discoverPlugins; a non-executable entry
                               is skipped, an executable one not named NN-name fails them)
  plugin_config_path           "/etc/nri/conf.d"
  plugin_registration_timeout  "5s" (Go duration; 0 = the default, a negative one is
                               used as it is: every registration times out at once;
                               pkg/nri/config.go ConfigureTimeouts)
  plugin_request_timeout       "2s": a plugin that does not answer in time is dropped
                               and the event goes on without it (adaptation isFatalError)
  [...default_validator]       2.2+ (nri plugins/default-validator): enable (false),
                               required_plugins ([], by name or NN-name: a container is
                               refused while one of them is not registered),
                               tolerate_missing_plugins_annotation ("")
  The main file is /etc/containerd/config.toml (k3s and RKE2 write theirs under
  /var/lib/rancher/{k3s,rke2}/agent/etc/containerd/). Its `imports` (paths, or globs
  with "*"; relative to the importing file) are read after it, breadth first (2.x does
  not start when one states a higher `version` than the first file that states one); a plugin
  section in an import replaces the whole section in 1.7 and is merged key by key in
  2.x (server config mergeConfig).
CRI-O, section [crio.nri] (internal/config/nri/nri.go, docs/crio.conf.5.md):
  enable_nri                   false before 1.30, true from 1.30 (cri-o#7790)
  nri_listen                   "/var/run/nri/nri.sock"
  nri_plugin_dir, nri_plugin_config_dir   "/opt/nri/plugins", "/etc/nri/conf.d"
  nri_disable_connections      false
  nri_plugin_registration_timeout, nri_plugin_request_timeout   "5s", "2s"
  [crio.nri.default_validator] nri_enable_default_validator,
                               nri_validator_required_plugins,
                               nri_validator_tolerate_missing_plugins_annotation
  /etc/crio/crio.conf first, then every file under /etc/crio/crio.conf.d in lexical
  order, each overriding the keys it sets (crio.conf.d(5); pkg/config UpdateFromPath
  walks the directory).
"""

from __future__ import annotations

import glob
import os
import posixpath
import re
import stat
import tomllib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from msgspec import Struct

if TYPE_CHECKING:
    from nri_accel.discover.hostroot import HostRoot

Finding = tuple[str, str]

CONTAINERD_CONFIGS = (
    "/etc/containerd/config.toml",
    "/var/lib/rancher/k3s/agent/etc/containerd/config.toml",
    "/var/lib/rancher/rke2/agent/etc/containerd/config.toml",
)
CONTAINERD_NRI_URI = "io.containerd.nri.v1.nri"
CRIO_CONFIG = "/etc/crio/crio.conf"
CRIO_CONFIG_DIR = "/etc/crio/crio.conf.d"

DEFAULT_SOCKET = "/var/run/nri/nri.sock"
DEFAULT_PLUGIN_PATH = "/opt/nri/plugins"
DEFAULT_REGISTRATION_TIMEOUT = 5.0
DEFAULT_REQUEST_TIMEOUT = 2.0
MIN_REQUEST_TIMEOUT = 1.0
"""Below this, a pause on a busy node (or a garbage collection) can make nri-accel miss
the runtime's deadline: the runtime then drops it and creates containers without their
devices until it reconnects. nri-accel itself answers in well under a millisecond."""

CONTAINERD_VALIDATOR = (2, 2)  # containerd with NRI's default validator
CRIO_NRI_ON = (1, 30)  # CRI-O that turns NRI on by default
CRIO_VALIDATOR = (1, 34)  # CRI-O with NRI's default validator


class Keys(Struct, frozen=True):
    """A runtime's names for the NRI settings."""

    runtime: str
    section: str
    enable: str  # the key that turns NRI on or off
    enable_inverted: bool  # containerd's `disable`
    connections: str  # the key that refuses external plugins
    socket: str
    plugin_path: str
    registration_timeout: str
    request_timeout: str
    validator_table: str
    validator_enable: str
    required_plugins: str
    tolerate: str


CONTAINERD_KEYS = Keys(
    runtime="containerd", section=f'[plugins."{CONTAINERD_NRI_URI}"]', enable="disable",
    enable_inverted=True, connections="disable_connections", socket="socket_path",
    plugin_path="plugin_path", registration_timeout="plugin_registration_timeout",
    request_timeout="plugin_request_timeout",
    validator_table=f'[plugins."{CONTAINERD_NRI_URI}".default_validator]',
    validator_enable="default_validator.enable",
    required_plugins="default_validator.required_plugins",
    tolerate="default_validator.tolerate_missing_plugins_annotation")

CRIO_KEYS = Keys(
    runtime="CRI-O", section="[crio.nri]", enable="enable_nri", enable_inverted=False,
    connections="nri_disable_connections", socket="nri_listen", plugin_path="nri_plugin_dir",
    registration_timeout="nri_plugin_registration_timeout",
    request_timeout="nri_plugin_request_timeout",
    validator_table="[crio.nri.default_validator]",
    validator_enable="default_validator.nri_enable_default_validator",
    required_plugins="default_validator.nri_validator_required_plugins",
    tolerate="default_validator.nri_validator_tolerate_missing_plugins_annotation")


class RuntimeFiles(Struct, frozen=True):
    """The NRI section of one runtime's configuration, as its files set it.

    `values` maps a key ("disable", "default_validator.enable") to (value, the host path
    of the file that set it): only keys some file sets. `config_version`: containerd's
    main file's `version` (0 for CRI-O).
    """

    keys: Keys
    files: tuple[str, ...]
    values: Mapping[str, tuple[Any, str]]
    problems: tuple[str, ...] = ()
    config_version: int = 0
    uri_in_v1: tuple[str, ...] = ()  # files naming the section by URI under version 1

    @property
    def runtime(self) -> str:
        return self.keys.runtime


class NriView(Struct, frozen=True):
    """The NRI settings a runtime of a given version gets from its files (defaults
    filled in). None where it depends on a version that is not known."""

    files: RuntimeFiles
    version: tuple[int, ...] | None
    enabled: bool | None
    enabled_why: str
    connections: bool
    socket_path: str
    plugin_path: str
    registration_timeout: float
    request_timeout: float
    validator: bool | None  # None: this runtime version has none, or it is unknown
    required_plugins: tuple[str, ...] = ()
    tolerate: str = ""
    problems: tuple[str, ...] = ()


# ---- reading ---------------------------------------------------------------------------

def read_containerd(root: HostRoot, *, merge: bool | None = None) -> RuntimeFiles | None:
    """containerd's NRI section from its main file and every file it imports; None when
    no main file exists. `merge`: True reads the files as containerd 2.x does (an
    imported section merged key by key, the section named by URI only), False as 1.7
    does (an imported section replaces the whole section; [plugins.nri] under config
    version 1); None decides by the main file's version (3: 2.x, else 1.7)."""
    main = next((p for p in CONTAINERD_CONFIGS if root.exists(p)), None)
    if main is None:
        return None
    problems: list[str] = []
    files: list[str] = []
    sections: list[tuple[str, dict[str, Any]]] = []
    pending: list[tuple[str, str]] = [(main, "")]
    loaded: set[str] = set()
    main_version = 1
    uri_in_v1: list[str] = []
    # containerd 2.x refuses to start when a file states a higher version than the first
    # one that states any (cmd/containerd/server/config/config.go LoadConfigWithPlugins:
    # "drop-in config version %d higher than root config version %d"); 1.7 does not.
    root_version, may_be_2x = 0, merge is not False
    while pending:
        path, parent = pending.pop(0)
        if path in loaded:  # containerd skips a file it already read (import cycles)
            continue
        loaded.add(path)
        data, problem = _load_toml(root, path)
        if problem:
            problems.append(problem)
            continue
        if data is None:
            problems.append(f"{parent} imports {path}, which does not exist: containerd "
                            "does not start without it")
            continue
        files.append(path)
        version = data.get("version", 1)
        if not isinstance(version, int) or isinstance(version, bool):
            problems.append(f"{path}: version = {version!r} is not a number")
            version = 1
        stated = version if "version" in data else 0
        if may_be_2x and root_version and stated > root_version:
            problems.append(f"{path}: version = {stated} is higher than the root config's "
                            f"version {root_version}: containerd 2.x does not start (\"drop-in "
                            f"config version {stated} higher than root config version "
                            f"{root_version}\"): migrate the root config (`containerd config "
                            f"migrate`) or write this file for version {root_version}")
        root_version = root_version or stated
        if path == main:
            main_version = version
            if merge is None:
                merge = main_version >= 3
        section, by_uri, problem = _containerd_section(data, path, main_version,
                                                       merge is True)
        if problem:
            problems.append(problem)
        if section is not None:
            sections.append((path, section))
            if by_uri and main_version < 2 and not merge:
                uri_in_v1.append(path)
        imports, import_problems = _imports(root, path, data.get("imports", []))
        problems += import_problems
        pending += [(p, path) for p in imports]
    values: dict[str, tuple[Any, str]] = {}
    for path, section in sections:
        flat = {k: (v, path) for k, v in _flatten(section)}
        if merge:
            values.update(flat)
        else:
            values = flat
    return RuntimeFiles(CONTAINERD_KEYS, tuple(files), values, tuple(problems), main_version,
                        tuple(uri_in_v1))


def read_crio(root: HostRoot) -> RuntimeFiles | None:
    """CRI-O's [crio.nri] from crio.conf and the crio.conf.d drop-ins (later files win,
    key by key); None when neither exists."""
    paths = [CRIO_CONFIG] if root.exists(CRIO_CONFIG) else []
    paths += _files_under(root, CRIO_CONFIG_DIR)
    if not paths:
        return None
    problems: list[str] = []
    files: list[str] = []
    values: dict[str, tuple[Any, str]] = {}
    for path in paths:
        data, problem = _load_toml(root, path)
        if problem:
            problems.append(problem)
            continue
        if data is None:
            continue
        files.append(path)
        crio = data.get("crio", {})
        nri = crio.get("nri") if isinstance(crio, dict) else None
        if nri is None:
            continue
        if not isinstance(nri, dict):
            problems.append(f"{path}: crio.nri is not a table")
            continue
        values.update({k: (v, path) for k, v in _flatten(nri)})
    return RuntimeFiles(CRIO_KEYS, tuple(files), values, tuple(problems))


_MAX_CONFIG_BYTES = 1 << 20  # a runtime's TOML config: tens of KiB at most


def _load_toml(root: HostRoot, path: str) -> tuple[dict[str, Any] | None, str]:
    """(the parsed file, "") ; (None, "") when it does not exist; (None, problem)."""
    try:
        text = root.read_text(path, limit=_MAX_CONFIG_BYTES)
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        return None, f"{path}: cannot be read ({e.strerror or e})"
    try:
        return tomllib.loads(text), ""
    except tomllib.TOMLDecodeError as e:
        return None, (f"{path}: not valid TOML ({e}): the runtime does not start with it; "
                      "its NRI settings are not checked")


def _containerd_section(data: Mapping[str, Any], path: str, main_version: int,
                        v2x: bool) -> tuple[dict[str, Any] | None, bool, str]:
    """(the NRI section of one file, whether it is named by URI, a problem). `v2x`: read
    as containerd 2.x does, which migrates every file below version 3 on its own and
    renames a version 1 file's [plugins.nri] io.containerd.grpc.v1.nri: never the NRI
    plugin's (containerd cmd/containerd/server/config/config.go, v1MigratePluginName)."""
    plugins = data.get("plugins", {})
    if not isinstance(plugins, dict):
        return None, False, f"{path}: `plugins` is not a table"
    uri, short = plugins.get(CONTAINERD_NRI_URI), plugins.get("nri")
    if short is not None and (v2x or main_version >= 2):
        if uri is None:
            why = (f"with config version {main_version}" if main_version >= 2 else
                   "by containerd 2.x (it migrates a version 1 file's [plugins.nri] to "
                   "io.containerd.grpc.v1.nri)")
            return None, False, (f"{path}: [plugins.nri] is ignored {why}: use "
                                 f"{CONTAINERD_KEYS.section}")
        short = None
    section = short if short is not None else uri
    if section is not None and not isinstance(section, dict):
        return None, False, f"{path}: the NRI plugin section is not a table"
    return section, section is uri and uri is not None, ""


def _imports(root: HostRoot, parent: str, imports: Any) -> tuple[list[str], list[str]]:
    if not isinstance(imports, list) or not all(isinstance(p, str) for p in imports):
        return [], [f"{parent}: imports = {imports!r} is not a list of paths"]
    out: list[str] = []
    for path in imports:
        if not path.startswith("/"):
            path = posixpath.join(posixpath.dirname(parent), path)
        path = posixpath.normpath(path)
        if "*" in path:  # containerd expands a path with "*" as a glob, in lexical order
            out += _glob(root, path)
        else:
            out.append(path)
    return out, []


def _glob(root: HostRoot, pattern: str) -> list[str]:
    try:
        local = root.local(pattern)
    except (ValueError, OSError):
        return []
    base = root.root if root.root not in ("", "/") else ""
    found = []
    for match in glob.glob(local):
        found.append("/" + os.path.relpath(match, base).lstrip("/") if base else match)
    return sorted(found)


def _files_under(root: HostRoot, directory: str) -> list[str]:
    """Regular files under `directory` (host paths) in the order filepath.Walk visits
    them: lexical, a subdirectory's files where its name sorts. As Walk, it lstats each
    entry and never descends a link to a directory (two links to "." had it walk for
    ever); a link to a regular file is read, as the runtime's ReadFile follows it."""
    out: list[str] = []
    for name in root.listdir(directory):
        path = posixpath.join(directory, name)
        try:
            local = root.local(path)
            mode = os.lstat(local).st_mode
            if stat.S_ISLNK(mode):  # followed inside the root, as the host sees it
                mode = os.stat(root.local(root.resolve(path))).st_mode
                if stat.S_ISDIR(mode):
                    continue
        except (OSError, ValueError):
            continue
        if stat.S_ISDIR(mode):
            out += _files_under(root, path)
        elif stat.S_ISREG(mode):
            out.append(path)
    return out


def _flatten(table: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# ---- what the files mean -----------------------------------------------------------------

def parse_version(text: str) -> tuple[int, ...] | None:
    """(2, 1, 4) of "v2.1.4", "1.7.24-0ubuntu1", "2.2.0-rc.1"; None if there is none."""
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


_DURATION_RE = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                   "m": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> float:
    """Seconds of a Go duration ("2s", "1m30s", "500ms", "0"); an integer is
    nanoseconds, as the runtimes' TOML decoders take it. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int):
        return value / 1e9
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a duration")
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("+-")
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(text):
        m = _DURATION_RE.match(text, pos)
        if not m or m.group(1) in ("", "."):
            raise ValueError(f"{value!r} is not a duration such as \"2s\" or \"500ms\"")
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if not text:
        raise ValueError(f"{value!r} is not a duration such as \"2s\" or \"500ms\"")
    return sign * total


_KINDS = {bool: "boolean", str: "string", tuple: "list of strings"}


def view(files: RuntimeFiles, version: tuple[int, ...] | None = None) -> NriView:
    """The settings a runtime of `version` (None: unknown) takes from `files`."""
    k = files.keys
    problems: list[str] = []
    major = version[0] if version else None
    if major is None and k is CONTAINERD_KEYS and files.config_version >= 3:
        major = 2  # config version 3 is containerd 2.x's (its minor stays unknown)

    def get(key: str, kind: type, default: Any) -> Any:
        if key not in files.values:
            return default
        value, path = files.values[key]
        if kind is tuple:
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return tuple(value)
        elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
        problems.append(f"{path}: {k.section} {key} = {value!r}: not a {_KINDS[kind]}")
        return default

    def duration(key: str, default: float) -> float:
        if key not in files.values:
            return default
        value, path = files.values[key]
        try:
            seconds = parse_duration(value)
        except ValueError as e:
            problems.append(f"{path}: {k.section} {key}: {e}")
            return default
        # 0: the runtime keeps its default; any other value, a negative one too, it uses
        # (containerd pkg/nri/config.go and CRI-O internal/config/nri/nri.go
        # ConfigureTimeouts: `if timeout != 0`).
        return seconds if seconds != 0 else default

    if major != 2:
        problems += [f"{path}: {k.section} is read with config version 2 or 3; with "
                     f"{files.files[0]} at version 1 (no `version` line) containerd 1.7 "
                     "reads [plugins.nri] instead: add version = 2 to it"
                     for path in files.uri_in_v1]
    where = files.values.get(k.enable, (None, ""))[1]
    if k is CONTAINERD_KEYS:
        default_on = None if major is None else major >= 2
        unknown = (f"no `{k.enable}` key in {k.section}: NRI is off in containerd 1.7 "
                   "(disable = true by default), on in 2.x")
        by_default = ("NRI is on by default in containerd 2.x" if default_on else
                      "containerd 1.7 leaves NRI off without `disable = false`")
    else:
        default_on = None if version is None else version >= CRIO_NRI_ON
        unknown = (f"no `{k.enable}` key in {k.section}: NRI is off before CRI-O 1.30, "
                   "on from 1.30")
        by_default = ("NRI is on by default from CRI-O 1.30" if default_on else
                      "CRI-O before 1.30 leaves NRI off without `enable_nri = true`")
    raw = get(k.enable, bool, None)
    if raw is not None:
        enabled: bool | None = (not raw) if k.enable_inverted else raw
        why = f"{k.enable} = {str(raw).lower()} in {where}"
    else:
        enabled = default_on
        why = unknown if default_on is None else by_default
    has_validator = None
    if any(key.startswith("default_validator.") for key in files.values):
        has_validator = True
    elif version is not None:
        has_validator = version >= (CONTAINERD_VALIDATOR if k is CONTAINERD_KEYS
                                    else CRIO_VALIDATOR) or None
    validator = None
    if has_validator:
        validator = bool(get(k.validator_enable, bool, False))
    return NriView(
        files=files, version=version, enabled=enabled, enabled_why=why,
        connections=not get(k.connections, bool, False),
        socket_path=get(k.socket, str, "") or DEFAULT_SOCKET,
        plugin_path=get(k.plugin_path, str, "") or DEFAULT_PLUGIN_PATH,
        registration_timeout=duration(k.registration_timeout, DEFAULT_REGISTRATION_TIMEOUT),
        request_timeout=duration(k.request_timeout, DEFAULT_REQUEST_TIMEOUT),
        validator=validator,
        required_plugins=get(k.required_plugins, tuple, ()) if has_validator else (),
        tolerate=get(k.tolerate, str, "") if has_validator else "",
        problems=files.problems + tuple(problems))


# ---- findings ------------------------------------------------------------------------------

class Live(Struct, frozen=True):
    """What the runtime on the socket told the probe (nri_accel.check), if it answered."""

    name: str
    version: str
    registration_timeout: float
    request_timeout: float


def findings(v: NriView, root: HostRoot, *, socket: str, plugin_name: str,
             plugin_idx: str, live: Live | None = None) -> list[Finding]:
    """What `check` says about one runtime's NRI settings. `socket`: the path nri-accel
    connects to; `live`: what the same runtime said on that socket (None: it did not
    answer, or it is another runtime)."""
    k = v.files.keys
    rt = k.runtime
    head = f"{rt} configuration {', '.join(v.files.files) or '(none readable)'}"
    out: list[Finding] = [("warn", p) for p in v.problems]
    if not v.files.files:
        return out  # nothing could be read: no guess about what it would have said
    same_socket = _same_path(root, v.socket_path, socket)
    enabled = v.enabled if v.enabled is not None or live is None else True
    if enabled and v.connections and same_socket:
        out.append(("ok", f"{head}: NRI on, external plugins allowed, socket "
                          f"{v.socket_path}"))
    if enabled is False:
        fix = "disable = false" if k.enable_inverted else "enable_nri = true"
        out.append(("warn", f"{head}: NRI is off ({v.enabled_why}): set {fix} in "
                            f"{k.section} (deploy/{_deploy(k)}) and restart {rt}"
                            + (f"; the running {rt} has it on until then" if live else "")))
    elif enabled is None:
        out.append(("warn", f"{head}: {v.enabled_why}; set it explicitly "
                            f"(deploy/{_deploy(k)})"))
    if not v.connections:
        out.append(("warn", f"{head}: {k.connections} = true: {rt} refuses external "
                            "plugins and creates no NRI socket, so `nri-accel run` "
                            f"cannot connect; only a plugin {rt} launches from "
                            f"{v.plugin_path} can register"))
    if not same_socket:
        src = v.files.values.get(k.socket, (None, "its default"))[1]
        out.append(("warn", f"{head}: {rt} listens on {v.socket_path} ({k.socket}, "
                            f"{src}) but nri-accel connects to {socket}: set nri.socket "
                            f"(or --socket) to {v.socket_path}"))
    out += _timeouts(v, live)
    out += _preregistered(v, root, plugin_name)
    out += _validator(v, plugin_name, plugin_idx)
    return out


def _deploy(k: Keys) -> str:
    return "containerd/nri-accel.toml" if k is CONTAINERD_KEYS else "crio/10-nri-accel.conf"


def _same_path(root: HostRoot, a: str, b: str) -> bool:
    """Whether two host paths name the same file (/var/run is a link to /run on most
    hosts)."""
    if a == b:
        return True
    try:
        return root.resolve(a) == root.resolve(b)
    except (OSError, ValueError):
        return False


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:g}ms" if abs(seconds) < 1 else f"{seconds:g}s"


def _timeouts(v: NriView, live: Live | None) -> list[Finding]:
    k = v.files.keys
    out: list[Finding] = []
    for key, seconds in ((k.registration_timeout, v.registration_timeout),
                         (k.request_timeout, v.request_timeout)):
        if seconds < 0:  # the runtime's context deadline (or timer) has passed at once
            src = v.files.values.get(key, (None, ""))[1]
            out.append(("warn", f"{src}: {key} = {_fmt(seconds)}: negative, {k.runtime} "
                                "times it out at once and drops every plugin, nri-accel "
                                "too: containers get no devices"))
    if 0 <= v.request_timeout < MIN_REQUEST_TIMEOUT:
        src = v.files.values.get(k.request_timeout, (None, ""))[1]
        out.append(("warn", f"{src}: {k.request_timeout} = {_fmt(v.request_timeout)}: below "
                            f"{_fmt(MIN_REQUEST_TIMEOUT)}, a pause on a busy node makes "
                            f"{k.runtime} drop nri-accel and create containers without "
                            "their devices until it reconnects"))
    if live is not None:
        for key, filed, running in (
                (k.request_timeout, v.request_timeout, live.request_timeout),
                (k.registration_timeout, v.registration_timeout, live.registration_timeout)):
            if abs(filed - running) > 1e-3:
                src = v.files.values.get(key, (None, "the default"))[1]
                out.append(("info", f"{src} gives {key} = {_fmt(filed)} but {k.runtime} "
                                    f"runs with {_fmt(running)}: restart it to apply"))
    return out


_PLUGIN_NAME_RE = re.compile(r"^[0-9]{2}-.+$")


def _preregistered(v: NriView, root: HostRoot, plugin_name: str) -> list[Finding]:
    """Pre-registered plugins in plugin_path: nri-accel's own (NN-<name>), entries the
    runtime skips (not executable) and those that make it refuse them all (not named
    NN-name)."""
    out: list[Finding] = []
    rt, d = v.files.runtime, v.plugin_path
    for name in root.listdir(d):
        path = posixpath.join(d, name)
        try:
            st = root.lstat(path)
        except (OSError, ValueError):
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        executable = bool(st.st_mode & 0o111)
        if executable and not _PLUGIN_NAME_RE.match(name):
            out.append(("warn", f"{path}: executable but not named NN-name: {rt}'s NRI "
                                "then fails to start, with no pre-registered plugin and "
                                "no socket (nri pkg/adaptation discoverPlugins)"))
            continue
        if name.split("-", 1)[-1] != plugin_name:
            continue
        if not executable:
            out.append(("warn", f"{path}: not executable: {rt} skips it"))
            continue
        out.append(("warn", f"{path}: a pre-registered {plugin_name} that {rt} launches at "
                            "start: run either it or `nri-accel run`, not both (two plugins "
                            "adding the same devices make the runtime refuse the container)"))
    return out


def _validator(v: NriView, plugin_name: str, plugin_idx: str) -> list[Finding]:
    k = v.files.keys
    ours = {plugin_name, f"{plugin_idx}-{plugin_name}"}
    if v.validator and ours & set(v.required_plugins):
        tol = (f"; pods annotated {v.tolerate}/pod=true start without it"
               if v.tolerate else "")
        return [("ok", f"{k.runtime} refuses containers while {plugin_name} is not "
                       f"registered ({k.validator_table} required_plugins){tol}")]
    if v.validator is None and v.version is not None:
        return []  # this version has no validator
    since = (f"containerd {'.'.join(map(str, CONTAINERD_VALIDATOR))}+"
             if k is CONTAINERD_KEYS else f"CRI-O {'.'.join(map(str, CRIO_VALIDATOR))}+")
    enable = k.validator_enable.split(".")[-1]
    required = k.required_plugins.split(".")[-1]
    tolerate = k.tolerate.split(".")[-1]
    return [("info", f"{since} can refuse every container while {plugin_name} is not "
                     f"registered (fail closed): {k.validator_table} {enable} = true, "
                     f"{required} = [\"{plugin_name}\"], and {tolerate} for the pods "
                     f"that must start without it (deploy/{_deploy(k)} shows how)")]
