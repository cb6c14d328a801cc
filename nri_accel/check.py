"""`nri-accel check`: would `run` work on this node? Validate the configuration, discover
the node, talk NRI to the runtime and read the runtime's NRI configuration.

Owns: the checks, the NRI probe and their report. Imports the standard library, msgspec,
nri_accel.app (and through it uvloop, to say which event loop `run` would serve on),
nri_accel.config (the unix socket path rule), nri_accel.errors, nri_accel.nri.stub (the
Stub through its public API only: constructor, run(), stop(), runtime, last_failure),
nri_accel.runtime_config and nri_accel.state (the record `run` keeps of its
registration).

Prints one line per finding, "ok:", "info:", "warn:" or "error:" first. Exit status 0 when
`run` would work (warnings allowed), 1 otherwise, 2 for an invalid configuration (as with
every verb). The systemd unit runs it as ExecStartPre, so a node where `run` cannot work
fails at start with a readable reason.

The probe registers a second, short-lived plugin on the NRI socket, waits for the
runtime's Configure (its name, version, NRI version and timeouts) and first Synchronize
(what it lists), and stops: its stub closes the connection a quarter second after
answering, so that the runtime has read the answer (nri_accel.nri.stub.LINGER). The waits
are bounded by --timeout seconds, so a runtime that accepts the connection but never
answers is an error, never a hang; one that closes the connection, or sends bytes that
are not NRI, is an error saying so. It changes nothing on the node:
- it registers as PROBE_NAME, never as nri-accel: the runtime keeps a plugin per
  connection and refuses no duplicate name (nri pkg/adaptation acceptPluginConnections
  and RegisterPlugin check only the name's syntax), so it registers beside a running
  `nri-accel run`, beside another probe, or beside another plugin of the same name
  alike; and, named apart, it can never satisfy a validator's required_plugins that
  asks for nri-accel, nor be taken for it in the runtime's log;
- index PROBE_IDX ("99", or "98" where nri.idx is "99"): plugins are called in index
  order, so the probe comes after every other plugin and delays none of them; the
  index is not an identity (two plugins may share one), only an order;
- it subscribes to one event, POST_UPDATE_CONTAINER: the mask cannot be 0 (the
  runtime reads 0 as "every event", validation included), and that event is the
  quietest one that every runtime knows (containerd 1.7 knows events 1-11 only): a
  pure notification after a resource update, rare, whose answer changes nothing;
- it answers everything it receives with an empty reply: no adjustment, no update,
  Synchronize with no update.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import socket
import stat
from typing import TYPE_CHECKING, Any

from msgspec import Struct

from nri_accel import runtime_config as rc
from nri_accel.app import REPORT, App, loop_factory
from nri_accel.config import unix_socket_path_problem
from nri_accel.edits import compile_catalog
from nri_accel.errors import ConfigError
from nri_accel.nri.stub import Identity, RuntimeInfo, Stub
from nri_accel.state import NriStatus

if TYPE_CHECKING:
    from nri_accel.config import Config
    from nri_accel.discover.hostroot import HostRoot
    from nri_accel.inventory import Inventory

PROBE_NAME = "nri-accel-check"
PROBE_IDX = "99"
DEFAULT_TIMEOUT = 10.0
"""Seconds the probe waits for Configure and the first Synchronize. A healthy runtime
answers in milliseconds; the runtime accepts plugins one at a time, each bounded by its
own registration and request timeouts (5 s and 2 s by default), so a probe queued behind
another plugin's registration still fits."""

Finding = rc.Finding


def probe_identity(configured_idx: str) -> Identity:
    return Identity(PROBE_NAME, "98" if configured_idx == PROBE_IDX else PROBE_IDX)


class ProbePlugin:
    """The probe's plugin object for the Stub: records what the runtime says and answers
    every call empty."""

    def __init__(self) -> None:
        self.synchronized = asyncio.Event()
        self.configures = 0  # more than one: the runtime dropped it and the stub retried
        self.pods = 0
        self.containers = 0

    def configure(self, config: str, runtime_name: str, runtime_version: str) -> None:
        self.configures += 1  # None: the event mask follows the one handler below

    def synchronize(self, pods: list[Any], containers: list[Any]) -> None:
        self.pods, self.containers = len(pods), len(containers)
        self.synchronized.set()

    def post_update_container(self, pod: Any, container: Any) -> None:
        """The one subscription (see the module docstring); nothing to do."""


class ProbeResult(Struct, frozen=True):
    identity: Identity
    runtime: RuntimeInfo | None  # None: no Configure
    configures: int = 0
    synchronized: bool = False
    pods: int = 0
    containers: int = 0
    failure: str = ""  # the stub itself failed (a bug, not the runtime's doing)
    refused: str = ""  # why the latest registration failed: what the peer did ("": none)


