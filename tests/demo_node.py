"""The built-in demo nodes: the a100 node (nri_accel/demo/inventory.json: 8 x A100, GPU 7
in MIG mode), loaded once, for the test directories that plan containers against it; and
how the mixed node (nri_accel/demo/mixed/inventory.json) is made from the fake roots."""

from __future__ import annotations

import functools
from pathlib import Path
from types import MappingProxyType

from fakes.roots import materialise

from nri_accel.config import Config
from nri_accel.discover import discover
from nri_accel.inventory import Inventory

DEMO_INVENTORY = Path(__file__).resolve().parents[1] / "nri_accel" / "demo" / "inventory.json"
MIXED_ROOTS = ("gaudi2-hls", "mi300x")  # fake roots: an HLS-Gaudi2 node, a 4 x MI300X node


@functools.cache
def demo_inventory() -> Inventory:
    return Inventory.load(DEMO_INVENTORY)


def mixed_inventory(tmp: Path) -> Inventory:
    """The mixed demo node: the devices and drivers discovery finds on each of MIXED_ROOTS
    (materialised under `tmp`), on one node. Their problems are left out: they describe
    those roots (no NVIDIA driver there, a symlink planted at /dev/accel/accel7), not the
    demo node."""
    found = [discover(materialise(name, tmp / name), Config()) for name in MIXED_ROOTS]
    return Inventory(devices=tuple(d for inv in found for d in inv.devices),
                     drivers=MappingProxyType({v: d for inv in found
                                               for v, d in inv.drivers.items()}))
