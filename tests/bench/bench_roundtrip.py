"""Benchmark of the whole daemon: CreateContainer round trips through the real NRI socket.

Run: .venv/bin/python tests/bench/bench_roundtrip.py [--requests N] [--concurrency C]
                                                     [--cpu N]
Prints figures, asserts nothing. `nri-accel run` runs as a subprocess on the built-in
demo inventory (8 GPUs) in standalone mode, against the runtime simulator in this
process, which logs warnings only; the daemon logs as deployed (info lines to a file:
its canonical line per container is part of its cost and of the figures below).
Beside it runs the *floor*: the least a plugin can do over this project's ttrpc and
mux code (register, configure, answer every CreateContainer empty; no stub, no
parsing), on the same socket and simulator: issue #10's floor, a minimal asyncio
plugin, runs on the stock asyncio loop; the same floor on uvloop (the loop `run`
runs on by default, nri.event_loop = "auto") shows what nri-accel costs above it on
one loop. Beside them the stub on uvloop serving a plugin whose create_container
returns None at once (what the stub costs above the floor; the rest up to nri-accel
is its own work per container), and `nri-accel run` on the stock loop
(nri.event_loop = "asyncio"). Their round trips are taken in alternating blocks, so
that all see the same machine.
--cpu N pins both processes to CPU N: the figures are then the software's own cost,
without the wake-up of a sleeping CPU at each message (on a small VM that adds about
0.1 ms per round trip and most of the run-to-run spread). Measured:
- time from the daemon's process start to its RegisterPlugin reaching the runtime,
  and to being configured and synchronised; then the floor's start to registered
  (what a bare Python plugin on the same ttrpc code takes on this machine). The
  package's bytecode is compiled first (compileall), as installing it does
  (deploy/image: pip writes the .pyc files): a shell with PYTHONDONTWRITEBYTECODE set
  never writes them for a checkout, and would have every start compile all of
  nri_accel again (some 60 % more start-up work);
- CreateContainer round trip (encode, ttrpc + mux over the socket, the plugin's whole
  pipeline, its answer decoded here): a container asking for nothing, next to the
  floor's (and their ratio: over the whole run, and turn by turn, the median and
  quartiles of the ratios of each turn's medians, which a busy machine disturbs less,
  each turn's figures being taken a few milliseconds apart), and one asking for a GPU
  (full adjustment: device nodes, driver mounts, env); p50/p99/max;
- the CPU each of the three plugins' processes spent per request asking for nothing
  (its main thread's time on a CPU, /proc/PID/schedstat, over those round trips): the
  plugin's own cost, steadier than round-trip latency on a busy machine;
- throughput with C CreateContainer calls in flight at a time;
- the daemon's own time per CreateContainer (duration_us of its canonical log line);
- the daemon's peak RSS (VmHWM);
- how long after a restarted runtime comes back the daemon is registered again;
- SIGTERM to process exit in each connection state of runtime_states.STATES
  (a fresh daemon each).
The request is the real CRI-generated CreateContainer of shared/nri-wire's
containerd-2.3.4-e2e capture, with the pod's annotations replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nri_accel import log
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.simulator import PluginConn, Simulator

REPO = Path(__file__).resolve().parents[2]
WIRE = REPO.parent / "shared" / "nri-wire"
CAPTURE = "containerd-2.3.4-e2e"  # the capture whose CreateContainer the benchmarks replay
DEMO_INVENTORY = REPO / "nri_accel" / "demo" / "inventory.json"
sys.path.insert(0, str(REPO / "tests" / "protocol"))

from runtime_states import STATES, in_state  # noqa: E402
from wire import runtime_requests  # noqa: E402

# Each bare plugin's argv: the socket, the event loop to run on ("asyncio": the stock
# loop; "uvloop": what `nri-accel run` runs on by default, nri.event_loop = "auto"), the
# name it registers with.
ON_LOOP = """
import asyncio, sys

def run_on(loop, main):
    factory = None
    if loop == "uvloop":
        import uvloop
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)
"""
FLOOR = ON_LOOP + """
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, MuxProtocol
from nri_accel.nri.stub import PLUGIN_SERVICE, RUNTIME_SERVICE, event_bit
from nri_accel.ttrpc import Endpoint

CONFIGURED = pb.ConfigureResponse(events=event_bit(pb.CREATE_CONTAINER)).SerializeToString()

