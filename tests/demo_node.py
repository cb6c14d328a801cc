"""The built-in demo node (nri_accel/demo/inventory.json: 8 x A100, GPU 7 in MIG mode),
loaded once, for the test directories that plan containers against it."""

from __future__ import annotations

import functools
from pathlib import Path

from nri_accel.inventory import Inventory

DEMO_INVENTORY = Path(__file__).resolve().parents[1] / "nri_accel" / "demo" / "inventory.json"


@functools.cache
def demo_inventory() -> Inventory:
    return Inventory.load(DEMO_INVENTORY)
