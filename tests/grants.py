"""Helpers shared by the test directories that plan containers through an Engine: what
the NRI handler does with a deliverable answer (admit), and the holdings named the way
tests name devices (held, key)."""

from __future__ import annotations

from nri_accel.container import ContainerInfo
from nri_accel.engine import Engine, Plan
from nri_accel.inventory import Inventory


def admit(engine: Engine, info: ContainerInfo) -> Plan:
    """What the NRI handler does with an answer it can deliver: plan, then commit."""
    plan = engine.plan(info)
    engine.commit(plan)
    return plan


def held(engine: Engine) -> dict[str, tuple[str, ...]]:
    """Container id -> qualified names of the devices it holds exclusively (a key the
    inventory does not know is shown as it is)."""
    names = {d.key: d.qualified_name for d in engine.inventory.devices}
    return {g.container_id: tuple(sorted(names.get(k, k) for k in g.exclusive))
            for g in engine.holdings.grants() if g.exclusive}


def key(inventory: Inventory, qualified: str) -> str:
    """The holdings key (Device.key: kind and UUID, partition id, PCI bus id or name) of a
    device named by its qualified name ("nvidia.com/gpu=0")."""
    return next(d.key for d in inventory.devices if d.qualified_name == qualified)
