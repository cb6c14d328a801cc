"""The NRI plugin stub: everything between a plugin object and the runtime's socket.

Owns: plugin identity (name, two-digit index), the event mask, registration,
Configure, (split) Synchronize, dispatch of lifecycle events to the plugin's
handlers, the runtime's settings learnt from Configure, the external-mode reconnect
loop with bounded backoff and the pre-registered (inherited fd) mode. Imports
asyncio, the standard library, msgspec, protobuf, nri_accel.ttrpc, nri_accel.log,
nri_accel.errors, nri_accel.config (the default socket) and this package's mux and
nri_pb2.

A plugin is any object; the stub looks for these optional methods (plain or async;
the stub calls them on the event loop, so plain ones must be quick and do no I/O; a
plain one is answered inline, as its request is read, without a task or a loop
iteration, which is the fastest way through):

    configure(config, runtime_name, runtime_version) -> int | None   (event mask)
    synchronize(pods, containers) -> list[ContainerUpdate] | None
    keep_synchronized(pods, containers) -> (pods, containers)
           (plain; or a generator of steps returning the pair: see run_steps())
    shutdown() -> None
    run_pod_sandbox(pod), stop_pod_sandbox(pod), remove_pod_sandbox(pod),
    post_update_pod_sandbox(pod), update_pod_sandbox(pod, overhead, resources)
    create_container(pod, container)
        -> ContainerAdjustment | (ContainerAdjustment, [ContainerUpdate]) | None
           (the adjustment as a message, or already encoded: bytes)
    update_container(pod, container, resources) -> list[ContainerUpdate] | None
    stop_container(pod, container) -> list[ContainerUpdate] | None
    post_create_container, start_container, post_start_container,
    post_update_container, remove_container (pod, container) -> None
    validate_container_adjustment(request) -> None   (raise to reject)
    state_change(event, pod, container) -> None

A Synchronize may come in several parts (a runtime splits one over the 4 MiB message
limit); the stub gathers them and calls synchronize() once, with every pod and container.
keep_synchronized(), where defined, is called on each part as it arrives, the part
decoded a run of its fields at a time (nri.fields.runs) and each run's pods and
containers handed over SYNC_SLICE at a time, with the event loop free in between, and
what it returns is what the stub keeps and hands to synchronize() in place of the
messages: a plugin that needs little of tens of thousands of containers keeps just
that.

Arguments and results are nri_pb2 messages (build them with nri.adjust and read
them with nri.convert). A plugin that reads little of a large request may say so
with a `request_decoders` attribute, {method: decode} ("CreateContainer",
"Synchronize", "StopContainer", ...), each a function of the request's bytes returning
a message (raising protobuf's DecodeError): a view, one of nri_views_pb2's, which
declares only the fields the plugin reads, and the handlers get its parts (the fields
it leaves out are skipped undecoded: most of a container, 40 % of a typical create's
decoding time and three quarters of a Synchronize's), or an object with the same
attributes (nri.convert's large CreateContainer: its pod and container undecoded, for
the handler to decode a run of fields at a time). nri.convert.REQUEST_DECODERS are
such functions. A CreateContainer decoder may also answer a request itself: where it
returns bytes, they are the CreateContainerResponse, sent as they are, and
create_container() is not called (nri.convert.glance_decoder() answers so a container
that asks for nothing, the most of a node's).

The event mask sent in ConfigureResponse has a bit for each event handler the plugin
defines; `state_change` stands in for the pure notifications (pod run/stop/remove/
post-update, container post-create, start, post-start, post-update, remove) that have
no handler of their own, whether they come as their own call or as the older
StateChange call. The mask is never 0: the
runtime reads 0 as "every event", which would make the plugin an adjustment
validator. An exception in a handler becomes an error answer carrying its text (a
refused container fails with that message); the stub keeps serving.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import signal
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping
from typing import Any, NoReturn, TypeVar

from google.protobuf.message import DecodeError
from msgspec import Struct

from nri_accel.errors import ConfigError
from nri_accel.files import file_kind
from nri_accel.log import get_logger
from nri_accel.nri import DEFAULT_SOCKET
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.fields import runs
from nri_accel.nri.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, MuxError, MuxProtocol
from nri_accel.ttrpc import CallContext, Code, Endpoint, TtrpcError

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
NRI_VERSION = "v0.12.0"
"""The NRI API release this stub implements, sent in RegisterPluginRequest."""

ENV_PLUGIN_NAME = "NRI_PLUGIN_NAME"
ENV_PLUGIN_IDX = "NRI_PLUGIN_IDX"
ENV_PLUGIN_SOCKET = "NRI_PLUGIN_SOCKET"

SYNC_SLICE = 250
"""Pods or containers of a Synchronize part handed to keep_synchronized() at once: a
few milliseconds of work, then the event loop runs."""

DEFAULT_REGISTRATION_TIMEOUT = 5.0  # seconds, until Configure says otherwise
DEFAULT_REQUEST_TIMEOUT = 2.0
BACKOFF_MIN = 0.05
BACKOFF_MAX = 1.0  # a restarted runtime sees the plugin back within about a second
LINGER = 0.25
"""Seconds a stopping plugin keeps its socket open after its last answer, taking no
new request, unless the runtime closes first: the runtime must read an answer before
it sees the connection end. Its NRI multiplexer (nri pkg/net/multiplex) hands a
connection's frames and its close to the ttrpc client through two channels that one
Go select reads, picking at random among the ready ones, so a plugin that closed right
after answering could have the runtime fail that call ("ttrpc: closed"): a container
created as SIGTERM came would fail, a check's Synchronize would be logged as an error.
Reading a queued frame takes the runtime microseconds; a quarter second covers a loaded
node. A plugin that answered nothing for that long closes at once."""

Answer = bytes | Awaitable[bytes]
"""What a Plugin service method returns: its response payload, or an awaitable of it
when the plugin's handler is async (see ttrpc Endpoint)."""

