"""Metrics and probes over real HTTP: what a scraper and kubelet's probes see.

Servers bind 127.0.0.1 port 0; tests/metrics_scrape.py stands for Prometheus and the
probes. Each test runs its own event loop (asyncio.run) and reaches the server from a
thread (asyncio.to_thread), as a real client would, so the loop keeps ticking. A fake
clock (standing for time.monotonic) lets a test say "six seconds passed" while it
holds the loop blocked, with no sleeping and no timing assertion.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from metrics_scrape import Samples, get, logged_address, scrape, wait_for
from structlog.testing import capture_logs

from nri_accel.config import parse_config
from nri_accel.errors import ConfigError
from nri_accel.inventory import KIND_GPU, Device, Inventory
from nri_accel.metrics import (
    DEVICE_PLUGIN_EVENTS,
    ERROR,
    OK,
    REFUSED,
    RUN_EVENTS,
    Address,
    RequestRecorder,
    choose_address,
    device_counts,
    parse_address,
)
from nri_accel.metrics import server as server_module
from nri_accel.metrics.server import DevicePluginMetrics, MetricsServer, RunMetrics

LOCAL = Address("127.0.0.1", 0, "--metrics-address")
MIG = "nvidia.com/mig"


def run_metrics() -> RunMetrics:
    return RunMetrics(RequestRecorder.for_events(RUN_EVENTS))


def device_plugin_metrics() -> DevicePluginMetrics:
    return DevicePluginMetrics(RequestRecorder.for_events(DEVICE_PLUGIN_EVENTS))


class FakeClock:
    """Stands for time.monotonic: moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def serve(metrics: Any, scenario: Callable[[MetricsServer, str], Awaitable[None]],
          **options: Any) -> None:
    """Run `scenario(server, "host:port")` on a fresh loop with a started server."""
    options.setdefault("ready", lambda: None)
    options.setdefault("interval", 0.01)

    async def main() -> None:
        async with MetricsServer(metrics, LOCAL, **options) as server:
            await scenario(server, str(server.address))

    asyncio.run(main())


async def aget(address: str, path: str, **kw: Any) -> Any:
    return await asyncio.to_thread(get, address, path, **kw)


# ---- /metrics -------------------------------------------------------------------------

def test_counters_and_the_histogram_move_when_requests_are_recorded() -> None:
    requests = RequestRecorder.for_events(RUN_EVENTS)  # the handlers' recorders
    metrics = RunMetrics(requests)
    create = requests["create_container"]

    async def scenario(server: MetricsServer, address: str) -> None:
        before = await asyncio.to_thread(scrape, address)
        for event in RUN_EVENTS:  # every series exists from the start, at zero
            for outcome in (OK, REFUSED, ERROR):
                assert before.value("nri_accel_requests_total", event=event,
                                    outcome=outcome) == 0
        create.record(OK, 42e-6)
        create.record(OK, 0.0004)
        create.record(REFUSED, 0.003)
        requests["stop_container"].record(ERROR, 1.5)
        after = await asyncio.to_thread(scrape, address)

        def total(event: str, outcome: str) -> float:
            return after.value("nri_accel_requests_total", event=event, outcome=outcome)

        assert (total("create_container", OK), total("create_container", REFUSED),
                total("create_container", ERROR)) == (2, 1, 0)
        assert total("stop_container", ERROR) == 1
        assert total("synchronize", OK) == 0

        def bucket(le: str, event: str = "create_container") -> float:
            return after.value("nri_accel_request_duration_seconds_bucket", event=event, le=le)

        assert [bucket(le) for le in ("1e-05", "5e-05", "0.0005", "0.0025", "0.005", "+Inf")
                ] == [0, 1, 2, 2, 3, 3]
        assert after.value("nri_accel_request_duration_seconds_count",
                           event="create_container") == 3
        assert after.value("nri_accel_request_duration_seconds_sum",
                           event="create_container") == pytest.approx(0.003442)
        assert bucket("1.0", "stop_container") == 0 and bucket("2.0", "stop_container") == 1

    serve(metrics, scenario)