async def main(path, name):
    mux = MuxProtocol(serving=True)
    plugin = Endpoint(mux.sender(PLUGIN_SERVICE_CONN), {PLUGIN_SERVICE: {
        "Configure": lambda ctx, payload: CONFIGURED,
        "Synchronize": lambda ctx, payload: b"",
        "CreateContainer": lambda ctx, payload: b"",
    }}, on_close=mux.close)
    runtime = Endpoint(mux.sender(RUNTIME_SERVICE_CONN), on_close=mux.close)
    mux.attach(PLUGIN_SERVICE_CONN, plugin.data_received, plugin.connection_lost)
    mux.attach(RUNTIME_SERVICE_CONN, runtime.data_received, runtime.connection_lost)
    await asyncio.get_running_loop().create_unix_connection(lambda: mux, path)
    register = pb.RegisterPluginRequest(plugin_name=name, plugin_idx="99")
    await runtime.call(RUNTIME_SERVICE, "RegisterPlugin", register.SerializeToString())
    await mux.lost

run_on(sys.argv[2], main(sys.argv[1], sys.argv[3]))
"""
STUB_ONLY = ON_LOOP + """
from nri_accel import log
from nri_accel.nri.stub import Identity, Stub

log.configure(level="warning")

class Nothing:
    def create_container(self, pod, container):
        return None

run_on(sys.argv[2], Stub(Nothing(), Identity(sys.argv[3], "98"), socket_path=sys.argv[1]).run())
"""
# The bare plugins beside the daemon, by the name each registers with: its code and loop.
# "floor" is issue #10's floor (a minimal asyncio ttrpc plugin: the stock loop);
# "floor-uvloop" the same on the daemon's own loop; the stub alone on the daemon's loop.
BARE = {
    "floor": (FLOOR, "asyncio"),
    "floor-uvloop": (FLOOR, "uvloop"),
    "stub-only": (STUB_ONLY, "uvloop"),
}


def bare_command(name: str, sock: str) -> list[str]:
    """The command line of BARE's plugin `name`, connecting to `sock`."""
    code, loop = BARE[name]
    return [sys.executable, "-c", code, sock, loop, name]


BLOCK = 250  # round trips per turn when plugins alternate


def captures_missing() -> str:
    """Why a benchmark replaying CAPTURE cannot run here ("" when it can): the NRI
    captures beside the repository (../shared/nri-wire) are absent, as in a clone of the
    repository alone. Its main() then prints this and exits 0, as the tests skip."""
    if any((WIRE / f"{CAPTURE}.raw.jsonl{ext}").is_file() for ext in ("", ".gz")):
        return ""
    return (f"skipped: it replays the NRI capture {CAPTURE}, not found in {WIRE} "
            "(the captures beside the repository)")


def captured_request() -> pb.CreateContainerRequest:
    payload = next(p for _, method, p in runtime_requests(WIRE, CAPTURE, 1)
                   if method == "CreateContainer")
    return pb.CreateContainerRequest.FromString(payload)


def variant(base: pb.CreateContainerRequest, annotations: dict[str, str]) -> bytes:
    req = pb.CreateContainerRequest()
    req.CopyFrom(base)
    req.pod.annotations.clear()
    req.pod.annotations.update(annotations)
    return req.SerializeToString()


def quantile(samples_ns: list[int], q: float) -> float:
    """The q-quantile of the samples, in ms."""
    s = sorted(samples_ns)
    return s[min(len(s) - 1, int(len(s) * q))] / 1e6


def percentiles(samples_ns: list[int]) -> str:
    return (f"p50 {quantile(samples_ns, 0.5):.3f} ms  p99 {quantile(samples_ns, 0.99):.3f} ms  "
            f"max {max(samples_ns) / 1e6:.3f} ms  (n={len(samples_ns)})")


async def round_trips(conn: PluginConn, payload: bytes, n: int) -> list[int]:
    call = conn.client.call
    md = (("containerd-namespace-ttrpc", "k8s.io"),)
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        raw = await call("nri.pkg.api.v1alpha1.Plugin", "CreateContainer", payload,
                         timeout=2.0, metadata=md)
        pb.CreateContainerResponse.FromString(raw)
        out.append(time.perf_counter_ns() - t0)
    return out


