"""A PCI address in a request names the device whose PCI function it is, or that answers
to it: never a part that only carries its GPU's address (a MIG device, an AMD compute
partition), nor one of several devices sharing it (select.DeviceIndex.resolve)."""

from __future__ import annotations

from dataclasses import replace as changed
from pathlib import Path

from msgspec.structs import replace

from nri_accel.inventory import Inventory
from nri_accel.select import DeviceIndex

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "discover"


def test_a_gpu_address_names_the_gpu_not_its_mig_devices() -> None:
    index = DeviceIndex(Inventory.load(GOLDEN / "a100-mig.json"))
    gpu, replica = index.resolve("nvidia.com/gpu", "00000000:07:00.0")  # any padding
    assert (gpu is not None and gpu.qualified_name, replica) == ("nvidia.com/gpu=0", False)
    assert index.resolve("nvidia.com/mig", "0000:07:00.0") == (None, False)
    mig, _ = index.resolve("nvidia.com/mig", "0:1")  # by name, as ever
    assert mig is not None and mig.pci_bus_id == "0000:07:00.0"


def test_an_address_several_devices_share_names_none_of_them() -> None:
    inv = Inventory.load(GOLDEN / "a100-mig.json")
    gpus = [d for d in inv.devices if d.kind == "nvidia.com/gpu"]
    # two whole devices on one PCI function, neither answering to it (no alias): which
    # one the address means cannot be known
    twins = (replace(gpus[0], aliases=()), replace(gpus[1], aliases=(),
                                                   pci_bus_id=gpus[0].pci_bus_id))
    index = DeviceIndex(changed(inv, devices=twins))
    assert index.resolve("nvidia.com/gpu", gpus[0].pci_bus_id) == (None, False)
    assert index.resolve("nvidia.com/gpu", "1")[0] == twins[1]
