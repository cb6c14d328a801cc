"""Builders of small host trees for discovery tests.

A HostTree stands for a node's filesystem as nri-accel reads it through a HostRoot:
real character devices (mknod; tests run as root, as in CI), sysfs and procfs files as
plain files, symlinks where a node has them. Paths are host paths ("/dev/neuron0").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from nri_accel.discover.hostroot import HostRoot


class HostTree:
    def __init__(self, base: Path) -> None:
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        self.root = HostRoot.at(base)

    def path(self, host_path: str) -> Path:
        return self.base / host_path.lstrip("/")

    def chardev(self, host_path: str, major: int, minor: int) -> None:
        p = self.path(host_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() or p.is_symlink():
            p.unlink()
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(major, minor))

    def blockdev(self, host_path: str, major: int, minor: int) -> None:
        p = self.path(host_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(p, stat.S_IFBLK | 0o660, os.makedev(major, minor))

    def file(self, host_path: str, text: str = "") -> None:
        p = self.path(host_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def symlink(self, host_path: str, target: str) -> None:
        p = self.path(host_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, p)

    def remove(self, host_path: str) -> None:
        self.path(host_path).unlink()
