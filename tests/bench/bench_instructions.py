"""Benchmark of the instructions each plugin process executes per CreateContainer.

Run: .venv/bin/python tests/bench/bench_instructions.py [--requests N]
Prints figures, asserts nothing; needs valgrind (prints why it cannot run without it).
The three plugins of bench_roundtrip.py (the floor: a bare ttrpc plugin answering
empty; the stub serving a plugin that does nothing; `nri-accel run` on the demo
inventory, standalone) run under valgrind's callgrind against the runtime simulator
in this process, each twice: once answering --requests CreateContainer of a container
asking for nothing (the CRI request of shared/nri-wire's capture), once answering none.
The difference, divided by --requests, is the user-space instructions one request
costs in that process: its own work (decoding, the plugin's, encoding), without the
kernel's part of the socket I/O or anything the machine's load does to timings, so
the figure is the same on a busy machine and a quiet one (round-trip times, which
bench_roundtrip.py prints, are not).
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

from bench_roundtrip import (
    FLOOR,
    REPO,
    STUB_ONLY,
    captured_request,
    daemon_command,
    round_trips,
    variant,
)

from nri_accel import log
from nri_accel.nri.simulator import Simulator

PLUGINS = ("floor", "stub-only", "nri-accel")


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
            procs = {
                "floor": under_callgrind("floor", [sys.executable, "-c", FLOOR, sock]),
                "stub-only": under_callgrind("stub-only",
                                             [sys.executable, "-c", STUB_ONLY, sock]),
                "nri-accel": under_callgrind("nri-accel", daemon_command(
                    sock, config, f"{tmp}/daemon.log")),
            }
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
    counts = {}
    for name in PLUGINS:
        text = Path(out, f"{name}-{requests}.out").read_text()
        found = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        counts[name] = int(found.group(1)) if found else 0
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: no figures (apt-get install valgrind)")
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
        print(f"  {name:10} {per[name] / 1000:7.1f} k   {per[name] / per['floor']:.2f}x the floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