@pytest.mark.parametrize("quick_first", [True, False], ids=["quick first", "locked first"])
def test_quick_records_count_as_ok_requests_in_their_buckets_and_sum(quick_first: bool) -> None:
    # record_quick() (the containers that ask for nothing, on the event loop) keeps
    # counts of its own: a scrape shows them added to record()'s, in the same series
    requests = RequestRecorder.for_events(RUN_EVENTS)
    create = requests["create_container"]

    def quick() -> None:
        for ns in (3_000, 10_000, 10_001, 2_500_000_000):  # 10 us: le="1e-05" holds it
            create.record_quick(ns)

    async def scenario(server: MetricsServer, address: str) -> None:
        if quick_first:
            quick()
        create.record(OK, 42e-6)
        create.record(REFUSED, 0.003)
        if not quick_first:
            quick()
        after = await asyncio.to_thread(scrape, address)

        def bucket(le: str) -> float:
            return after.value("nri_accel_request_duration_seconds_bucket",
                               event="create_container", le=le)

        assert after.value("nri_accel_requests_total", event="create_container",
                           outcome=OK) == 5
        assert after.value("nri_accel_requests_total", event="create_container",
                           outcome=REFUSED) == 1
        assert [bucket(le) for le in ("1e-05", "2.5e-05", "5e-05", "0.005", "2.0", "+Inf")
                ] == [2, 3, 4, 5, 5, 6]
        assert after.value("nri_accel_request_duration_seconds_count",
                           event="create_container") == 6
        assert after.value("nri_accel_request_duration_seconds_sum",
                           event="create_container") == pytest.approx(2.503065001)

    serve(RunMetrics(requests), scenario)


