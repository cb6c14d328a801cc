"""`nri-accel demo` (the README's main command) runs the real daemon end to end."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_the_daemon_and_prints_what_each_container_gets() -> None:
    proc = subprocess.run([sys.executable, "-m", "nri_accel.cli", "demo"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"daemon registered as 40-nri-accel \(pid \d+\)", out)
    blocks = {b.splitlines()[0]: b for b in out.split("\n\n") if b.strip()}
    one = blocks["ml/cuda-one/main"]
    assert re.search(r"devices .*/dev/nvidia\d ", one)
    assert "/dev/nvidiactl" in one
    assert re.search(r"NVIDIA_VISIBLE_DEVICES=GPU-[0-9a-f-]{36}$", one, re.M)
    assert "libcuda.so.1" in one
    assert "no devices" in blocks["sandbox/notebook/jupyter"]
    assert "REFUSED  annotation devices.nri-accel.io/pod: pod annotations may not grant" \
        in blocks["sandbox/grab-all/miner"]
    assert "REFUSED  annotation devices.nri-accel.io/container.app" \
        in blocks["research/malformed/app"]
    # The daemon's own canonical log lines, one per CreateContainer.
    log = out[out.index("daemon log"):]
    assert re.search(r"created  ml/cuda-one/main +nvidia\.com/gpu=\d+  \d+ us", log)
    assert re.search(r"refused  sandbox/grab-all/miner", log)
    assert "not granted" in log  # the notebook's ignored NVIDIA_VISIBLE_DEVICES=all