async def alternating(conns: list[PluginConn], payload: bytes, n: int) -> list[list[int]]:
    """n round trips to each plugin, taken in turns of BLOCK."""
    samples: list[list[int]] = [[] for _ in conns]
    while len(samples[0]) < n:
        for conn, out in zip(conns, samples, strict=True):
            out += await round_trips(conn, payload, BLOCK)
    return samples


async def throughput(conn: PluginConn, payload: bytes, n: int, concurrency: int) -> float:
    per_worker = n // concurrency

    async def worker() -> None:
        await round_trips(conn, payload, per_worker)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return per_worker * concurrency / (time.perf_counter() - t0)


def on_cpu_ns(pid: int) -> int:
    """Nanoseconds the process's main thread has run on a CPU (/proc/PID/schedstat)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


def daemon_command(sock: str, config: Path, log_file: str) -> list[str]:
    """`nri-accel run` against the demo inventory; its state in a directory beside its log."""
    return [sys.executable, "-m", "nri_accel", "run", "--socket", sock,
            "--inventory", str(DEMO_INVENTORY), "--config", str(config), "--log-file", log_file,
            "--state-dir", str(Path(log_file).parent / "state")]


def on_stock_loop(tmp: str, sock: str) -> list[str]:
    """`nri-accel run` as daemon_command(), on the stock asyncio loop (nri.event_loop =
    "asyncio"), registered as "nri-accel-asyncio"; its files in a directory of its own."""
    home = Path(tmp, "asyncio")
    home.mkdir()
    config = home / "config.toml"
    config.write_text('[policy]\nmode = "standalone"\n[nri]\nevent_loop = "asyncio"\n')
    return [*daemon_command(sock, config, str(home / "daemon.log")),
            "--name", "nri-accel-asyncio"]


def ratio(ours: list[int], base: list[int]) -> str:
    """p50 and p99 of `ours` over `base`'s, and the median and quartiles of the ratios
    of each turn's medians (BLOCK round trips a turn, taken a few ms apart)."""
    turns = sorted(statistics.median(ours[i:i + BLOCK]) / statistics.median(base[i:i + BLOCK])
                   for i in range(0, len(ours), BLOCK))
    return (f"p50 {quantile(ours, 0.5) / quantile(base, 0.5):.2f}x  p99 "
            f"{quantile(ours, 0.99) / quantile(base, 0.99):.2f}x  (p50 turn by turn: median "
            f"{statistics.median(turns):.2f}x, {turns[len(turns) // 4]:.2f}-"
            f"{turns[len(turns) * 3 // 4]:.2f})")