_NAME_RE = re.compile(r"[A-Za-z0-9_.+-]+")  # fullmatch: `$` would pass a final "\n"
_IDX_RE = re.compile(r"[0-9]{2}")

log = get_logger(__name__)
T = TypeVar("T")

E = pb.Event
VALID_EVENTS = (1 << (pb.LAST - 1)) - 1
"""Mask of every event a plugin can subscribe to."""

# Plugin method -> the event it subscribes to. Order: the Event enum's.
_EVENT_HANDLERS: tuple[tuple[str, int], ...] = (
    ("run_pod_sandbox", E.RUN_POD_SANDBOX),
    ("stop_pod_sandbox", E.STOP_POD_SANDBOX),
    ("remove_pod_sandbox", E.REMOVE_POD_SANDBOX),
    ("create_container", E.CREATE_CONTAINER),
    ("post_create_container", E.POST_CREATE_CONTAINER),
    ("start_container", E.START_CONTAINER),
    ("post_start_container", E.POST_START_CONTAINER),
    ("update_container", E.UPDATE_CONTAINER),
    ("post_update_container", E.POST_UPDATE_CONTAINER),
    ("stop_container", E.STOP_CONTAINER),
    ("remove_container", E.REMOVE_CONTAINER),
    ("update_pod_sandbox", E.UPDATE_POD_SANDBOX),
    ("post_update_pod_sandbox", E.POST_UPDATE_POD_SANDBOX),
    ("validate_container_adjustment", E.VALIDATE_CONTAINER_ADJUSTMENT),
)

# Events that are pure notifications: what `state_change` may stand in for.
NOTIFICATIONS = frozenset({
    E.RUN_POD_SANDBOX, E.STOP_POD_SANDBOX, E.REMOVE_POD_SANDBOX, E.POST_UPDATE_POD_SANDBOX,
    E.POST_CREATE_CONTAINER, E.START_CONTAINER, E.POST_START_CONTAINER,
    E.POST_UPDATE_CONTAINER, E.REMOVE_CONTAINER,
})


class StubConfigError(ConfigError):
    """An invalid plugin identity, inherited fd or plugin object; `source` names the
    flag, variable or setting it came from. A ConfigError: the command fails with
    exit status 2 and the message."""

    def __init__(self, message: str, *, source: str) -> None:
        super().__init__(message, source=source)


def event_bit(event: int) -> int:
    return 1 << (event - 1)


def mask_events(mask: int) -> tuple[str, ...]:
    """Names of the events set in `mask` (for logs)."""
    return tuple(pb.Event.Name(e) for e in range(1, pb.LAST) if mask & event_bit(e))


class Identity(Struct, frozen=True):
    """The name and two-digit index a plugin registers with."""

    name: str
    idx: str

    @property
    def full_name(self) -> str:
        return f"{self.idx}-{self.name}"


def resolve_identity(
    name: str | None = None,
    idx: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    argv0: str | None = None,
    default_name: str = "",
    default_idx: str = "",
) -> Identity:
    """Name and index: from the arguments, else env NRI_PLUGIN_NAME / NRI_PLUGIN_IDX,
    else an argv[0] of the form NN-name, else the defaults (each part on its own).

    Raises StubConfigError naming the source of an invalid value.
    """
    env = os.environ if env is None else env
    base = os.path.basename(argv0 or "")
    m = re.match(r"^([0-9]{2})-(.+)$", base)
    from_argv = (m.group(2), m.group(1)) if m else (None, None)
    chosen_name, name_src = _first(
        (name, "--name"), (env.get(ENV_PLUGIN_NAME), ENV_PLUGIN_NAME),
        (from_argv[0], "argv[0]"), (default_name, "nri.name"),
    )
    chosen_idx, idx_src = _first(
        (idx, "--idx"), (env.get(ENV_PLUGIN_IDX), ENV_PLUGIN_IDX),
        (from_argv[1], "argv[0]"), (default_idx, "nri.idx"),
    )
    if not chosen_name or not _NAME_RE.fullmatch(chosen_name):
        raise StubConfigError(f"invalid plugin name {chosen_name!r}: use letters, digits and _.+-",
                          source=name_src)
    if not chosen_idx or not _IDX_RE.fullmatch(chosen_idx):
        raise StubConfigError(f"invalid plugin index {chosen_idx!r}: two digits such as \"40\"",
                          source=idx_src)
    return Identity(chosen_name, chosen_idx)