def test_recording_and_config_do_not_load_prometheus_client() -> None:
    # Handlers record always and config validates the address; prometheus_client (45-90
    # ms to import) loads only with nri_accel.metrics.server, when metrics are on.
    code = ("import sys, nri_accel.config, nri_accel.metrics; "
            "sys.exit('prometheus_client' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
    code = "import sys, nri_accel.metrics.server; sys.exit('prometheus_client' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 1


def test_an_unknown_outcome_is_refused_and_records_nothing() -> None:
    requests = RequestRecorder.for_events(RUN_EVENTS)
    metrics = RunMetrics(requests)
    with pytest.raises(KeyError):
        requests["create_container"].record("maybe", 0.1)
    samples = Samples(metrics.render()[0].decode())
    assert samples.value("nri_accel_request_duration_seconds_count",
                         event="create_container") == 0
    assert "maybe" not in samples.text


def test_the_exposition_is_prometheus_text_or_openmetrics_when_asked() -> None:
    async def scenario(server: MetricsServer, address: str) -> None:
        plain = await aget(address, "/metrics")
        assert plain.content_type.startswith("text/plain; version=0.0.4")
        om = await aget(address, "/metrics", accept="application/openmetrics-text")
        assert om.content_type.startswith("application/openmetrics-text")
        assert om.text.endswith("# EOF\n")

    serve(run_metrics(), scenario)


def _names(samples: Samples) -> set[str]:
    return {name for name, _ in samples.values}


def test_each_process_exports_its_own_metrics_and_no_created_series() -> None:
    run = Samples(run_metrics().render()[0].decode())
    plugin = Samples(device_plugin_metrics().render()[0].decode())
    common = {"nri_accel_requests_total", "nri_accel_request_duration_seconds_bucket",
              "nri_accel_request_duration_seconds_count",
              "nri_accel_request_duration_seconds_sum", "nri_accel_inventory_refreshes_total"}
    # nri_accel_devices and nri_accel_kubelet_registered have no series until set
    assert _names(run) == common | {"nri_accel_runtime_connected", "nri_accel_reconnects_total"}
    assert _names(plugin) == common | {"nri_accel_nri_plugin_registered"}
    assert {dict(k)["event"] for k in plugin.labelled("nri_accel_requests_total")} == set(
        DEVICE_PLUGIN_EVENTS)
    assert "# TYPE nri_accel_devices gauge" in run.text
    assert "# TYPE nri_accel_kubelet_registered gauge" in plugin.text


def test_every_process_object_has_its_own_registry() -> None:
    requests = RequestRecorder.for_events(RUN_EVENTS)
    one, two = RunMetrics(requests), run_metrics()
    requests["create_container"].record(OK, 0.001)
    one.inventory_refreshed()
    assert Samples(one.render()[0].decode()).value("nri_accel_inventory_refreshes_total") == 1
    other = Samples(two.render()[0].decode())
    assert other.value("nri_accel_requests_total", event="create_container", outcome=OK) == 0
    assert other.value("nri_accel_inventory_refreshes_total") == 0


def _device(name: str, kind: str = KIND_GPU, *, healthy: bool = True) -> Device:
    return Device(kind=kind, name=name, healthy=healthy)


def test_device_counts_by_kind_and_state() -> None:
    inventory = Inventory(devices=(_device("0"), _device("1"), _device("2", healthy=False),
                                   _device("3", healthy=False), _device("0:1", MIG)))
    held = {f"{KIND_GPU}=1", f"{KIND_GPU}=3"}  # GPU 3 is held but has failed since
    assert device_counts(inventory, held) == {
        (KIND_GPU, "free"): 1, (KIND_GPU, "held"): 1, (KIND_GPU, "unhealthy"): 2,
        (MIG, "free"): 1, (MIG, "held"): 0, (MIG, "unhealthy"): 0}


def test_gauges_follow_what_sample_reads_on_the_loop() -> None:
    metrics = run_metrics()
    state: dict[str, Any] = {"inventory": Inventory(devices=(_device("0"), _device("0:1", MIG))),
                             "held": [f"{KIND_GPU}=0"], "connected": False, "registrations": 0}

    def sample() -> None:
        metrics.set_devices(device_counts(state["inventory"], state["held"]))
        metrics.set_runtime(connected=state["connected"], registrations=state["registrations"])

    async def settle(address: str, name: str, value: float, **labels: str) -> Samples:
        """The scrape once the heartbeat has copied the change in."""
        for _ in range(500):
            samples = await asyncio.to_thread(scrape, address)
            if samples.values.get((name, frozenset(labels.items()))) == value:
                return samples
            await asyncio.sleep(0.01)
        raise AssertionError(f"{name}{labels} never became {value}")

    async def scenario(server: MetricsServer, address: str) -> None:
        first = await asyncio.to_thread(scrape, address)  # start() sampled once already
        assert first.value("nri_accel_devices", kind=KIND_GPU, state="held") == 1
        assert first.value("nri_accel_devices", kind=MIG, state="free") == 1
        assert first.value("nri_accel_runtime_connected") == 0

        state.update(connected=True, registrations=1)
        now = await settle(address, "nri_accel_runtime_connected", 1)
        assert now.value("nri_accel_reconnects_total") == 0  # the first registration

        state.update(registrations=3)  # the runtime restarted twice
        now = await settle(address, "nri_accel_reconnects_total", 2)

        state.update(inventory=Inventory(devices=(_device("0"),)), held=[])  # MIG gone
        now = await settle(address, "nri_accel_devices", 1, kind=KIND_GPU, state="free")
        assert now.labelled("nri_accel_devices") == {
            frozenset({("kind", KIND_GPU), ("state", s)}): n
            for s, n in (("free", 1), ("held", 0), ("unhealthy", 0))}
        assert now.value("nri_accel_reconnects_total") == 2  # counted once, not per tick

    serve(metrics, scenario, sample=sample)


def test_kubelet_registration_by_resource_and_refreshes() -> None:
    metrics = device_plugin_metrics()
    metrics.set_kubelet_registered({"nvidia.com/gpu": True, "aws.amazon.com/neuron": False})
    metrics.inventory_refreshed()
    samples = Samples(metrics.render()[0].decode())
    assert samples.labelled("nri_accel_kubelet_registered") == {
        frozenset({("resource", "nvidia.com/gpu")}): 1,
        frozenset({("resource", "aws.amazon.com/neuron")}): 0}
    assert samples.value("nri_accel_inventory_refreshes_total") == 1
    metrics.set_kubelet_registered({"nvidia.com/gpu": False})  # neuron no longer served
    assert Samples(metrics.render()[0].decode()).labelled("nri_accel_kubelet_registered") == {
        frozenset({("resource", "nvidia.com/gpu")}): 0}


# ---- /readyz and /healthz -------------------------------------------------------------

def test_readyz_is_503_with_the_reason_until_ready_then_200() -> None:
    why: list[str | None] = ["not registered with the runtime (/run/nri/nri.sock)"]

    async def scenario(server: MetricsServer, address: str) -> None:
        answer = await aget(address, "/readyz")
        assert (answer.status, answer.text) == (
            503, "not ready: not registered with the runtime (/run/nri/nri.sock)\n")
        assert (await aget(address, "/healthz")).status == 200  # alive, only not ready
        why[0] = None
        answer = await asyncio.to_thread(wait_for, address, "/readyz", 200)
        assert answer.text == "ready\n"
        head = await aget(address, "/readyz", method="HEAD")
        assert (head.status, head.text) == (200, "")

    serve(run_metrics(), scenario, ready=lambda: why[0])


def test_a_failing_readiness_check_is_not_ready_and_says_why() -> None:
    def ready() -> str | None:
        raise RuntimeError("engine gone")

    async def scenario(server: MetricsServer, address: str) -> None:
        answer = await aget(address, "/readyz")
        assert answer.status == 503 and "readiness check failed" in answer.text
        assert "engine gone" in answer.text

    serve(run_metrics(), scenario, ready=ready)


def test_a_failing_sample_is_logged_once_and_probes_go_on(all_logs: None) -> None:
    calls = []

    def sample() -> None:
        calls.append(1)
        raise ValueError("inventory vanished")

    async def scenario(server: MetricsServer, address: str) -> None:
        while len(calls) < 5:  # several heartbeats
            await asyncio.sleep(0.01)
        assert (await aget(address, "/healthz")).status == 200
        assert (await aget(address, "/readyz")).status == 200
        assert (await aget(address, "/metrics")).status == 200

    with capture_logs() as logs:
        serve(run_metrics(), scenario, sample=sample)
    failed = [e for e in logs if e["event"] == "metrics_sample_failed"]
    assert len(failed) == 1 and failed[0]["error"] == "inventory vanished"


def test_healthz_is_503_while_the_loop_is_blocked_and_200_once_it_runs_again() -> None:
    clock = FakeClock()

    async def scenario(server: MetricsServer, address: str) -> None:
        assert (await aget(address, "/healthz")).text == "ok\n"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # The loop is stuck (a handler blocking by mistake) while 6 s pass: this
            # coroutine holds it, waiting on the probes without yielding.
            clock.now += 6
            health = pool.submit(get, address, "/healthz").result(timeout=30)
            ready = pool.submit(get, address, "/readyz").result(timeout=30)
        assert (health.status, health.text) == (
            503, "event loop stalled: no heartbeat for 6.0 s\n")
        assert (ready.status, ready.text) == (
            503, "not ready: event loop stalled: no heartbeat for 6.0 s\n")
        await asyncio.to_thread(wait_for, address, "/healthz", 200)  # the loop ticks again

    serve(run_metrics(), scenario, clock=clock, stale_after=5)


def test_healthz_is_503_once_the_event_loop_is_gone() -> None:
    servers: list[MetricsServer] = []

    async def main() -> None:  # starts the server and ends without closing it
        server = MetricsServer(run_metrics(), LOCAL, ready=lambda: None)
        server.start()
        servers.append(server)
        assert (await aget(str(server.address), "/healthz")).status == 200

    asyncio.run(main())  # the loop ends; the serving thread is still there
    server = servers[0]
    try:
        health = get(str(server.address), "/healthz")
        assert (health.status, health.text) == (503, "event loop stopped\n")
        assert get(str(server.address), "/readyz").status == 503
    finally:
        server.shutdown()


def test_the_serving_log_line_says_where_a_port_0_server_listens(
    tmp_path: Path, all_logs: None,
) -> None:
    bound: list[str] = []

    async def scenario(server: MetricsServer, address: str) -> None:
        bound.append(address)

    with capture_logs() as logs:
        serve(run_metrics(), scenario)
    (line,) = [e for e in logs if e["event"] == "metrics_serving"]
    assert line["paths"] == ["/metrics", "/healthz", "/readyz"]
    log_file = tmp_path / "daemon.log"  # as a daemon's JSON --log-file has it
    log_file.write_text(json.dumps({"event": "plugin_starting"}) + "\n" + json.dumps(line) + "\n")
    assert logged_address(log_file) == bound[0] != "127.0.0.1:0"


def test_other_paths_are_404() -> None:
    async def scenario(server: MetricsServer, address: str) -> None:
        answer = await aget(address, "/")
        assert answer.status == 404 and "/metrics" in answer.text

    serve(run_metrics(), scenario)


def _hold(address: str, sent: bytes) -> socket.socket:
    """A client that sends `sent` and then nothing: a slow or hostile one."""
    host, _, port = address.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=10)
    conn.sendall(sent)
    return conn


