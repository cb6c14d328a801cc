"""Benchmark of the instructions each plugin process executes per CreateContainer.

Run: .venv/bin/python tests/bench/bench_instructions.py [--requests N]
Prints figures, asserts nothing; needs valgrind (prints why it cannot run without it).
The plugins of bench_roundtrip.py (the floor: a bare ttrpc plugin answering empty, on
asyncio's loop and on uvloop's; the stub serving a plugin that does nothing, on uvloop;
`nri-accel run` on the demo inventory, standalone, on its default loop, uvloop) run
under valgrind's callgrind against the runtime simulator
in this process, each twice: once answering --requests CreateContainer of a container
asking for nothing (the CRI request of shared/nri-wire's capture), once answering none.
The difference, divided by --requests, is the user-space instructions one request
costs in that process: its own work (decoding, the plugin's, encoding), without the
kernel's part of the socket I/O or anything the machine's load does to timings, so
the figure is the same on a busy machine and a quiet one (round-trip times, which
bench_roundtrip.py prints, are not).
The run answering none is printed too: each process's start-up (imports, registration),
20 warm-up requests and its exit, in instructions (bench_roundtrip.py's start-up time
moves with the load).

Then, in process, the daemon's CreateContainer handler from the request's bytes to the
answer's (the stub's decoding, the plugin, the canonical log line), for the captured
request asking nothing and asking for one GPU; and the hot path alone: each container
of bench_hotpath.py's CASES planned, its adjustment encoded, and released. Each
--calls times and none (after the same warm-up); the figures to compare two trees by
(a refactor that claims "no slower"), where bench_hotpath.py's microseconds move with
the load.
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_hotpath import CASES
from bench_roundtrip import (
    REPO,
    bare_command,
    captured_request,
    captures_missing,
    daemon_command,
    round_trips,
    variant,
)

from nri_accel import log
from nri_accel.nri.simulator import Simulator

PLUGINS = ("floor", "floor-uvloop", "stub-only", "nri-accel")

# argv: the case's name, the calls to make after the warm-up.
HOT_PATH = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from bench_hotpath import CASES, DEMO
from nri_accel.config import Config, PolicyConfig
from nri_accel.engine import Engine
from nri_accel.inventory import Inventory
from nri_accel.nri.adjust import encode_adjustment

engine = Engine(Inventory.load(DEMO),
                Config(policy=PolicyConfig("kubernetes", frozenset({{"research"}}))))
make = CASES[sys.argv[1]]
for i in range(200 + int(sys.argv[2])):
    p = engine.plan(make(f"c{{i}}"))
    encode_adjustment(p.edits, p.annotations, p.cdi_devices)
    engine.release(f"c{{i}}")
"""

# argv: "nothing" or "gpu", the calls to make after the warm-up. The daemon's own
# handler for a CreateContainer, from the request's bytes to the answer's: decoding (at
# a glance, then in full if it asks), the plugin, the canonical line (to /dev/null).
THROUGH_STUB = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from bench_hotpath import DEMO
from bench_roundtrip import captured_request, variant
from nri_accel import log
from nri_accel.config import Config, PolicyConfig
from nri_accel.engine import Engine
from nri_accel.inventory import Inventory
from nri_accel.nri.stub import Identity, Stub
from nri_accel.plugin import AccelPlugin

log.configure(level="info", fmt="json", file=open("/dev/null", "w"))
engine = Engine(Inventory.load(DEMO), Config(policy=PolicyConfig("standalone")))
stub = Stub(AccelPlugin(engine), Identity("bench", "10"), socket_path="/nonexistent")
asks = {{"gpu": {{"devices.nri-accel.io/container.c0": "nvidia.com/gpu=0"}}}}
payload = variant(captured_request(), asks.get(sys.argv[1], {{}}))
for i in range(200 + int(sys.argv[2])):
    stub._create_container(None, payload)  # a create of the same id replaces its grant