def _first(*candidates: tuple[str | None, str]) -> tuple[str, str]:
    for value, source in candidates:
        if value:
            return value, source
    return "", candidates[-1][1]


class RuntimeInfo(Struct, frozen=True):
    """What the runtime told the plugin in Configure."""

    name: str = ""
    version: str = ""
    nri_version: str = ""
    registration_timeout: float = DEFAULT_REGISTRATION_TIMEOUT  # seconds
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT


class Stub:
    """Connects a plugin object to an NRI runtime and keeps it connected.

    run() serves until stop() (or SIGTERM/SIGINT when install_signal_handlers() was
    called). External mode: connect to `socket_path`; whenever the runtime is absent
    or goes away, retry with exponential backoff (BACKOFF_MIN .. BACKOFF_MAX) and
    register again, logging one runtime_unavailable line per outage; never returns on
    its own. `last_failure` says why the latest try failed to register (the peer
    closed the connection, sent bytes that are not NRI, refused, did not answer).
    Pre-registered mode (`fd` given, or env NRI_PLUGIN_SOCKET, checked by
    inherited_fd()): use that inherited socket and return when it closes. The
    runtime launches /opt/nri/plugins/NN-name once, when it starts (pkg/adaptation
    startPlugins), with only NRI_PLUGIN_NAME, NRI_PLUGIN_IDX and NRI_PLUGIN_SOCKET=3
    in the environment, no arguments and stdio on /dev/null; it never relaunches a
    plugin that exits, and SIGKILLs the ones it dropped or that it stops with.
    """

    def __init__(
        self,
        plugin: object,
        identity: Identity,
        *,
        socket_path: str = DEFAULT_SOCKET,
        fd: int | None = None,
    ) -> None:
        self.plugin = plugin
        self.identity = identity
        self.socket_path = socket_path
        self.fd = fd
        self.runtime = RuntimeInfo()
        self.events = 0  # mask the runtime was sent, once configured
        self.registrations = 0  # successful registrations so far
        self.last_failure = ""  # why the latest connection failed to register ("": none)
        self._handlers = _find_handlers(plugin)
        self._decoders: Mapping[str, Callable[[bytes], Any]] = getattr(
            plugin, "request_decoders", {})
        self._create_handler = self._handlers.get("create_container")
        self._create_decode = (self._decoders.get("CreateContainer")
                               or pb.CreateContainerRequest.FromString)
        self.handled_events = _handled_mask(self._handlers)
        if not self.handled_events:
            raise StubConfigError(
                f"{type(plugin).__name__} defines no event handler "
                f"({', '.join(m for m, _ in _EVENT_HANDLERS)} or state_change)",
                source="plugin",
            )
        self._sync_pods: list[Any] = []
        self._sync_containers: list[Any] = []
        self._sync_listed = (0, 0)  # pods, containers the runtime listed so far
        self._configured: asyncio.Future[None] | None = None
        self._serving: asyncio.Task[int] | None = None  # run()'s work, while it runs
        self._stop_requested = False
        self.registered = asyncio.Event()  # set while registered and configured

    # ---- lifecycle -------------------------------------------------------------------

    @classmethod
    def inherited_fd(cls, env: Mapping[str, str] | None = None) -> int | None:
        """The fd of a pre-registered launch (env NRI_PLUGIN_SOCKET), else None.

        Checked before anything uses it: a number, an open fd, a connected unix stream
        socket (the runtime hands over one end of a socketpair). Anything else raises
        StubConfigError saying what the fd is instead."""
        value = (os.environ if env is None else env).get(ENV_PLUGIN_SOCKET, "")
        if not value:
            return None
        if not (value.isascii() and value.isdigit()):
            raise StubConfigError(f"not a file descriptor number: {value!r}",
                                  source=ENV_PLUGIN_SOCKET)
        fd = int(value)
        why = _not_a_runtime_connection(fd)
        if why:
            raise StubConfigError(f"fd {fd} {why}: the container runtime launches a "
                                  "pre-registered plugin with its NRI connection there",
                                  source=ENV_PLUGIN_SOCKET)
        return fd

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop run() cleanly (it then returns 0); SIGUSR1 logs the
        process's state (log_state)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, sig)
        loop.add_signal_handler(signal.SIGUSR1, self.log_state)

    def log_state(self) -> None:
        """Log one `stub_state` line: the asyncio tasks of the process (a task leak
        shows here: tests/soak samples it from outside with SIGUSR1), whether it is
        registered, and the registrations so far."""
        log.info("stub_state", tasks=len(asyncio.all_tasks()),
                 registered=self.registered.is_set(), registrations=self.registrations)

    def stop(self, sig: int | None = None) -> None:
        """Make run() return 0 within LINGER seconds, whatever the connection is doing.

        The serving task is cancelled wherever it waits (connecting, a RegisterPlugin
        answer, Configure, the next event, a backoff delay); the socket then takes no new
        request, stays open until LINGER seconds after the last answer (at once if that
        is past, or when the runtime closes), and is aborted, not drained: a runtime
        that stopped reading cannot hold the plugin up longer."""
        if sig is not None:
            log.info("signal_received", signal=signal.Signals(sig).name)
        if self._stop_requested:
            return
        self._stop_requested = True
        if self._serving is not None:
            self._serving.cancel()

    async def run(self) -> int:
        """Serve until stopped (0). Pre-registered mode: until the socket closes
        (0), or 1 if registration failed."""
        if self._stop_requested:
            return 0
        loop = asyncio.get_running_loop()
        log.info("plugin_starting", plugin=self.identity.full_name,
                 events=mask_events(self.handled_events),
                 mode="pre-registered" if self.fd is not None else "external",
                 socket=self.socket_path if self.fd is None else f"fd {self.fd}",
                 event_loop=type(loop).__module__.partition(".")[0])  # uvloop, asyncio
        self._serving = loop.create_task(self._serve())
        try:
            return await self._serving
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            if not self._stop_requested or (caller is not None and caller.cancelling()):
                raise  # cancelled from outside, not by stop()
            return 0
        finally:
            self._serving = None

    async def _serve(self) -> int:
        if self.fd is None:
            await self._reconnect_loop()
        try:
            await self._session(sock=socket.socket(fileno=self.fd))
        except (OSError, TtrpcError, TimeoutError) as exc:
            self.last_failure = _describe(exc)
            log.error("registration_failed", error=self.last_failure)
            return 1
        return 0

    async def _reconnect_loop(self) -> NoReturn:
        """Connect and register, again and again. One line per outage, not one per
        retry, whatever each retry's error (a listener that accepts and closes gives
        "Broken pipe" and "Connection reset" by turns): runtime_unavailable with the
        first error; the outage ends with the next `registered` line."""
        delays = backoff_delays()
        reported = False
        while True:
            try:
                await self._session(path=self.socket_path)
            except (OSError, TtrpcError, TimeoutError) as exc:
                why = self.last_failure = _describe(exc)
                if not reported:
                    log.warning("runtime_unavailable", socket=self.socket_path, error=why,
                                retry_max_s=BACKOFF_MAX)
                    reported = True
                else:
                    log.debug("runtime_still_unavailable", socket=self.socket_path, error=why)
            else:  # it registered and served until the runtime went away
                delays, reported = backoff_delays(), False
            await asyncio.sleep(next(delays))

    async def _session(self, *, path: str | None = None, sock: socket.socket | None = None) -> None:
        """One connection: register, then serve until the runtime closes it.

        Raises OSError/TtrpcError/TimeoutError when connecting or registering fails.
        Whatever way it ends (cancellation by stop() included), the socket is aborted
        and the handlers still running have finished when it returns.
        """
        loop = asyncio.get_running_loop()
        mux = MuxProtocol(serving=True)
        plugin_ep = Endpoint(mux.sender(PLUGIN_SERVICE_CONN),
                             {PLUGIN_SERVICE: self._services()}, on_close=mux.close)
        runtime_ep = Endpoint(mux.sender(RUNTIME_SERVICE_CONN), on_close=mux.close)
        # Serve conn 1 before registering: Configure may arrive before our call returns.
        mux.attach(PLUGIN_SERVICE_CONN, plugin_ep.data_received, plugin_ep.connection_lost)
        mux.attach(RUNTIME_SERVICE_CONN, runtime_ep.data_received, runtime_ep.connection_lost)
        self._configured = loop.create_future()
        self._sync_pods, self._sync_containers, self._sync_listed = [], [], (0, 0)
        if sock is not None:
            await loop.create_unix_connection(lambda: mux, sock=sock)
        else:
            await loop.create_unix_connection(lambda: mux, path)
        try:
            try:
                await self._register(runtime_ep, mux)
            except TtrpcError as exc:  # UNAVAILABLE when the socket ended: say how
                if exc.code != Code.UNAVAILABLE or not mux.lost.done():
                    raise
                raise _lost(mux.lost.result(), "before answering RegisterPlugin") from exc
            self.registrations += 1
            self.last_failure = ""
            self.registered.set()
            log.info("registered", plugin=self.identity.full_name, runtime=self.runtime.name,
                     runtime_version=self.runtime.version,
                     # older runtimes (containerd 1.7) do not send their NRI version
                     nri_version=self.runtime.nri_version or "not sent",
                     events=mask_events(self.events))
            # shielded: stop() cancels this task, and _linger() still waits on `lost`
            error = await asyncio.shield(mux.lost)
            if isinstance(error, MuxError):  # the mux's own line is at debug
                log.error("runtime_disconnected", plugin=self.identity.full_name,
                          error=str(_lost(error, "while registered")))
            else:
                log.warning("runtime_disconnected", plugin=self.identity.full_name,
                            error=_describe(error) if error else None)
        finally:
            self.registered.clear()
            if self._configured.done() and not self._configured.cancelled():
                self._configured.exception()  # retrieved: it was reported through the call
            try:
                if self._stop_requested:
                    await _linger(mux)
            finally:  # a second cancellation ends the linger, never the close
                mux.close()
            # connection_lost comes on the next loop iteration and cancels running
            # handlers: wait for them, so that nothing of this session outlives it.
            await plugin_ep.closed()
            await runtime_ep.closed()

    async def _register(self, runtime_ep: Endpoint, mux: MuxProtocol) -> None:
        req = pb.RegisterPluginRequest(plugin_name=self.identity.name,
                                       plugin_idx=self.identity.idx, NRI_version=NRI_VERSION)
        timeout = self.runtime.registration_timeout  # the runtime's, once it told us
        started = time.monotonic()
        await runtime_ep.call(RUNTIME_SERVICE, "RegisterPlugin", req.SerializeToString(),
                              timeout=timeout)
        assert self._configured is not None
        left = max(0.001, timeout - (time.monotonic() - started))
        done, _ = await asyncio.wait((self._configured, mux.lost), timeout=left,
                                     return_when=asyncio.FIRST_COMPLETED)
        if self._configured in done:
            self._configured.result()
            return
        if mux.lost in done:
            raise _lost(mux.lost.result(), "before Configure")
        raise TimeoutError(f"no Configure from the runtime within {timeout:g} s of registering")

    # ---- the Plugin service ---------------------------------------------------------

    def _services(self) -> dict[str, Callable[[CallContext, bytes], Any]]:
        services: dict[str, Callable[[CallContext, bytes], Any]] = {
            "Configure": self._configure,
            "Synchronize": self._synchronize,
            "Shutdown": self._shutdown,
            "StateChange": self._state_change,
            "CreateContainer": self._create_container,
            "UpdateContainer": self._update_container,
            "StopContainer": self._stop_container,
            "UpdatePodSandbox": self._update_pod_sandbox,
            "ValidateContainerAdjustment": self._validate,
        }
        for method, req_type, event, with_container in _NOTIFY_RPCS:
            services[method] = self._notify_rpc(method, req_type, event, with_container)
        return services

    async def _configure(self, ctx: CallContext, payload: bytes) -> bytes:
        req = _parse(pb.ConfigureRequest, payload)
        self.runtime = RuntimeInfo(
            name=req.runtime_name, version=req.runtime_version, nri_version=req.NRI_version,
            registration_timeout=(req.registration_timeout / 1000
                                  or DEFAULT_REGISTRATION_TIMEOUT),
            request_timeout=req.request_timeout / 1000 or DEFAULT_REQUEST_TIMEOUT,
        )
        mask = self.handled_events
        handler = self._handlers.get("configure")
        try:
            if handler is not None:
                wanted = await _invoke(handler, req.config, req.runtime_name,
                                       req.runtime_version)
                if wanted:
                    extra = wanted & ~self.handled_events
                    if extra:
                        raise ValueError(f"plugin subscribed to events it does not handle: "
                                         f"{', '.join(mask_events(extra))}")
                    mask = wanted
        except Exception as exc:
            error = _as_ttrpc_error(exc, "Configure")
            self._fail_configured(error)
            raise error from exc
        self.events = mask
        if self._configured is not None and not self._configured.done():
            self._configured.set_result(None)
        return pb.ConfigureResponse(events=mask).SerializeToString()

    def _fail_configured(self, exc: TtrpcError) -> None:
        if self._configured is not None and not self._configured.done():
            self._configured.set_exception(exc)

    def _synchronize(self, ctx: CallContext, payload: bytes) -> Answer:
        handler = self._handlers.get("synchronize")
        decode = self._decoders.get("Synchronize")
        keep = self._handlers.get("keep_synchronized")
        if handler is not None and keep is not None:
            return self._keep_part(payload, decode, keep, handler)
        req = _parse(pb.SynchronizeRequest, payload, decode)
        if handler is None:
            return pb.SynchronizeResponse(more=req.more).SerializeToString()
        self._sync_listed = (self._sync_listed[0] + len(req.pods),
                             self._sync_listed[1] + len(req.containers))
        self._sync_pods.extend(req.pods)
        self._sync_containers.extend(req.containers)
        return self._part_done(handler, req.more)

    async def _keep_part(self, payload: bytes, decode: Callable[[bytes], Any] | None,
                         keep: Callable[..., Any], handler: Callable[..., Any]) -> bytes:
        """keep_synchronized() over the part `payload`, the event loop free in between
        its steps: the part decoded a run of fields at a time (fields.runs: RUN_FIELDS
        pods or containers, or RUN_BYTES; protobuf builds a message at 60 ns, and 4 MiB
        lists tens of thousands), and each run's pods and containers handed over
        SYNC_SLICE at a time. The runs read as the whole part: their pods and containers
        in order, `more` from the last run that holds it (see _holds_more). What is
        kept of a part is taken only once all of it has decoded."""
        pods: list[Any] = []
        containers: list[Any] = []
        listed, more = (0, 0), False
        try:
            for run in runs(payload):
                req = _parse(pb.SynchronizeRequest, run, decode)
                if _holds_more(req):
                    more = req.more
                listed = (listed[0] + len(req.pods), listed[1] + len(req.containers))
                for start in range(0, len(req.pods), SYNC_SLICE):
                    pods += (await _kept(keep(req.pods[start:start + SYNC_SLICE], [])))[0]
                for start in range(0, len(req.containers), SYNC_SLICE):
                    containers += (await _kept(
                        keep([], req.containers[start:start + SYNC_SLICE])))[1]
                await asyncio.sleep(0)
        except DecodeError as exc:  # from runs(); a run's own decoding raised TtrpcError
            raise malformed(pb.SynchronizeRequest.DESCRIPTOR.name, exc) from exc
        self._sync_pods += pods
        self._sync_containers += containers
        self._sync_listed = (self._sync_listed[0] + listed[0],
                             self._sync_listed[1] + listed[1])
        if more:
            log.debug("sync_chunk", pods=listed[0], containers=listed[1])
        answer = self._part_done(handler, more)
        return answer if isinstance(answer, bytes) else await answer

    def _part_done(self, handler: Callable[..., Any], more: bool) -> Answer:
        """The answer to a Synchronize part: "more" to all but the last; to the last,
        synchronize() over everything gathered."""
        if more:
            return pb.SynchronizeResponse(more=True).SerializeToString()
        pods, containers = self._sync_pods, self._sync_containers
        (listed_pods, listed_containers), self._sync_listed = self._sync_listed, (0, 0)
        self._sync_pods, self._sync_containers = [], []

        def answer(updates: Any) -> bytes:
            log.info("synchronized", pods=listed_pods, containers=listed_containers)
            return pb.SynchronizeResponse(update=updates or ()).SerializeToString()

        return _call(handler, "Synchronize", (pods, containers), answer)

    def _shutdown(self, ctx: CallContext, payload: bytes) -> Answer:
        log.info("runtime_shutting_down")
        handler = self._handlers.get("shutdown")
        if handler is None:
            return b""
        return _call(handler, "Shutdown", (), _no_answer)

    def _create_container(self, ctx: CallContext, payload: bytes) -> Answer:
        # Every container created comes this way: its handler and decoder were looked
        # up once (__init__), and _parse() is inline.
        handler = self._create_handler
        if handler is None:
            return b""
        try:
            req = self._create_decode(payload)
        except DecodeError as exc:
            raise malformed("CreateContainerRequest", exc) from exc
        if req.__class__ is bytes:  # the decoder answered it (see the module docstring)
            return req
        return _call(handler, "CreateContainer", (req.pod, req.container), _created)

    def _update_container(self, ctx: CallContext, payload: bytes) -> Answer:
        handler = self._handlers.get("update_container")
        if handler is None:
            return b""
        req = _parse(pb.UpdateContainerRequest, payload)
        return _call(handler, "UpdateContainer",
                     (req.pod, req.container, req.linux_resources), _container_updated)

    def _stop_container(self, ctx: CallContext, payload: bytes) -> Answer:
        handler = self._handlers.get("stop_container")
        if handler is None:
            return b""
        req = _parse(pb.StopContainerRequest, payload, self._decoders.get("StopContainer"))
        return _call(handler, "StopContainer", (req.pod, req.container), _container_stopped)

    def _update_pod_sandbox(self, ctx: CallContext, payload: bytes) -> Answer:
        handler = self._handlers.get("update_pod_sandbox")
        if handler is None:
            return b""
        req = _parse(pb.UpdatePodSandboxRequest, payload)
        return _call(handler, "UpdatePodSandbox",
                     (req.pod, req.overhead_linux_resources, req.linux_resources), _no_answer)

    async def _validate(self, ctx: CallContext, payload: bytes) -> bytes:
        handler = self._handlers.get("validate_container_adjustment")
        if handler is None:
            return b""
        req = _parse(pb.ValidateContainerAdjustmentRequest, payload)
        try:
            await _invoke(handler, req)
        except Exception as exc:
            return pb.ValidateContainerAdjustmentResponse(
                reject=True, reason=str(exc) or type(exc).__name__).SerializeToString()
        return b""

    def _notify_rpc(self, method: str, req_type: Any, event: int,
                    with_container: bool) -> Any:
        name = _handler_name(event)
        decode = self._decoders.get(method)

        def serve(ctx: CallContext, payload: bytes) -> Answer:
            req = _parse(req_type, payload, decode)
            args = (req.pod, req.container) if with_container else (req.pod,)
            return self._notify(event, name, args)

        return serve

    def _state_change(self, ctx: CallContext, payload: bytes) -> Answer:
        evt = _parse(pb.StateChangeEvent, payload, self._decoders.get("StateChange"))
        if evt.event not in NOTIFICATIONS:
            log.debug("state_change_ignored", event=evt.event)
            return b""
        container_event = evt.event not in _POD_EVENTS
        args = (evt.pod, evt.container) if container_event else (evt.pod,)
        return self._notify(evt.event, _handler_name(evt.event), args)

    def _notify(self, event: int, name: str, args: tuple[Any, ...]) -> Answer:
        handler = self._handlers.get(name)
        if handler is not None:
            return _call(handler, name, args, _no_answer)
        fallback = self._handlers.get("state_change")
        if fallback is None:
            return b""
        pod = args[0]
        container = args[1] if len(args) > 1 else None
        return _call(fallback, "StateChange", (event, pod, container), _no_answer)