async def main_async(args: argparse.Namespace) -> None:
    base = captured_request()
    noop = variant(base, {})
    gpu = variant(base, {"devices.nri-accel.io/container.c0": "nvidia.com/gpu=0"})
    with tempfile.TemporaryDirectory(prefix="nri-bench-") as tmp:
        sock, log_file = f"{tmp}/nri.sock", f"{tmp}/daemon.log"
        config = Path(tmp, "config.toml")
        config.write_text('[policy]\nmode = "standalone"\n')
        async with Simulator(sock) as sim:
            started = time.monotonic()
            proc = subprocess.Popen(daemon_command(sock, config, log_file),
                                    stdin=subprocess.DEVNULL)
            others: list[subprocess.Popen[bytes]] = []
            try:
                conn = await sim.wait_for_plugin("nri-accel", timeout=30)
                ready = time.monotonic()
                registered = conn.registered_at  # loop time: time.monotonic()
                assert registered is not None
                print(f"start to RegisterPlugin:     {(registered - started) * 1000:.0f} ms")
                print(f"start to configured+synced:  {(ready - started) * 1000:.0f} ms")
                floor_started = time.monotonic()
                others = [subprocess.Popen(bare_command("floor", sock), stdin=subprocess.DEVNULL)]
                floor_conn = await sim.wait_for_plugin("floor", timeout=30)
                assert floor_conn.registered_at is not None
                print(f"  the floor's, a bare plugin: "
                      f"{(floor_conn.registered_at - floor_started) * 1000:.0f} ms")
                others += [subprocess.Popen(bare_command(name, sock), stdin=subprocess.DEVNULL)
                           for name in ("floor-uvloop", "stub-only")]
                others.append(subprocess.Popen(on_stock_loop(tmp, sock),
                                               stdin=subprocess.DEVNULL))
                conns = [conn, floor_conn] + [
                    await sim.wait_for_plugin(name, timeout=30)
                    for name in ("floor-uvloop", "stub-only", "nri-accel-asyncio")]
                for warm in conns:
                    await round_trips(warm, gpu, 300)
                pids = [proc.pid] + [other.pid for other in others]
                cpu = [on_cpu_ns(pid) for pid in pids]
                ours, bare, bare_uv, stub_only, ours_stock = await alternating(
                    conns, noop, args.requests)
                cpu = [(on_cpu_ns(pid) - before) / len(ours) / 1000
                       for pid, before in zip(pids, cpu, strict=True)]
                print(f"CreateContainer, no devices: {percentiles(ours)}  (uvloop, run's default)")
                print(f"  floor, a bare ttrpc plugin: {percentiles(bare)}  (asyncio's loop)")
                print(f"  the floor on uvloop:        {percentiles(bare_uv)}")
                print(f"  the stub on uvloop, plugin does nothing: {percentiles(stub_only)}")
                print(f"  nri-accel on asyncio's loop: {percentiles(ours_stock)}")
                print(f"  nri-accel / floor:          {ratio(ours, bare)}")
                print(f"  both on uvloop:             {ratio(ours, bare_uv)}")
                print(f"  both on asyncio's loop:     {ratio(ours_stock, bare)}")
                print(f"  CPU per request (schedstat): nri-accel {cpu[0]:.1f} us, floor "
                      f"{cpu[1]:.1f} us (on uvloop {cpu[2]:.1f}), stub {cpu[3]:.1f} us, "
                      f"nri-accel on asyncio's loop {cpu[4]:.1f} us: nri-accel / floor "
                      f"{cpu[0] / cpu[1]:.2f}x, on uvloop {cpu[0] / cpu[2]:.2f}x, on asyncio's "
                      f"{cpu[4] / cpu[1]:.2f}x")
                print(f"CreateContainer, 1 GPU:      "
                      f"{percentiles(await round_trips(conn, gpu, args.requests))}")
                rate = await throughput(conn, gpu, args.requests, args.concurrency)
                print(f"throughput, {args.concurrency} in flight:     {rate:.0f} containers/s")
                print(f"daemon peak RSS (VmHWM):     {vm_hwm_kib(proc.pid) / 1024:.1f} MiB")
            except BaseException:
                proc.terminate()
                raise
            finally:
                for other in others:
                    other.terminate()
                    other.wait(timeout=10)
        try:
            await asyncio.sleep(args.outage)  # the runtime is away: the daemon retries
            async with Simulator(sock) as sim:
                back = time.monotonic()
                await sim.wait_for_plugin(timeout=30)
                print(f"re-registered after a {args.outage:g} s runtime outage: "
                      f"{(time.monotonic() - back) * 1000:.0f} ms after it came back")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        durations = [json.loads(line)["duration_us"]
                     for line in Path(log_file).read_text().splitlines()
                     if '"container_created"' in line]
        print(f"daemon time per container:   p50 {statistics.median(durations):.0f} us "
              f"(canonical log line, n={len(durations)})")
        await sigterm_to_exit(tmp, config)


async def sigterm_to_exit(tmp: str, config: Path) -> None:
    """SIGTERM to process exit, a fresh daemon brought into each state."""
    for i, state in enumerate(STATES):
        sock, log_file = f"{tmp}/stop{i}.sock", Path(tmp, f"stop{i}.log")

        def retrying(log_file: Path = log_file) -> bool:
            return log_file.exists() and '"runtime_unavailable"' in log_file.read_text()

        def start(sock: str = sock, log_file: Path = log_file) -> subprocess.Popen[bytes]:
            return subprocess.Popen(daemon_command(sock, config, str(log_file)),
                                    stdin=subprocess.DEVNULL)

        async with in_state(state, sock, start, retrying) as proc:
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            status = await asyncio.to_thread(proc.wait, 60)
            elapsed = time.monotonic() - t0
        print(f"SIGTERM to exit, {state + ':':<48} {elapsed * 1000:4.0f} ms (exit {status})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--outage", type=float, default=3.0,
                        help="seconds the runtime stays away before it comes back")
    parser.add_argument("--cpu", type=int, default=None,
                        help="pin this process and the daemon to this CPU")
    args = parser.parse_args()
    if why := captures_missing():
        print(why)
        return 0
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})  # the daemon inherits it
    compileall.compile_dir(REPO / "nri_accel", quiet=1)  # as installed (see above)
    log.configure(level="warning")  # the simulator's info lines would break up the figures
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
