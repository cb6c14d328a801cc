"""What a discoverer returns: devices, drivers and problems of one vendor or source.

Owns: the Found record. Imports nri_accel.inventory only.
"""

from __future__ import annotations

from dataclasses import dataclass

from nri_accel.inventory import Device, Driver, Problem


@dataclass(frozen=True, slots=True)
class Found:
    """One discoverer's result. A discoverer never raises for a missing or broken
    vendor: it returns what it could find and a Problem saying why the rest is absent."""

    devices: tuple[Device, ...] = ()
    drivers: tuple[Driver, ...] = ()
    problems: tuple[Problem, ...] = ()