_POD_EVENTS = frozenset({E.RUN_POD_SANDBOX, E.STOP_POD_SANDBOX, E.REMOVE_POD_SANDBOX,
                         E.POST_UPDATE_POD_SANDBOX})

# (method, request type, event, carries a container): the notifications' own RPCs
_NOTIFY_RPCS = (
    ("RunPodSandbox", pb.RunPodSandboxRequest, E.RUN_POD_SANDBOX, False),
    ("StopPodSandbox", pb.StopPodSandboxRequest, E.STOP_POD_SANDBOX, False),
    ("RemovePodSandbox", pb.RemovePodSandboxRequest, E.REMOVE_POD_SANDBOX, False),
    ("PostUpdatePodSandbox", pb.PostUpdatePodSandboxRequest, E.POST_UPDATE_POD_SANDBOX, False),
    ("PostCreateContainer", pb.PostCreateContainerRequest, E.POST_CREATE_CONTAINER, True),
    ("StartContainer", pb.StartContainerRequest, E.START_CONTAINER, True),
    ("PostStartContainer", pb.PostStartContainerRequest, E.POST_START_CONTAINER, True),
    ("PostUpdateContainer", pb.PostUpdateContainerRequest, E.POST_UPDATE_CONTAINER, True),
    ("RemoveContainer", pb.RemoveContainerRequest, E.REMOVE_CONTAINER, True),
)


