"""Vendor profiles: one per accelerator family, and the registry the generic stages loop
over.

Owns: PROFILES (the registered families, in discovery order) and the lookups the generic
stages use: family_of() (the profile owning a kind), READ_ENV (every variable some
family reads). Imports the family modules; each family module imports
nri_accel.vendors.base, never this package's registry. The interface a family
implements, with the NVIDIA profile as the worked example and the steps to add a
family, is written down in nri_accel/vendors/base.py.

Order matters in one place: discovery runs the families in this order, the native ones
first, the generic CDI family (specs and static devices) last.
"""

from __future__ import annotations

from nri_accel.vendors import amd, cdi, gaudi, neuron, nvidia
from nri_accel.vendors.base import Profile

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