async def probe(socket_path: str, identity: Identity, timeout: float) -> ProbeResult:
    """Register `identity` on `socket_path`, wait for Configure and the first Synchronize
    (at most `timeout` seconds), then stop (LINGER seconds after answering). Never raises
    for the runtime's behaviour."""
    plugin = ProbePlugin()
    stub = Stub(plugin, identity, socket_path=socket_path)
    runner = asyncio.get_running_loop().create_task(stub.run())
    synced = asyncio.ensure_future(plugin.synchronized.wait())
    failure = ""
    try:
        await asyncio.wait((synced, runner), timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        synced.cancel()
        stub.stop()
        try:
            await asyncio.wait_for(runner, 2.0)
        except TimeoutError:
            runner.cancel()
            with contextlib.suppress(BaseException):
                await runner
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
    return ProbeResult(identity, stub.runtime if plugin.configures else None,
                       plugin.configures, plugin.synchronized.is_set(), plugin.pods,
                       plugin.containers, failure, stub.last_failure)


def _socket_finding(path: str) -> Finding | None:
    """What keeps `path` from being probed (None: it accepts connections)."""
    why = unix_socket_path_problem(path)
    if why is not None:  # before stat: a path too long may name a file, never a socket
        return "error", f"NRI socket {path!r} {why}: nothing can connect to it"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "warn", (f"NRI socket {path} does not exist yet: is NRI enabled in the "
                        "runtime (deploy/containerd, deploy/crio)? `run` keeps retrying")
    except OSError as e:
        return "error", f"NRI socket {path}: {e.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return "error", f"{path} is not a unix socket"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            return "error", (f"NRI socket {path}: {e.strerror}: the socket is root's, and "
                             "so is `nri-accel run`")
        return "warn", f"NRI socket {path} refuses connections ({e.strerror}): runtime down?"
    finally:
        s.close()
    return None


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _secs(seconds: float) -> str:
    return f"{seconds * 1000:g} ms" if seconds < 1 else f"{seconds:g} s"


def probe_findings(result: ProbeResult, path: str, timeout: float) -> list[Finding]:
    who = result.identity.full_name
    rt = result.runtime
    if result.failure and not result.synchronized:
        return [("error", f"NRI socket {path}: the probe ({who}) failed: {result.failure}")]
    if rt is None and result.refused:  # it answered, but not as an NRI runtime does
        return [("error", f"NRI socket {path} accepts connections, but the probe's "
                          f"registration ({who}) failed: {result.refused}: what listens "
                          "there is not an NRI runtime, or it refuses plugins")]
    if rt is None:
        return [("error", f"NRI socket {path} accepts connections, but nothing answered "
                          f"the probe's registration ({who}) within {_secs(timeout)}: the "
                          "runtime is hung, or what listens there does not speak NRI")]
    name = f"{rt.name} {rt.version}".strip() or "the runtime"
    if not result.synchronized:
        dropped = (f", and dropped it {result.configures - 1} time(s) after Configure"
                   if result.configures > 1 else "")
        return [("error", f"NRI socket {path}: {name} configured the probe ({who}) but sent "
                          f"no Synchronize within {_secs(timeout)}{dropped}: `run` would "
                          "not get its pods and containers")]
    nri = f"NRI {rt.nri_version}" if rt.nri_version else "NRI version not sent"
    out: list[Finding] = [
        ("ok", f"NRI socket {path}: {name} ({nri}) registered the probe {who}"),
        ("ok", f"{name} synchronized {_n(result.pods, 'pod')} and "
               f"{_n(result.containers, 'container')}"),
    ]
    level = "warn" if rt.request_timeout < rc.MIN_REQUEST_TIMEOUT else "ok"
    out.append((level, f"{name} timeouts: request {_secs(rt.request_timeout)}, registration "
                       f"{_secs(rt.registration_timeout)}"
                + ("" if level == "ok" else
                   f": below {_secs(rc.MIN_REQUEST_TIMEOUT)}, a pause on a busy node makes "
                   "the runtime drop nri-accel and create containers without their devices "
                   "until it reconnects")))
    return out


def _registration_finding(state_dir: str) -> Finding | None:
    """What `nri-accel run` recorded of its registration (nri_accel.state.NriStatus)."""
    status = NriStatus.load(state_dir)
    if status.usable():
        return "info", (f"nri-accel run (pid {status.pid}) is registered as {status.plugin} "
                        f"with {status.runtime or 'the runtime'}")
    if status.problem:  # a file there that `run` could not have written
        return "warn", status.why_not()
    if status.heartbeat:
        return "info", status.why_not()
    return None


def _runtime_kind(name: str) -> str:
    name = name.lower()
    return ("containerd" if "containerd" in name else
            "CRI-O" if name.replace("-", "") == "crio" else "")