def _parse(message_type: Any, payload: bytes,
           decode: Callable[[bytes], Any] | None = None) -> Any:
    """Decode a request payload of `message_type` (with `decode`: as that returns it);
    an undecodable one is the caller's error."""
    try:
        return (decode or message_type.FromString)(payload)
    except DecodeError as exc:
        raise malformed(message_type.DESCRIPTOR.name, exc) from exc


def malformed(message: str, exc: DecodeError) -> TtrpcError:
    """The answer to a request (`message`: its message's name) whose bytes do not decode,
    the caller's error: also that of a plugin that decodes part of a request itself."""
    return TtrpcError(Code.INVALID_ARGUMENT, f"malformed {message}: {exc}")


def backoff_delays(first: float = BACKOFF_MIN, cap: float = BACKOFF_MAX) -> Iterator[float]:
    """Waits between reconnection attempts: doubling from `first`, never above `cap`."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, cap)


def _handler_name(event: int) -> str:
    for name, ev in _EVENT_HANDLERS:
        if ev == event:
            return name
    raise KeyError(event)


def _find_handlers(plugin: object) -> dict[str, Callable[..., Any]]:
    names = [n for n, _ in _EVENT_HANDLERS] + [
        "configure", "synchronize", "keep_synchronized", "shutdown", "state_change"]
    found = {}
    for name in names:
        fn = getattr(plugin, name, None)
        if callable(fn):
            found[name] = fn
    return found


def _handled_mask(handlers: Mapping[str, Any]) -> int:
    mask = 0
    for name, event in _EVENT_HANDLERS:
        if name in handlers:
            mask |= event_bit(event)
    if "state_change" in handlers:
        for event in NOTIFICATIONS:
            mask |= event_bit(event)
    return mask


def _holds_more(req: Any) -> bool:
    """Whether a run of a Synchronize part's fields holds `more`: where the message
    declares it optional (nri.convert's views), whether it is there; else (nri_pb2's
    proto3 bool) whether it is true, the only value a runtime writes (protobuf's
    encoders leave out a false one)."""
    try:
        return bool(req.HasField("more"))
    except ValueError:  # no presence
        return bool(req.more)


async def run_steps(steps: Generator[None, None, T]) -> T:
    """The value of a generator of steps (one of nri.convert's readers of a large
    request), run with the event loop given a turn before each step."""
    while True:
        await asyncio.sleep(0)
        try:
            next(steps)
        except StopIteration as done:
            return done.value


async def _kept(kept: Any) -> tuple[Any, Any]:
    """What keep_synchronized() returned, run to its value if it is a generator of
    steps; the event loop has had a turn since."""
    if inspect.isgenerator(kept):
        return await run_steps(kept)
    await asyncio.sleep(0)
    return kept


async def _linger(mux: MuxProtocol) -> None:
    """Before a stopping plugin closes `mux`: if it answered a call within LINGER
    seconds, take no new request and leave the runtime the rest of LINGER to read the
    answer, or to close first. (A request of its own, RegisterPlugin, fails all the same
    when it closes: nothing to wait for.)"""
    answered = mux.sent_at.get(PLUGIN_SERVICE_CONN)
    wait = 0.0 if answered is None else answered + LINGER - time.monotonic()
    if wait > 0 and not mux.lost.done():
        mux.drop_incoming()
        await asyncio.wait((mux.lost,), timeout=wait)


async def _invoke(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def _call(fn: Callable[..., Any], what: str, args: tuple[Any, ...],
          then: Callable[[Any], bytes]) -> Answer:
    """Answer `then(fn(*args))`: at once when the plugin handler `fn` is a plain function
    (the Endpoint writes it without a task or a loop iteration), as a coroutine when
    it is async. Its exception becomes a TtrpcError with its message."""
    try:
        value = fn(*args)
        if value is not None and inspect.isawaitable(value):  # None: most answers
            return _finish(value, what, then)
    except TtrpcError:
        raise
    except Exception as exc:
        raise _as_ttrpc_error(exc, what) from exc
    return then(value)


async def _finish(pending: Awaitable[Any], what: str, then: Callable[[Any], bytes]) -> bytes:
    """The async half of _call."""
    try:
        value = await pending
    except TtrpcError:
        raise
    except Exception as exc:
        raise _as_ttrpc_error(exc, what) from exc
    return then(value)


def _no_answer(value: object) -> bytes:
    return b""


def _created(result: Any) -> bytes:
    """The CreateContainerResponse of a create_container result."""
    if result is None:
        return b""
    adjust, updates = result if isinstance(result, tuple) else (result, ())
    if isinstance(adjust, bytes):
        # An encoded adjustment is the response's field 1 as it is: the bytes the
        # message would encode to, without decoding what was built once to encode it
        # again (a fifth of a 1-GPU create's time in the daemon).
        head = length_delimited(_RESPONSE_ADJUST, adjust)
        if not updates:
            return head
        rest = pb.CreateContainerResponse(update=updates)
        return head + rest.SerializeToString(deterministic=True)
    resp = pb.CreateContainerResponse(adjust=adjust, update=updates or ())
    return resp.SerializeToString(deterministic=True)


_RESPONSE_ADJUST = 1  # CreateContainerResponse.adjust's field number


def length_delimited(number: int, data: bytes) -> bytes:
    """`data` as the length-delimited field `number` of a message (tag, varint length),
    as protobuf encodes an embedded message or a bytes field."""
    head = bytearray([number << 3 | 2])
    n = len(data)
    while n > 0x7F:
        head.append(n & 0x7F | 0x80)
        n >>= 7
    head.append(n)
    return bytes(head) + data


def _container_updated(updates: Any) -> bytes:
    return pb.UpdateContainerResponse(update=updates or ()).SerializeToString()


def _container_stopped(updates: Any) -> bytes:
    return pb.StopContainerResponse(update=updates or ()).SerializeToString()


def _as_ttrpc_error(exc: Exception, what: str) -> TtrpcError:
    """The error answer for a handler's exception. A refusal says what kind it is in its
    `status` attribute (a ttrpc Code name): the runtime quotes that code ("rpc error:
    code = ... desc = ...") in the error kubelet shows. An exception without one is a
    bug, not a refusal: answered UNKNOWN and logged with its traceback."""
    code = Code.__members__.get(getattr(exc, "status", None) or "")
    if code is None:
        log.error("handler_failed", rpc=what, exc_info=exc)
        code = Code.UNKNOWN
    return TtrpcError(code, str(exc) or type(exc).__name__)


def _lost(error: Exception | None, when: str) -> ConnectionError:
    """The error of a connection that ended `when` (before registering completed, or
    while registered), saying what the peer did: sent bytes that break NRI's framing
    (the multiplexer's: what listens there is not an NRI runtime), or closed it."""
    if isinstance(error, MuxError):
        return ConnectionAbortedError(
            f"the peer sent bytes that are not NRI ({error}) {when}")
    how = f" ({_describe(error)})" if error is not None else ""
    return ConnectionResetError(f"the peer closed the connection {when}{how}")


def _not_a_runtime_connection(fd: int) -> str:
    """What keeps `fd` from being the runtime's connection ("" when nothing does)."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        return f"is not open ({e.strerror})"
    if not stat.S_ISSOCK(mode):
        return f"is {file_kind(mode)}, not a socket"
    sock = socket.socket(fileno=fd)  # reads the fd's family and type; detached below
    try:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            family, kind = (getattr(v, "name", v) for v in (sock.family, sock.type))
            return f"is a {family} {kind} socket, not a unix stream socket"
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return "is a listening socket, not a connection"
        try:
            sock.getpeername()
        except OSError as e:
            return f"is a unix socket that is not connected ({e.strerror})"
    finally:
        sock.detach()
    return ""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TtrpcError):
        return f"{exc.code.name}: {exc.message}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
