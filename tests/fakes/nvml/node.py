"""A materialised fake root seen from the fake libnvidia-ml's side (tests/fakes/nvml):
its NVML library, its node description and the events file the fake reads while NVML
is in use, where tests write what the driver would raise (XIDs, ECC errors, a GPU
falling off the bus)."""

from __future__ import annotations

from pathlib import Path

from nri_accel.discover.hostroot import HostRoot
from nri_accel.vendors.nvidia.discover import nvml_library


class FakeNode:
    def __init__(self, root: HostRoot) -> None:
        self.root = root
        lib = nvml_library(root)
        assert lib is not None, "the fake root has no libnvidia-ml"
        self.lib = lib
        self.events = Path(lib).with_name("fake_nvml.events")
        self.conf = Path(lib).with_name("fake_nvml.conf")

    def inject(self, *lines: str) -> None:
        """Append event lines ("xid <uuid> 79", "lost <uuid>", ...) to the events file."""
        with self.events.open("a") as f:
            f.writelines(line + "\n" for line in lines)

    def set_gpu_key(self, uuid: str, line: str) -> None:
        """End GPU `uuid`'s own lines in the node description (read at nvmlInit) with
        `line`, which so wins over an earlier line with the same key."""
        lines = self.conf.read_text().splitlines()
        at = lines.index(f"uuid {uuid}") + 1
        while at < len(lines) and lines[at].strip() not in ("gpu", "mig"):
            at += 1
        lines.insert(at, line)
        self.conf.write_text("\n".join(lines) + "\n")
