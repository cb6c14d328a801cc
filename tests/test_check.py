"""`nri-accel check`: findings and exit status before `run`.

The NRI probe runs against the runtime simulator (nri_accel.nri.simulator, which stands
for containerd's and CRI-O's NRI adaptation) over a real unix socket; the runtime
configuration readers read files written into a temporary host root, as `--root /host`
reads a node's from a DaemonSet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nri_accel import runtime_config as rc
from nri_accel.check import _socket_finding, runtime_config_findings
from nri_accel.cli import main
from nri_accel.config import UNIX_PATH_MAX
from nri_accel.discover.hostroot import HostRoot
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.simulator import (
    LEGACY_EVENTS,
    PluginConn,
    Simulator,
    make_container,
    make_pod,
)
from nri_accel.nri.stub import LINGER, Identity, RuntimeInfo, Stub, event_bit
from nri_accel.state import NRI_STATUS_FILE

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "nri_accel" / "demo" / "inventory.json"
SCENARIO_TIMEOUT = 60.0  # a bound on a broken test, not a timing assertion


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (unix socket paths are limited to 107 bytes)."""
    directory = tempfile.mkdtemp(prefix="nri-check-")
    try:
        yield Path(directory)
    finally:
        shutil.rmtree(directory)


def lines(out: str) -> list[str]:
    return out.splitlines()


# ---- the socket, without a runtime -------------------------------------------------------

def test_missing_socket_is_a_warning_run_would_retry(tmp_path, capsys) -> None:
    rc_ = main(["check", "--inventory", str(DEMO), "--socket", str(tmp_path / "nri.sock")])
    out = capsys.readouterr().out
    assert rc_ == 0
    assert "ok: configuration" in out
    assert "ok: devices: 8 nvidia.com/gpu, 3 nvidia.com/mig" in out
    assert f"warn: NRI socket {tmp_path / 'nri.sock'} does not exist yet" in out


def test_a_regular_file_is_an_error(tmp_path, capsys) -> None:
    path = tmp_path / "nri.sock"
    path.write_text("not a socket")
    assert main(["check", "--inventory", str(DEMO), "--socket", str(path)]) == 1
    assert f"error: {path} is not a unix socket" in capsys.readouterr().out


def test_a_socket_that_accepts_but_never_answers_is_an_error(short_dir, capsys) -> None:
    # Bound and listening, never accepting: the kernel completes the connection, the
    # probe's RegisterPlugin goes unanswered. The probe gives up after --timeout.
    path = short_dir / "nri.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    try:
        rc_ = main(["check", "--inventory", str(DEMO), "--socket", str(path),
                    "--timeout", "0.3"])
    finally:
        srv.close()
    out = capsys.readouterr().out
    assert rc_ == 1
    assert (f"error: NRI socket {path} accepts connections, but nothing answered the "
            "probe's registration (99-nri-accel-check) within 300 ms") in out


@pytest.mark.parametrize(("reply", "said"), [
    (b"", "the peer closed the connection before answering RegisterPlugin"),
    (b"HTTP/1.1 400 Bad Request\r\n\r\n",
     "the peer sent bytes that are not NRI (mux frame for connection 1213486160"),
])
def test_a_socket_that_closes_or_answers_garbage_is_said_so(short_dir, capsys, reply,
                                                            said) -> None:
    # Not a hang: what listens there closes at once, or reads the registration and
    # answers as an HTTP server would; each probe once read "nothing answered ...: the
    # runtime is hung".
    path = short_dir / "nri.sock"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            if reply:
                await reader.read(1)
                writer.write(reply)
                await writer.drain()
        writer.close()

    async def go() -> int:
        async with await asyncio.start_unix_server(answer, str(path)):
            return await run_check(["check", "--inventory", str(DEMO), "--socket",
                                    str(path), "--timeout", "0.5"])

    code = scenario(go())
    out = capsys.readouterr().out
    assert code == 1
    assert (f"error: NRI socket {path} accepts connections, but the probe's registration "
            f"(99-nri-accel-check) failed: {said}") in out
    assert "hung" not in out


