"""The generic CDI family: every device a CDI spec file or the config's static devices
describe, whatever its vendor.

Owns: CdiProfile (PROFILE): discovery of static devices (.static) and CDI specs (.spec),
in that order (the operator's own config wins over vendor files), and their change
probe. Imports nri_accel.discover.{base, hostroot, probe}, nri_accel.vendors.base and
this package's spec and static modules.

It has no env grammar and no rules: its devices are requested by annotation or CDI
request (cdi.k8s.io/*, `vendor/class=name`), each brings its own edits and its spec's
container edits (the Driver "cdi:<spec file>"). It is not native: a kind a native family
discovers (nvidia.com/gpu, ...) is served by that family alone, and the same kind in a
spec is ignored with a Problem (nri_accel.discover.assemble).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nri_accel.discover.base import Found
from nri_accel.discover.probe import State, entries, node_state
from nri_accel.vendors.base import Profile

if TYPE_CHECKING:
    from nri_accel.config import Config
    from nri_accel.discover.hostroot import HostRoot

NAME = "cdi"


class CdiProfile(Profile):
    name = NAME
    native = False

    def discover(self, root: HostRoot, config: Config) -> Found:
        from nri_accel.vendors.cdi.spec import discover_cdi
        from nri_accel.vendors.cdi.static import discover_static

        static = discover_static(root, config.static_devices)
        specs = discover_cdi(root, config.discovery.cdi_spec_dirs)
        return Found(devices=static.devices + specs.devices,
                     drivers=static.drivers + specs.drivers,
                     problems=static.problems + specs.problems)

    def probe(self, root: HostRoot, config: Config) -> State:
        """Each spec directory and its files (name, size, mtime, inode), and the nodes of
        the static devices."""
        out: State = []
        for spec_dir in config.discovery.cdi_spec_dirs:
            out.append(node_state(root, spec_dir))
            out.extend(entries(root, spec_dir, content=True))
        for entry in config.static_devices:
            out.extend(node_state(root, path) for path in entry.device_nodes)
        return out


PROFILE = CdiProfile()
