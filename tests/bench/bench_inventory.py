"""Benchmark of the whole discovery, of loading a saved inventory, and of a refresh poll.

Run (as root: the fake roots have device nodes): .venv/bin/python
tests/bench/bench_inventory.py [--rounds N]. Prints milliseconds (first call, median,
p90, best) and asserts nothing.

- discover(): every discoverer (NVIDIA through the real pynvml and the fake
  libnvidia-ml, Neuron, static, CDI) merged into one Inventory, on the fake roots
  a100-mig (8x A100, 7 MIG devices; target under 50 ms), trn1 (16 Neuron devices) and
  cdi-only (CDI specs in JSON and YAML, static devices).
- Inventory.load: tests/golden/discover/a100-mig.json, the 8-GPU node saved by
  `discover --json` and pinned as a golden file. Target: under 5 ms.
- refresh poll: what the background refresh costs every interval while nothing changes
  (watch_state + nodes_match on a100-mig).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench_discover import measure, report

TESTS = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    sys.path.insert(0, str(TESTS))  # the fakes

    from fakes.roots import materialise

    from nri_accel.config import Config, load_config
    from nri_accel.discover import discover
    from nri_accel.discover.watch import nodes_match, watch_state
    from nri_accel.inventory import Inventory
    from nri_accel.log import configure

    configure(level="error", file=sys.stderr)  # cdi-only's broken spec warns every round
    golden = TESTS / "golden" / "discover"
    with tempfile.TemporaryDirectory(prefix="bench-inventory-") as tmp:
        for name in ("a100-mig", "trn1", "cdi-only"):
            root = materialise(name, Path(tmp) / name)
            conf = golden / f"{name}.config.toml"
            config = load_config(str(conf)) if conf.exists() else Config()
            first = measure(lambda root=root, config=config: discover(root, config), 1)[0]
            inv = discover(root, config)
            report(f"discover() {name} ({len(inv.devices)} devices)", first,
                   measure(lambda root=root, config=config: discover(root, config),
                           args.rounds))
            if name == "a100-mig":
                poll_root, poll_config, poll_inv = root, config, inv

        def poll() -> None:
            watch_state(poll_root, poll_config)
            nodes_match(poll_root, poll_inv)

        report("refresh poll a100-mig (nothing changed)", measure(poll, 1)[0],
               measure(poll, args.rounds))

    saved = golden / "a100-mig.json"
    first = measure(lambda: Inventory.load(saved), 1)[0]
    report(f"Inventory.load a100-mig.json ({saved.stat().st_size // 1024} KiB)", first,
           measure(lambda: Inventory.load(saved), args.rounds * 4))


if __name__ == "__main__":
    main()