def test_a_socket_path_too_long_is_an_error_not_a_socket_to_wait_for(short_dir) -> None:
    # It once read "does not exist yet" (a warning, exit 0): it can never be connected to,
    # whether a file has that name or not.
    path = short_dir / ("s" * (UNIX_PATH_MAX - len(str(short_dir))))
    assert _socket_finding(str(path))[0] == "error"
    path.touch()
    level, text = _socket_finding(str(path))
    assert level == "error"
    assert text.startswith(f"NRI socket {str(path)!r} is {UNIX_PATH_MAX + 1} bytes long, "
                           f"over the {UNIX_PATH_MAX}-byte limit")
    assert _socket_finding(str(short_dir / "absent.sock"))[0] == "warn"  # run would retry


@pytest.mark.parametrize(("choice", "importable", "rc", "line"), [
    ("auto", True, 0, 'ok: event loop: uvloop (nri.event_loop = "auto")'),
    ("uvloop", True, 0, 'ok: event loop: uvloop (nri.event_loop = "uvloop")'),
    ("asyncio", True, 0, 'info: event loop: asyncio\'s own (nri.event_loop = "asyncio")'),
    ("auto", False, 0, 'warn: event loop: asyncio\'s own, uvloop cannot be imported '
                       '(nri.event_loop = "auto"): each container costs `run` some 6-8 us '
                       'more CPU'),
    ("uvloop", False, 1, "error: {config}: nri.event_loop: uvloop cannot be imported"),
])
def test_the_event_loop_run_would_serve_on_is_reported(
        tmp_path, capsys, monkeypatch, choice, importable, rc, line) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[nri]\nevent_loop = "{choice}"\n')
    if not importable:
        monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` fails
    assert main(["check", "--config", str(config), "--inventory", str(DEMO),
                 "--socket", str(tmp_path / "nri.sock")]) == rc
    out = lines(capsys.readouterr().out)
    assert next(x for x in out if "event loop:" in x or "nri.event_loop:" in x).startswith(
        line.format(config=config))


def test_empty_node_warns(tmp_path, capsys) -> None:
    inv = tmp_path / "empty.json"
    inv.write_text('{"schema_version": 1}')
    assert main(["check", "--inventory", str(inv), "--socket", str(tmp_path / "s")]) == 0
    assert "warn: no accelerator devices found on this node" in capsys.readouterr().out


@pytest.mark.parametrize(("path", "why"), [
    ("/etc/passwd", "is not under /dev"),
    ("dev/nvidia0", "is not an absolute path"),
    ("/dev/../etc/passwd", "contains '..'"),
])
def test_a_saved_inventory_whose_edits_are_refused_is_an_error(
        tmp_path, capsys, path, why) -> None:
    # The inventory loads (each device's edits are checked where they are compiled, and a
    # container granted this one would fail): check says so before `run` starts.
    doc = json.loads(DEMO.read_text())
    doc["devices"][0]["edits"]["device_nodes"][0]["path"] = path
    inv = tmp_path / "node.json"
    inv.write_text(json.dumps(doc))
    assert main(["check", "--inventory", str(inv), "--socket", str(tmp_path / "s")]) == 1
    (error,) = [line for line in lines(capsys.readouterr().out) if line.startswith("error:")]
    assert error.startswith(f"error: nvidia.com/gpu={doc['devices'][0]['name']}: edits "
                            "refused")
    assert why in error


def test_kinds_and_resources_the_config_names_that_the_node_lacks_are_warnings(
        tmp_path, capsys) -> None:
    config = tmp_path / "config.toml"
    config.write_text(textwrap.dedent("""\
        [devices]
        shared_kinds = ["nvidia.com/mig", "nvidia.com/gpuu"]
        [device_plugin.replicas]
        "nvidia.com/gpu" = 2
        "nvidia.com/gpuu" = 4
        [device_plugin.resource_names]
        "nvidia.com/gpuu" = "x.io/gpu"
        """))
    assert main(["check", "--inventory", str(DEMO), "--config", str(config),
                 "--socket", str(tmp_path / "s")]) == 0
    warned = [line for line in lines(capsys.readouterr().out) if "misspelt" in line]
    assert [line.split(":")[1].strip() for line in warned] == [
        "devices.shared_kinds 'nvidia.com/gpuu'",
        "device_plugin.resource_names 'nvidia.com/gpuu'",
        "device_plugin.replicas 'nvidia.com/gpuu'"]


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_timeout_must_be_positive_seconds(value, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["check", "--timeout", value])
    assert exc.value.code == 2
    assert "not a positive number of seconds" in capsys.readouterr().err


# ---- the probe against a runtime ------------------------------------------------------------

class Recorder:
    """Wraps Simulator.plugin_ready: the plugins that were configured and synchronised,
    and how long each stayed connected after its Synchronize answer was read (seconds,
    monotonic clock)."""

    def __init__(self, sim: Simulator) -> None:
        self.ready: list[tuple[str, int]] = []
        self.stayed: list[float] = []
        self._inner = sim.plugin_ready
        sim.plugin_ready = self  # type: ignore[method-assign]

    def __call__(self, conn: PluginConn) -> None:
        self.ready.append((conn.full_name, conn.events))
        answered = time.monotonic()
        conn.mux.lost.add_done_callback(
            lambda _: self.stayed.append(time.monotonic() - answered))
        self._inner(conn)


def populate(sim: Simulator) -> None:
    for name, ctrs in (("web", ["app", "sidecar"]), ("train", ["main"])):
        pod = make_pod({"name": name, "namespace": "ml"})
        sim.pods[pod.id] = pod
        for ctr in ctrs:
            c = make_container(pod, {"name": ctr, "state": "CONTAINER_RUNNING"})
            sim.containers[c.id] = c


async def run_check(argv: list[str]) -> int:
    """main() in a worker thread: it runs its own event loop (asyncio.run)."""
    return await asyncio.to_thread(main, argv)


def scenario(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, SCENARIO_TIMEOUT))


RUNTIMES = {
    # name: (Simulator arguments, the Configure line check prints)
    "containerd-2.1": (dict(runtime_name="containerd", runtime_version="v2.1.4",
                            nri_version="v0.9.0"),
                       "containerd v2.1.4 (NRI v0.9.0)"),
    # containerd 1.7: NRI v0.3-v0.6 knows events 1-11 only and sends no NRI version.
    "containerd-1.7": (dict(runtime_name="containerd", runtime_version="1.7.24",
                            nri_version="", known_events=LEGACY_EVENTS),
                       "containerd 1.7.24 (NRI version not sent)"),
    "cri-o-1.36": (dict(runtime_name="cri-o", runtime_version="1.36.3", nri_version=""),
                   "cri-o 1.36.3 (NRI version not sent)"),
}


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_a_registering_runtime_is_reported_and_left_as_it_was(runtime, short_dir,
                                                              capsys) -> None:
    kwargs, said = RUNTIMES[runtime]
    path = short_dir / "nri.sock"

    async def go() -> tuple[int, Recorder, int]:
        async with Simulator(str(path), request_timeout=2.0, registration_timeout=5.0,
                             **kwargs) as sim:
            populate(sim)
            seen = Recorder(sim)
            code = await run_check(["check", "--inventory", str(DEMO), "--socket",
                                    str(path), "--timeout", "30"])
            await sim.wait_for(lambda s: not s.connections, timeout=10)
            return code, seen, len(sim.dropped)

    code, seen, dropped = scenario(go())
    out = capsys.readouterr().out
    assert code == 0, out
    name = said.split(" (")[0]
    assert f"ok: NRI socket {path}: {said} registered the probe 99-nri-accel-check" in out
    assert f"ok: {name} synchronized 2 pods and 3 containers" in out
    assert f"ok: {name} timeouts: request 2 s, registration 5 s" in out
    # It subscribed to the one notification, then went away without being dropped, and
    # not at once: the runtime's reader must take the answer before it sees the close
    # (stub.LINGER; half of it here, for the answer's own way to the simulator).
    assert seen.ready == [("99-nri-accel-check", event_bit(pb.POST_UPDATE_CONTAINER))]
    assert dropped == 0
    assert len(seen.stayed) == 1 and seen.stayed[0] >= LINGER / 2, seen.stayed


def test_a_short_request_timeout_is_a_warning(short_dir, capsys) -> None:
    path = short_dir / "nri.sock"

    async def go() -> int:
        async with Simulator(str(path), runtime_name="containerd", runtime_version="v2.1.4",
                             request_timeout=0.5):
            return await run_check(["check", "--inventory", str(DEMO), "--socket",
                                    str(path), "--timeout", "30"])

    assert scenario(go()) == 0
    out = capsys.readouterr().out
    assert "warn: containerd v2.1.4 timeouts: request 500 ms, registration 5 s: below 1 s" in out


@pytest.mark.parametrize("other", ["40-nri-accel", "99-nri-accel-check"])
def test_the_probe_registers_beside_a_plugin_already_there(other, short_dir, capsys) -> None:
    # A running `nri-accel run`, or another plugin (another check) under the probe's own
    # name: the runtime keeps both, and the probe leaves the other one registered.
    idx, name = other.split("-", 1)
    path = short_dir / "nri.sock"

    class Quiet:
        def state_change(self, event: int, pod: Any, container: Any) -> None:
            pass

    async def go() -> tuple[int, list[str]]:
        async with Simulator(str(path)) as sim:
            stub = Stub(Quiet(), Identity(name, idx), socket_path=str(path))
            task = asyncio.get_running_loop().create_task(stub.run())
            try:
                await sim.wait_for_plugin(name)
                code = await run_check(["check", "--inventory", str(DEMO), "--socket",
                                        str(path), "--timeout", "30"])
                await sim.wait_for(lambda s: len(s.connections) == 1, timeout=10)
                return code, [c.full_name for c in sim.plugins]
            finally:
                stub.stop()
                await task

    code, remaining = scenario(go())
    out = capsys.readouterr().out
    assert code == 0, out
    assert "registered the probe 99-nri-accel-check" in out
    assert remaining == [other]


def test_a_runtime_that_configures_but_never_synchronizes_is_an_error(short_dir, capsys,
                                                                       monkeypatch) -> None:
    async def never(self: PluginConn) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(PluginConn, "_synchronize", never)
    path = short_dir / "nri.sock"

    async def go() -> int:
        async with Simulator(str(path), runtime_name="containerd", runtime_version="v2.1.4"):
            return await run_check(["check", "--inventory", str(DEMO), "--socket",
                                    str(path), "--timeout", "0.5"])

    assert scenario(go()) == 1
    out = capsys.readouterr().out
    assert (f"error: NRI socket {path}: containerd v2.1.4 configured the probe "
            "(99-nri-accel-check) but sent no Synchronize within 500 ms") in out


def test_the_probe_index_moves_aside_when_nri_accel_uses_99(short_dir, tmp_path,
                                                             capsys) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[nri]\nidx = "99"\n')
    path = short_dir / "nri.sock"

    async def go() -> int:
        async with Simulator(str(path)):
            return await run_check(["check", "--config", str(cfg), "--inventory", str(DEMO),
                                    "--socket", str(path), "--timeout", "30"])

    assert scenario(go()) == 0
    assert "registered the probe 98-nri-accel-check" in capsys.readouterr().out


def test_the_record_of_a_running_nri_accel_is_reported(tmp_path, capsys) -> None:
    from nri_accel.state import NriStatus, boottime

    state = tmp_path / "state"
    NriStatus(True, "containerd v2.1.4", "40-nri-accel", 4242, boottime()).save(str(state))
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'state_dir = "{state}"\n')
    assert main(["check", "--config", str(cfg), "--inventory", str(DEMO),
                 "--socket", str(tmp_path / "none")]) == 0
    assert ("info: nri-accel run (pid 4242) is registered as 40-nri-accel with "
            "containerd v2.1.4") in capsys.readouterr().out


# ---- the runtime's configuration files ------------------------------------------------------

DEPLOY_CONTAINERD = (REPO / "deploy" / "containerd" / "nri-accel.toml").read_text()
DEPLOY_CRIO = (REPO / "deploy" / "crio" / "10-nri-accel.conf").read_text()
SOCK = "/var/run/nri/nri.sock"
CTD = "/etc/containerd/config.toml"
NRI = '[plugins."io.containerd.nri.v1.nri"]'
VALIDATOR = '[plugins."io.containerd.nri.v1.nri".default_validator]'


def write_root(root: Path, files: dict[str, str]) -> None:
    for host_path, text in files.items():
        p = root / host_path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        if text.startswith("->"):
            os.symlink(text[2:], p)
        else:
            p.write_text(textwrap.dedent(text))


def config_findings(root: Path, runtime: RuntimeInfo | None = None,
                    socket_path: str = SOCK) -> list[str]:
    found = runtime_config_findings(HostRoot.at(root), socket_path=socket_path,
                                    plugin_name="nri-accel", plugin_idx="40",
                                    runtime=runtime)
    return [f"{level}: {text}" for level, text in found]


def has(found: list[str], level: str, *fragments: str) -> bool:
    return any(f.startswith(f"{level}: ") and all(x in f for x in fragments) for f in found)


CONFIG_CASES: dict[str, tuple[dict[str, str], list[tuple[str, ...]], list[tuple[str, ...]]]] = {
    # name: (files, findings expected as (level, fragments...), findings that must not be)
    "containerd 1.7 (version 2) with NRI disabled": (
        {CTD: f"version = 2\n{NRI}\n  disable = true\n"},
        [("warn", "NRI is off (disable = true in /etc/containerd/config.toml)",
          "set disable = false")],
        [("ok", "NRI on")]),
    "version 2 without an NRI section: off in 1.7, on in 2.x": (
        {CTD: "version = 2\n"},
        [("warn", "no `disable` key", "off in containerd 1.7", "on in 2.x")],
        [("ok", "NRI on")]),
    "containerd 2.x (version 3) has NRI on by default": (
        {CTD: "version = 3\n"},
        [("ok", "containerd configuration /etc/containerd/config.toml: NRI on, external "
                f"plugins allowed, socket {SOCK}"),
         ("info", "containerd 2.2+ can refuse every container", "required_plugins")],
        [("warn",)]),
    "version 1 names the section by the short ID": (
        {CTD: "[plugins.nri]\n  disable = false\n"},
        [("ok", "NRI on")], [("warn",)]),
    "version 1 with the URI name: containerd 1.7 ignores it": (
        {CTD: f"{NRI}\n  disable = false\n"},
        [("warn", "with /etc/containerd/config.toml at version 1 (no `version` line) "
                  "containerd 1.7 reads [plugins.nri] instead: add version = 2")], []),
    "[plugins.nri] in version 2 is ignored": (
        {CTD: "version = 2\n[plugins.nri]\n  disable = false\n"},
        [("warn", "[plugins.nri] is ignored with config version 2")], []),
    "connections disabled": (
        {CTD: f"version = 3\n{NRI}\n  disable_connections = true\n"},
        [("warn", "disable_connections = true", "creates no NRI socket",
          "only a plugin containerd launches from /opt/nri/plugins")],
        [("ok", "NRI on")]),
    "socket mismatch": (
        {CTD: f'version = 3\n{NRI}\n  socket_path = "/run/containerd/nri.sock"\n'},
        [("warn", "containerd listens on /run/containerd/nri.sock (socket_path, "
                  f"/etc/containerd/config.toml) but nri-accel connects to {SOCK}")],
        [("ok", "NRI on")]),
    "/var/run is /run: the same socket": (
        {CTD: f'version = 3\n{NRI}\n  socket_path = "/run/nri/nri.sock"\n',
         "/var/run": "->../run", "/run/nri/.keep": ""},
        [("ok", "NRI on", "socket /run/nri/nri.sock")], [("warn",)]),
    "malformed main file: a warning naming it, and no guess": (
        {CTD: f"version = 3\n{NRI}\n  disable = \n"},
        [("warn", "/etc/containerd/config.toml: not valid TOML",
          "the runtime does not start with it")],
        [("warn", "no `disable` key"), ("ok",), ("info",)]),
    "the deploy drop-in imported by a version 2 config": (
        {CTD: 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n',
         "/etc/containerd/conf.d/nri-accel.toml": DEPLOY_CONTAINERD},
        [("ok", "/etc/containerd/config.toml, /etc/containerd/conf.d/nri-accel.toml: NRI on")],
        [("warn",)]),
    "a relative import, missing": (
        {CTD: 'version = 3\nimports = ["nri.toml"]\n'},
        [("warn", "/etc/containerd/config.toml imports /etc/containerd/nri.toml, which "
                  "does not exist")], []),
    "an import of a higher version than the root config's: 2.x does not start": (
        {CTD: 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n',
         "/etc/containerd/conf.d/99-nvidia.toml": "version = 3\n"},
        [("warn", "/etc/containerd/conf.d/99-nvidia.toml: version = 3 is higher than the "
                  "root config's version 2: containerd 2.x does not start",
          "drop-in config version 3 higher than root config version 2")], []),
    "imports without a version, or of the root config's: no version problem": (
        {CTD: 'version = 3\nimports = ["/etc/containerd/conf.d/*.toml"]\n',
         "/etc/containerd/conf.d/10-nri-accel.toml": DEPLOY_CONTAINERD,
         "/etc/containerd/conf.d/20-same.toml": "version = 3\n",
         "/etc/containerd/conf.d/30-lower.toml": "version = 2\n"},
        [("ok", "NRI on")], [("warn", "is higher than")]),
    "an import disables NRI (later files win)": (
        {CTD: f'version = 3\nimports = ["/etc/containerd/conf.d/*.toml"]\n{NRI}\n'
              "  disable = false\n",
         "/etc/containerd/conf.d/99-off.toml": f"{NRI}\n  disable = true\n"},
        [("warn", "NRI is off (disable = true in /etc/containerd/conf.d/99-off.toml)")], []),
    "timeouts: a short request timeout and an invalid duration": (
        {CTD: f'version = 3\n{NRI}\n  plugin_request_timeout = "500ms"\n'
              '  plugin_registration_timeout = "5 seconds"\n'},
        [("warn", "plugin_request_timeout = 500ms: below 1s"),
         ("warn", "plugin_registration_timeout: '5 seconds' is not a duration")], []),
    "a negative timeout is used as written, not replaced by the default": (
        # containerd pkg/nri/config.go ConfigureTimeouts: only 0 keeps the default
        {CTD: f'version = 3\n{NRI}\n  plugin_registration_timeout = "-5s"\n'
              '  plugin_request_timeout = "-500ms"\n'},
        [("warn", "plugin_registration_timeout = -5s: negative", "drops every plugin"),
         ("warn", "plugin_request_timeout = -500ms: negative", "drops every plugin")],
        [("warn", "below 1s")]),
    "a wrongly typed key": (
        {CTD: f'version = 3\n{NRI}\n  disable = "no"\n'},
        [("warn", "disable = 'no': not a boolean")], []),
    "required by the default validator": (
        {CTD: f'version = 3\n{VALIDATOR}\n  enable = true\n'
              '  required_plugins = ["nri-accel"]\n'
              '  tolerate_missing_plugins_annotation = "tolerate.example/nri"\n'},
        [("ok", "containerd refuses containers while nri-accel is not registered",
          "tolerate.example/nri/pod=true")],
        [("info",)]),
    "a pre-registered nri-accel, and a plugin_path entry the runtime chokes on": (
        {CTD: "version = 3\n", "/usr/bin/nri-accel": "#!/bin/sh\n",
         "/opt/nri/plugins/40-nri-accel": "->/usr/bin/nri-accel",
         "/opt/nri/plugins/README": ""},
        [("warn", "/opt/nri/plugins/40-nri-accel: a pre-registered nri-accel",
          "not both")], []),
    "k3s's generated containerd config": (
        {"/var/lib/rancher/k3s/agent/etc/containerd/config.toml":
         f"version = 3\n{NRI}\n  disable = true\n"},
        [("warn", "/var/lib/rancher/k3s/agent/etc/containerd/config.toml", "NRI is off")], []),
    "CRI-O: the deploy drop-in overrides crio.conf": (
        {"/etc/crio/crio.conf": "[crio.nri]\nenable_nri = false\n",
         "/etc/crio/crio.conf.d/10-nri-accel.conf": DEPLOY_CRIO},
        [("ok", "CRI-O configuration /etc/crio/crio.conf, "
                "/etc/crio/crio.conf.d/10-nri-accel.conf: NRI on")],
        [("warn",)]),
    "CRI-O: drop-ins apply in lexical order, the last one wins": (
        {"/etc/crio/crio.conf.d/20-off.conf": "[crio.nri]\nenable_nri = false\n",
         "/etc/crio/crio.conf.d/10-nri-accel.conf": DEPLOY_CRIO},
        [("warn", "NRI is off (enable_nri = false in /etc/crio/crio.conf.d/20-off.conf)",
          "set enable_nri = true in [crio.nri]")], []),
    "CRI-O: links in the drop-in directory, to a file (read) and to a directory (not walked)": (
        {"/etc/crio/crio.conf.d/a": "->.", "/etc/crio/crio.conf.d/b": "->.",
         "/etc/crio/crio.conf.d/10-nri-accel.conf": "->/opt/crio/nri.conf",
         "/opt/crio/nri.conf": DEPLOY_CRIO},
        [("ok", "/etc/crio/crio.conf.d/10-nri-accel.conf: NRI on")], [("warn",)]),
    "CRI-O: a malformed drop-in is named, the others still read": (
        {"/etc/crio/crio.conf.d/05-broken.conf": "[crio.nri\n",
         "/etc/crio/crio.conf.d/10-nri-accel.conf": DEPLOY_CRIO},
        [("warn", "/etc/crio/crio.conf.d/05-broken.conf: not valid TOML"),
         ("ok", "NRI on")], []),
    "CRI-O: no enable_nri, version unknown": (
        {"/etc/crio/crio.conf": "[crio.runtime]\ndefault_runtime = \"crun\"\n"},
        [("warn", "no `enable_nri` key in [crio.nri]", "off before CRI-O 1.30")], []),
    "CRI-O: nri_listen elsewhere, connections disabled": (
        {"/etc/crio/crio.conf.d/10.conf":
         '[crio.nri]\nenable_nri = true\nnri_listen = "/run/crio/nri.sock"\n'
         "nri_disable_connections = true\n"},
        [("warn", "CRI-O listens on /run/crio/nri.sock (nri_listen"),
         ("warn", "nri_disable_connections = true")], []),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_runtime_configuration(case, tmp_path) -> None:
    files, expected, unexpected = CONFIG_CASES[case]
    write_root(tmp_path, files)
    for p in ("/usr/bin/nri-accel",):
        if p in files:
            os.chmod(tmp_path / p.lstrip("/"), 0o755)
    found = config_findings(tmp_path)
    for level, *fragments in expected:
        assert has(found, level, *fragments), (level, fragments, found)
    for level, *fragments in unexpected:
        assert not has(found, level, *fragments), (level, fragments, found)


def test_no_runtime_configuration_is_one_info_line(tmp_path) -> None:
    assert config_findings(tmp_path) == [
        f"info: no containerd or CRI-O configuration file under {tmp_path} "
        "(/etc/containerd/config.toml, /etc/crio/crio.conf): their built-in defaults apply "
        "(NRI on in containerd 2.x and CRI-O 1.30+, off before)"]


def live(name: str, version: str, request: float = 2.0) -> RuntimeInfo:
    return RuntimeInfo(name=name, version=version, registration_timeout=5.0,
                       request_timeout=request)


def test_the_running_runtime_decides_version_dependent_defaults(tmp_path) -> None:
    write_root(tmp_path, {CTD: "version = 2\n"})
    # containerd 1.7 answered, so NRI is on now, but the file leaves it off at the
    # next restart (1.7's default); 2.x has it on by default.
    old = config_findings(tmp_path, live("containerd", "1.7.24"))
    assert has(old, "warn", "NRI is off (containerd 1.7 leaves NRI off without "
                            "`disable = false`)", "the running containerd has it on until")
    assert not has(old, "info", "default_validator")  # 1.7 has no validator
    new = config_findings(tmp_path, live("containerd", "v2.2.1"))
    assert has(new, "ok", "NRI on")
    assert has(new, "info", "containerd 2.2+ can refuse every container")
    assert not has(new, "warn")


def test_containerd_2x_ignores_plugins_nri_in_a_version_1_file(tmp_path) -> None:
    # 2.x migrates a version 1 file's [plugins.nri] to io.containerd.grpc.v1.nri
    # (cmd/containerd/server/config/config.go v1MigratePluginName); 1.7 reads it.
    write_root(tmp_path, {CTD: "[plugins.nri]\n  disable_connections = true\n"})
    new = config_findings(tmp_path, live("containerd", "v2.1.4"))
    assert has(new, "warn", "/etc/containerd/config.toml: [plugins.nri] is ignored by "
                            "containerd 2.x", f"use {NRI}")
    assert not has(new, "warn", "disable_connections = true")
    assert has(new, "ok", "NRI on, external plugins allowed")
    old = config_findings(tmp_path, live("containerd", "1.7.24"))
    assert has(old, "warn", "disable_connections = true")
    assert not has(old, "warn", "[plugins.nri] is ignored")


def test_only_containerd_2x_refuses_an_import_of_a_higher_version(tmp_path) -> None:
    # The root config's version is the first one stated, in load order (a main file
    # without one takes its first import's).
    write_root(tmp_path, {
        CTD: 'imports = ["/etc/containerd/conf.d/*.toml"]\n',
        "/etc/containerd/conf.d/10.toml": "version = 2\n",
        "/etc/containerd/conf.d/20.toml": "version = 3\n"})
    higher = "/etc/containerd/conf.d/20.toml: version = 3 is higher than the root config's"
    assert has(config_findings(tmp_path, live("containerd", "v2.1.4")), "warn", higher)
    assert not has(config_findings(tmp_path, live("containerd", "1.7.24")), "warn", higher)


def test_containerd_2x_reads_the_uri_section_of_a_version_1_file(tmp_path) -> None:
    write_root(tmp_path, {CTD: f"{NRI}\n  disable_connections = true\n"})
    files = rc.read_containerd(HostRoot.at(tmp_path), merge=True)
    assert files is not None and files.uri_in_v1 == ()
    assert rc.view(files).connections is False  # no version given: still 2.x's reading
    found = config_findings(tmp_path, live("containerd", "v2.1.4"))
    assert has(found, "warn", "disable_connections = true")
    assert not has(found, "warn", "add version = 2")


def test_a_file_timeout_the_runtime_does_not_run_with_is_reported(tmp_path) -> None:
    write_root(tmp_path, {CTD: f'version = 3\n{NRI}\n  plugin_request_timeout = "5s"\n'})
    found = config_findings(tmp_path, live("containerd", "v2.1.4", request=2.0))
    assert has(found, "info", "/etc/containerd/config.toml gives plugin_request_timeout = 5s "
                              "but containerd runs with 2s: restart it to apply")


def test_only_the_runtime_on_the_socket_is_checked(tmp_path) -> None:
    write_root(tmp_path, {CTD: f"version = 2\n{NRI}\n  disable = true\n",
                          "/etc/crio/crio.conf.d/10-nri-accel.conf": DEPLOY_CRIO})
    found = config_findings(tmp_path, live("cri-o", "1.36.3"))
    assert has(found, "info", "containerd configuration /etc/containerd/config.toml not "
                              "checked: the runtime on /var/run/nri/nri.sock is cri-o")
    assert has(found, "ok", "CRI-O configuration", "NRI on")
    assert not has(found, "warn")


def test_containerd_17_replaces_an_imported_section_and_2x_merges_it(tmp_path) -> None:
    write_root(tmp_path, {
        CTD: f'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n{NRI}\n'
             f'  disable = false\n  socket_path = "/run/x.sock"\n',
        "/etc/containerd/conf.d/timeouts.toml": f'{NRI}\n  plugin_request_timeout = "3s"\n'})
    root = HostRoot.at(tmp_path)
    replaced = rc.read_containerd(root, merge=False)
    merged = rc.read_containerd(root, merge=True)
    assert replaced is not None and merged is not None
    assert set(replaced.values) == {"plugin_request_timeout"}
    assert merged.values == {
        "disable": (False, CTD), "socket_path": ("/run/x.sock", CTD),
        "plugin_request_timeout": ("3s", "/etc/containerd/conf.d/timeouts.toml")}


def test_the_command_reads_the_runtime_configuration_under_root(tmp_path, capsys) -> None:
    write_root(tmp_path, {CTD: f"version = 2\n{NRI}\n  disable = true\n"})
    code = main(["check", "--root", str(tmp_path), "--socket", str(tmp_path / "nri.sock")])
    out = capsys.readouterr().out
    assert code == 0  # statements about files warn; the socket tells what runs
    assert ("warn: containerd configuration /etc/containerd/config.toml: NRI is off "
            "(disable = true in /etc/containerd/config.toml)") in out


@pytest.mark.parametrize(("text", "seconds"), [
    ("2s", 2.0), ("500ms", 0.5), ("1m30s", 90.0), ("1h", 3600.0), ("1.5s", 1.5),
    ("250us", 0.00025), ("0", 0.0), (2_000_000_000, 2.0)])
def test_go_durations(text, seconds) -> None:
    assert rc.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "2", "s", "2 s", "two", ".s", True, 2.5])
def test_not_go_durations(text) -> None:
    with pytest.raises(ValueError):
        rc.parse_duration(text)


def test_a_malformed_registration_record_is_a_warning_naming_it(tmp_path, capsys) -> None:
    """A state file that `run` could not have written (nri_accel.state.NriStatus: here a
    pid out of range) is said, not passed over as if no run had ever recorded one."""
    state = tmp_path / "state"
    state.mkdir()
    (state / NRI_STATUS_FILE).write_text('{"pid": 1e999}')
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{state}"\n[policy]\nmode = "standalone"\n')
    main(["check", "--config", str(cfg), "--socket", str(tmp_path / "none.sock"),
          "--inventory", str(Path(__file__).parent / "golden" / "discover" / "h100.json")])
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if NRI_STATUS_FILE in ln]
    assert line.startswith("warn: ") and "exists but is not a valid record" in line