def _until_closed(conn: socket.socket) -> bytes:
    """What the server sends before it closes `conn` (within the test's bounded wait)."""
    got = b""
    while chunk := conn.recv(65536):
        got += chunk
    conn.close()
    return got


def test_clients_that_never_finish_are_bounded_in_number_time_and_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A client sending a byte every few seconds held a thread and up to 6 MiB of header
    # lines for ever: 40 of them took a daemon from 28 to 277 MiB.
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(server_module, "REQUEST_SECONDS", 1.0)
    monkeypatch.setattr(server_module._Handler, "timeout", 1.0)

    async def scenario(server: MetricsServer, address: str) -> None:
        held = [await asyncio.to_thread(_hold, address, b"GET /metrics HTTP/1.1\r\nX-A: ")
                for _ in range(3)]
        over = await asyncio.to_thread(_hold, address, b"GET /healthz HTTP/1.0\r\n\r\n")
        assert await asyncio.to_thread(_until_closed, over) == b""  # closed, unanswered
        # each held one is cut when its time is up, whatever it still means to send
        for conn in held:
            await asyncio.to_thread(_until_closed, conn)
        assert (await aget(address, "/healthz")).status == 200
        # a request's line and headers are read up to MAX_REQUEST_BYTES, then answered
        huge = b"GET /healthz HTTP/1.0\r\n" + b"X-B: " + b"b" * 200_000
        answer = await asyncio.to_thread(_until_closed, await asyncio.to_thread(
            _hold, address, huge[:server_module.MAX_REQUEST_BYTES + 100]))
        assert answer.startswith(b"HTTP/1.0 200 ")

    serve(run_metrics(), scenario)