"""


async def run_all(requests: int, out: Path) -> dict[str, int]:
    """Instructions each plugin process executed, answering `requests` requests."""
    with tempfile.TemporaryDirectory(prefix="nri-bench-ir-") as tmp:
        sock = f"{tmp}/nri.sock"
        config = Path(tmp, "config.toml")
        config.write_text('[policy]\nmode = "standalone"\n')

        def under_callgrind(name: str, command: list[str]) -> subprocess.Popen[bytes]:
            return subprocess.Popen(["valgrind", "--tool=callgrind", "--callgrind-out-file="
                                     f"{out}/{name}-{requests}.out", *command],
                                    stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        async with Simulator(sock, registration_timeout=120, request_timeout=30) as sim:
            procs = {name: under_callgrind(name, bare_command(name, sock))
                     for name in PLUGINS if name != "nri-accel"}
            procs["nri-accel"] = under_callgrind("nri-accel", daemon_command(
                sock, config, f"{tmp}/daemon.log"))
            try:
                noop = variant(captured_request(), {})
                for name in PLUGINS:
                    conn = await sim.wait_for_plugin(name, timeout=300)
                    await round_trips(conn, noop, 20)  # the same warm-up for both runs
                    await round_trips(conn, noop, requests)
            finally:
                for proc in procs.values():
                    proc.send_signal(signal.SIGTERM)
                for proc in procs.values():
                    proc.wait(timeout=120)
    return {name: total(Path(out, f"{name}-{requests}.out")) for name in PLUGINS}


def total(callgrind_out: Path) -> int:
    found = re.search(r"^(?:summary|totals): (\d+)", callgrind_out.read_text(), re.M)
    return int(found.group(1)) if found else 0


def in_process(script: str, case: str, calls: int, out: Path) -> int:
    """Instructions a process running `script` (HOT_PATH, THROUGH_STUB) executed making
    `calls` calls of `case`."""
    file = out / f"in-process-{calls}.out"
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={file}",
                    sys.executable, "-c", script, case, str(calls)],
                   stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return total(file)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=2000, help="hot path calls per case")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: no figures (apt-get install valgrind)")
        return 0
    if why := captures_missing():
        print(why)
        return 0
    log.configure(level="warning")
    compileall.compile_dir(REPO / "nri_accel", quiet=1)  # as installed: no compiling
    with tempfile.TemporaryDirectory(prefix="nri-bench-callgrind-") as out:
        idle = asyncio.run(run_all(0, Path(out)))
        busy = asyncio.run(run_all(args.requests, Path(out)))
    per = {name: (busy[name] - idle[name]) / args.requests for name in PLUGINS}
    print(f"user-space instructions per CreateContainer asking for nothing "
          f"(callgrind, {args.requests} requests):")
    for name in PLUGINS:
        print(f"  {name:12} {per[name] / 1000:7.1f} k   {per[name] / per['floor']:.2f}x the floor")
    print("\neach process from exec to exit, answering only the warm-up (start-up, "
          "registration, 20 requests, SIGTERM):")
    for name in PLUGINS:
        print(f"  {name:12} {idle[name] / 1e6:7.1f} M")
    with tempfile.TemporaryDirectory(prefix="nri-bench-callgrind-") as out:

        def show(script: str, case: str, what: str) -> None:
            calls = (in_process(script, case, args.calls, Path(out))
                     - in_process(script, case, 0, Path(out))) / args.calls
            print(f"  {what:44} {calls / 1000:7.1f} k", flush=True)

        print(f"\nthe daemon's CreateContainer handler, in process (callgrind, {args.calls} "
              "calls from the request's bytes to the answer's, the log line included):")
        show(THROUGH_STUB, "nothing", "asking for nothing")
        show(THROUGH_STUB, "gpu", "1 GPU, by annotation")
        print(f"\nhot path instructions per container, in process (callgrind, {args.calls} "
              "calls of bench_hotpath.py's plan + adjustment + release):")
        for case in CASES:
            show(HOT_PATH, case, case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