def runtime_config_findings(root: HostRoot, *, socket_path: str, plugin_name: str,
                            plugin_idx: str, runtime: RuntimeInfo | None) -> list[Finding]:
    """Findings about the runtime's NRI configuration files under `root`. `runtime`: what
    the runtime on the socket said in Configure (None: it did not answer)."""
    kind = _runtime_kind(runtime.name) if runtime else ""
    version = rc.parse_version(runtime.version) if runtime else None
    live = rc.Live(runtime.name, runtime.version, runtime.registration_timeout,
                   runtime.request_timeout) if runtime else None
    merge = None if kind != "containerd" or version is None else version >= (2,)
    read = {"containerd": rc.read_containerd(root, merge=merge), "CRI-O": rc.read_crio(root)}
    present = {k: v for k, v in read.items() if v is not None}
    where = "" if root.root in ("", "/") else f" under {root.root}"
    if kind and kind not in present:
        assert runtime is not None
        return [("info", f"no {kind} configuration file{where}: {runtime.name} "
                         f"{runtime.version} runs with its built-in NRI settings")]
    if not present:
        return [("info", f"no containerd or CRI-O configuration file{where} "
                         f"({rc.CONTAINERD_CONFIGS[0]}, {rc.CRIO_CONFIG}): their built-in "
                         "defaults apply (NRI on in containerd 2.x and CRI-O 1.30+, off "
                         "before)")]
    out: list[Finding] = []
    for name, files in present.items():
        if runtime is not None and kind and name != kind:
            out.append(("info", f"{name} configuration {', '.join(files.files) or '(none)'} "
                                f"not checked: the runtime on {socket_path} is "
                                f"{runtime.name}"))
            continue
        mine = name == kind
        out += rc.findings(rc.view(files, version if mine else None), root,
                           socket=socket_path, plugin_name=plugin_name,
                           plugin_idx=plugin_idx, live=live if mine else None)
    return out


def _absent_kinds(config: Config, inventory: Inventory) -> list[Finding]:
    """A warning for each kind or resource the configuration names that this node does
    not have: a misspelt one would change nothing, silently (a configuration shared by
    nodes of other hardware names some on purpose)."""
    from nri_accel.deviceplugin.resources import resources_from_inventory

    kinds = {d.kind for d in inventory.devices}
    resources = {r.name for r in resources_from_inventory(inventory, config)[0]}
    named = [*(("devices.shared_kinds", k, "device kind", kinds)
               for k in sorted(config.devices.shared_kinds)),
             *(("device_plugin.resource_names", k, "device kind", kinds)
               for k, _ in config.device_plugin.resource_names),
             *(("device_plugin.replicas", r, "advertised resource", resources)
               for r, _ in config.device_plugin.replicas)]
    return [("warn", f"{key} {name!r}: no such {what} on this node (misspelt? here it "
             "changes nothing)") for key, name, what, present in named if name not in present]


def _loop_finding(config: Config) -> Finding:
    """The event loop `run` would serve on (nri.event_loop, App.run_loop)."""
    choice = f'nri.event_loop = "{config.nri.event_loop}"'
    try:
        uvloop = loop_factory(config) is not None
    except ConfigError as e:
        return ("error", str(e))
    if uvloop:
        return ("ok", f"event loop: uvloop ({choice})")
    if config.nri.event_loop == "asyncio":
        return ("info", f"event loop: asyncio's own ({choice})")
    return ("warn", f"event loop: asyncio's own, uvloop cannot be imported ({choice}): "
                    "each container costs `run` some 6-8 us more CPU")


def main_check(args: argparse.Namespace) -> int:
    app = App.from_args(args, mode=REPORT)
    config = app.config
    timeout = args.timeout if getattr(args, "timeout", None) else DEFAULT_TIMEOUT
    findings: list[Finding] = [
        ("ok", f"configuration {config.path or '(built-in defaults)'}: "
               f"policy {config.policy.mode}"),
        _loop_finding(config),
    ]
    inventory = app.load_inventory()
    kinds: dict[str, int] = {}
    for d in inventory.devices:
        kinds[d.kind] = kinds.get(d.kind, 0) + 1
    if kinds:
        findings.append(("ok", "devices: " + ", ".join(f"{n} {k}" for k, n in kinds.items())))
    else:
        findings.append(("warn", "no accelerator devices found on this node"))
    findings += [("warn", f"{p.source}: {p.message}") for p in inventory.problems]
    findings += [("error", f"{who}: edits refused, a container granted it fails: {why}")
                 for who, why in compile_catalog(inventory, config.devices).refused()]
    findings += _absent_kinds(config, inventory)

    socket_path = args.socket or config.nri.socket
    runtime = None
    blocked = _socket_finding(socket_path)
    if blocked is not None:
        findings.append(blocked)
    else:
        result = asyncio.run(probe(socket_path, probe_identity(config.nri.idx), timeout))
        findings += probe_findings(result, socket_path, timeout)
        runtime = result.runtime if result.synchronized else None
    registered = _registration_finding(config.state_dir)
    if registered is not None:
        findings.append(registered)
    findings += runtime_config_findings(app.host_root(), socket_path=socket_path,
                                        plugin_name=config.nri.name,
                                        plugin_idx=config.nri.idx, runtime=runtime)

    for level, text in findings:
        print(f"{level}: {text}")
    return 1 if any(level == "error" for level, _ in findings) else 0