# ---- addresses ------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "host", "port", "shown"), [
    ("127.0.0.1:9100", "127.0.0.1", 9100, "127.0.0.1:9100"),
    ("0.0.0.0:0", "0.0.0.0", 0, "0.0.0.0:0"),
    ("[::1]:9100", "::1", 9100, "[::1]:9100"),
    ("[::]:65535", "::", 65535, "[::]:65535"),
    (" 10.0.0.7:9100\n", "10.0.0.7", 9100, "10.0.0.7:9100"),
])
def test_addresses_accepted(text: str, host: str, port: int, shown: str) -> None:
    address = parse_address(text, source="--metrics-address")
    assert (address.host, address.port, str(address)) == (host, port, shown)
    assert address.family == (socket.AF_INET6 if ":" in host else socket.AF_INET)


@pytest.mark.parametrize(("text", "fragment"), [
    ("9100", "is not HOST:PORT (e.g. 127.0.0.1:9100, [::1]:9100"),
    (":9100", "names no host"),
    ("localhost:9100", "'localhost' is not an IP address (host names are not resolved"),
    ("::1:9100", "an IPv6 address goes in brackets, as in [::1]:9100"),
    ("[127.0.0.1]:9100", "brackets hold an IPv6 address; write 127.0.0.1:9100"),
    ("127.0.0.1:", "'' is not a port number (0 to 65535)"),
    ("127.0.0.1:65536", "'65536' is not a port number"),
    ("127.0.0.1:http", "'http' is not a port number"),
    ("127.0.0.1:\u0661\u0662", "is not a port number"),  # Arabic-Indic digits
    ("[::1]9100", "brackets"),
    ("", "is not HOST:PORT"),
])
def test_bad_addresses_are_refused_naming_the_flag(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_address(text, source="--metrics-address")
    assert str(err.value).startswith("--metrics-address: ")
    assert fragment in str(err.value)


def test_the_flag_overrides_the_config_and_an_empty_flag_turns_metrics_off() -> None:
    assert choose_address("127.0.0.1:1", "127.0.0.1:2") == Address("127.0.0.1", 1)
    assert choose_address("", "127.0.0.1:2") is None
    assert choose_address(None, "127.0.0.1:2") == Address("127.0.0.1", 2)
    assert choose_address(None, "") is None
    with pytest.raises(ConfigError, match=r"^/etc/nri-accel/config.toml: metrics.address: "):
        choose_address(None, "nowhere", config_path="/etc/nri-accel/config.toml")
    with pytest.raises(ConfigError, match=r"^--metrics-address: "):
        choose_address("nowhere", "")


def test_config_metrics_address_is_optional_and_validated() -> None:
    assert parse_config({}).metrics.address == ""
    assert parse_config({"metrics": {"address": "[::1]:9100"}}).metrics.address == "[::1]:9100"
    with pytest.raises(ConfigError, match=r"^/c.toml: metrics.address: .*not an IP address"):
        parse_config({"metrics": {"address": "node-1:9100"}}, path="/c.toml")
    with pytest.raises(ConfigError, match=r"metrics.port: unknown key \(known: address\)"):
        parse_config({"metrics": {"port": 9100}})
    with pytest.raises(ConfigError, match=r"metrics.address: expected a string"):
        parse_config({"metrics": {"address": 9100}})


def test_a_port_in_use_is_a_clear_error_naming_the_source() -> None:
    errors: list[ConfigError] = []

    async def scenario(server: MetricsServer, address: str) -> None:
        second = MetricsServer(run_metrics(), Address("127.0.0.1", server.address.port,
                                                     "metrics.address"), ready=lambda: None)
        with pytest.raises(ConfigError) as err:  # a second instance with the same config
            second.start()
        errors.append(err.value)
        assert (await aget(address, "/healthz")).status == 200  # the first serves on

    serve(run_metrics(), scenario)
    assert str(errors[0]).startswith("metrics.address: cannot listen on 127.0.0.1:")
    assert str(errors[0]).endswith(": Address already in use "
                                   "(is another nri-accel or exporter using it?)")


def test_an_address_not_of_this_host_is_a_clear_error() -> None:
    async def main() -> None:
        MetricsServer(run_metrics(), Address("192.0.2.1", 9100, "--metrics-address"),
                      ready=lambda: None).start()  # TEST-NET-1: on no interface here

    with pytest.raises(ConfigError, match=r"^--metrics-address: cannot listen on "
                                          r"192.0.2.1:9100: Cannot assign requested address$"):
        asyncio.run(main())


def test_the_port_is_free_again_after_close() -> None:
    ports: list[int] = []

    async def scenario(server: MetricsServer, address: str) -> None:
        ports.append(server.address.port)

    serve(run_metrics(), scenario)

    async def again(server: MetricsServer, address: str) -> None:
        assert (await aget(address, "/healthz")).status == 200

    async def main() -> None:
        async with MetricsServer(run_metrics(), Address("127.0.0.1", ports[0]),
                                 ready=lambda: None) as server:
            await again(server, str(server.address))

    asyncio.run(main())


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_serves_on_ipv6() -> None:
    async def main() -> None:
        address = parse_address("[::1]:0", source="--metrics-address")
        async with MetricsServer(run_metrics(), address, ready=lambda: None) as server:
            assert str(server.address).startswith("[::1]:") and server.address.port > 0
            assert (await aget(str(server.address), "/healthz")).status == 200

    asyncio.run(main())


def test_interval_must_be_shorter_than_stale_after() -> None:
    with pytest.raises(ValueError, match="interval"):
        MetricsServer(run_metrics(), LOCAL, ready=lambda: None, interval=5, stale_after=5)


@pytest.mark.parametrize("make", [run_metrics, device_plugin_metrics])
def test_the_readme_names_every_metric_each_process_exports(make: Callable[[], Any]) -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    names = {f.name + ("_total" if f.type == "counter" else "")
             for f in make().registry.collect()}
    assert len(names) >= 5  # the registry is read (labelled families without samples too)
    assert sorted(n for n in names if f"`{n}`" not in readme and f"`{n}{{" not in readme) == []
