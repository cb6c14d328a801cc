"""Vendor profiles: one per accelerator family, and the registry the generic stages loop
over.

Owns: PROFILES (the registered families, in discovery order) and the lookups the generic
stages use: family_of() (the profile owning a kind), parent_of() (the whole a device is a
part of). Imports the family modules; each family module imports
nri_accel.vendors.base, never this package's registry. The interface a family
implements, with the NVIDIA profile as the worked example and the steps to add a
family, is written down in nri_accel/vendors/base.py.

Order matters in one place: discovery runs the families in this order, the native ones
first, the generic CDI family (specs and static devices) last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nri_accel.vendors import amd, cdi, gaudi, neuron, nvidia
from nri_accel.vendors.base import Profile

if TYPE_CHECKING:
    from nri_accel.inventory import Device, Inventory

PROFILES: tuple[Profile, ...] = (
    nvidia.PROFILE,
    neuron.PROFILE,
    gaudi.PROFILE,
    amd.PROFILE,
    cdi.PROFILE,
)

_BY_KIND = {kind: p for p in PROFILES for kind in p.kinds}
GENERIC = cdi.PROFILE


def family_of(kind: str) -> Profile:
    """The profile that owns `kind`: the native family that discovers it, else CDI."""
    return _BY_KIND.get(kind, GENERIC)


def by_name(name: str) -> Profile | None:
    return next((p for p in PROFILES if p.name == name), None)


def parent_of(device: Device, inventory: Inventory) -> Device | None:
    """The device `device` is a part of (a MIG device's GPU, a NeuronCore's Neuron
    device): its `parent` among its family's kinds, the whole's kind first. A partition
    of a PCI function (Device.partition: an AMD GPU in CPX mode) is a part of that
    function, which no inventory lists (it is not grantable while partitioned): the
    whole returned is that function under the key its family gives it whole
    (Profile.partition_whole: an AMD GPU's UUID), so that a container holding the GPU
    whole before a change of partition mode holds every partition after it, and one
    holding a partition holds the whole GPU after the change back."""
    if device.partition is not None and device.pci_bus_id:
        return family_of(device.kind).partition_whole(device)
    if not device.parent:
        return None
    for kind in family_of(device.kind).kinds:
        found = inventory.find(kind, device.parent)
        if found is not None and found is not device:
            return found
    return None
