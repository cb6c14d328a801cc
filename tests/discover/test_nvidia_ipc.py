"""Where the NVIDIA IPC sockets are looked for: /var/run and /run, on hosts where one is
a link to the other (a100-mig: /var/run -> ../run) and where they are separate
directories (a100-mig-nocaps: /var/run is a real directory). Each socket found is
mounted at its own path; the last path component is never followed."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from nri_accel.discover.hostroot import HostRoot
from nri_accel.vendors.nvidia.discover import discover_nvidia

FakeRoot = Callable[[str], HostRoot]
PERSIST = "nvidia-persistenced/socket"
FABRIC = "nvidia-fabricmanager/socket"


def ipc_mounts(root: HostRoot) -> tuple[dict[str, str], dict[str, str]]:
    """(container path -> host path of the utility capability's sockets, problems)."""
    found = discover_nvidia(root)
    (drv,) = found.drivers
    sockets = {m.container_path: m.host_path for m in drv.capabilities["utility"].mounts
               if m.container_path.endswith("/socket")}
    for m in drv.capabilities["utility"].mounts:
        if m.container_path.endswith("/socket"):
            assert {"ro", "nosuid", "nodev", "noexec", "bind"} <= set(m.options)
    return sockets, {p.source: p.message for p in found.problems
                     if "socket" in p.source}


def make_socket(root: HostRoot, host_path: str) -> None:
    p = Path(root.local(host_path))
    p.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(p, stat.S_IFSOCK | 0o666)


def bare(fake_root: FakeRoot) -> HostRoot:
    """a100-mig-nocaps (separate /var/run and /run) without its two sockets."""
    root = fake_root("a100-mig-nocaps")
    for path in (f"/var/run/{PERSIST}", f"/run/{FABRIC}"):
        os.unlink(root.local(path))
        os.rmdir(os.path.dirname(root.local(path)))
    return root


def test_linked_layout_gives_one_mount_at_run(fake_root: FakeRoot) -> None:
    # /var/run -> ../run: both lookups reach the same socket, mounted once, at /run.
    sockets, problems = ipc_mounts(fake_root("a100-mig"))
    assert sockets == {f"/run/{PERSIST}": f"/run/{PERSIST}",
                       f"/run/{FABRIC}": f"/run/{FABRIC}"}
    assert problems == {}


def test_separate_layout_finds_each_socket_where_it_is(fake_root: FakeRoot) -> None:
    sockets, problems = ipc_mounts(fake_root("a100-mig-nocaps"))
    assert sockets == {f"/var/run/{PERSIST}": f"/var/run/{PERSIST}",
                       f"/run/{FABRIC}": f"/run/{FABRIC}"}
    assert problems == {}


# (sockets created, links created (path, target), expected mounts, expected problem paths)
CASES = [
    ([f"/var/run/{PERSIST}"], [], [f"/var/run/{PERSIST}"], []),
    ([f"/run/{PERSIST}"], [], [f"/run/{PERSIST}"], []),
    ([f"/run/{FABRIC}"], [], [f"/run/{FABRIC}"], []),
    ([f"/var/run/{FABRIC}"], [], [f"/var/run/{FABRIC}"], []),
    # two daemons' worth of sockets (a stale one beside a live one): both are mounted,
    # each at its own path; clients open the one they know
    ([f"/var/run/{PERSIST}", f"/run/{PERSIST}"], [],
     [f"/var/run/{PERSIST}", f"/run/{PERSIST}"], []),
    # a socket's directory linked to the other run directory: resolved in the root,
    # mounted once where it really is
    ([f"/run/{PERSIST}"], [("/var/run/nvidia-persistenced", "/run/nvidia-persistenced")],
     [f"/run/{PERSIST}"], []),
    # the last component is never followed: a link there is reported and left out
    ([f"/var/run/{PERSIST}"], [(f"/run/{PERSIST}", f"/var/run/{PERSIST}")],
     [f"/var/run/{PERSIST}"], [f"/run/{PERSIST}"]),
    ([], [(f"/run/{FABRIC}", "/etc/shadow")], [], [f"/run/{FABRIC}"]),
]


@pytest.mark.parametrize(("create", "links", "mounted", "refused"), CASES)
def test_run_and_var_run_lookups(fake_root: FakeRoot, create: list[str],
                                 links: list[tuple[str, str]], mounted: list[str],
                                 refused: list[str]) -> None:
    root = bare(fake_root)
    for path in create:
        make_socket(root, path)
    for path, target in links:
        link = Path(root.local(path))
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link)
    sockets, problems = ipc_mounts(root)
    assert sockets == {p: p for p in mounted}
    assert sorted(problems) == sorted(refused)
    for path in refused:
        assert problems[path] == "is not a socket (a symlink is not followed): it is not mounted"


def test_a_regular_file_where_the_socket_should_be_is_refused(fake_root: FakeRoot) -> None:
    root = bare(fake_root)
    Path(root.local(f"/run/{PERSIST}")).parent.mkdir(parents=True, exist_ok=True)
    Path(root.local(f"/run/{PERSIST}")).write_text("")
    sockets, problems = ipc_mounts(root)
    assert sockets == {}
    assert list(problems) == [f"/run/{PERSIST}"]


def test_a_listening_socket_is_found(fake_root: FakeRoot,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # a real bound unix socket, as a running daemon leaves it (bound by a relative name:
    # the tree's absolute path is longer than a unix socket address may be)
    root = bare(fake_root)
    path = Path(root.local(f"/run/{PERSIST}"))
    path.parent.mkdir(parents=True)
    monkeypatch.chdir(path.parent)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path.name)
        s.listen()
        sockets, problems = ipc_mounts(root)
    assert sockets == {f"/run/{PERSIST}": f"/run/{PERSIST}"} and problems == {}


def test_mps_pipe_directory_stays_in_tmp(fake_root: FakeRoot) -> None:
    # CUDA's default CUDA_MPS_PIPE_DIRECTORY; no run directory is looked at for it.
    root = fake_root("a100-mig-nocaps")
    os.makedirs(root.local("/run/nvidia-mps"))
    (drv,) = discover_nvidia(root).drivers
    compute = {m.container_path for m in drv.capabilities["compute"].mounts}
    assert "/tmp/nvidia-mps" in compute and "/run/nvidia-mps" not in compute


def mps_mounted(root: HostRoot) -> tuple[bool, dict[str, str]]:
    found = discover_nvidia(root)
    (drv,) = found.drivers
    mounted = "/tmp/nvidia-mps" in {m.container_path for m in drv.capabilities["compute"].mounts}
    return mounted, {p.source: p.message for p in found.problems if "nvidia-mps" in p.source
                     or "persistenced" in p.source}


def test_an_ipc_path_another_user_could_replace_is_not_mounted(fake_root: FakeRoot) -> None:
    # The runtime resolves a mount source again when it mounts it: a path that anyone but
    # root could replace after discovery by a link (to /var/lib/kubelet, to /root) would
    # bind that into every GPU container (CVE-2024-0132 was such a swap).
    root = fake_root("a100-mig")
    os.chmod(root.local("/tmp"), 0o1777)  # world-writable and sticky, as on a host
    assert mps_mounted(root) == (True, {})  # root's own, in a sticky /tmp: only root
    os.chown(root.local("/tmp/nvidia-mps"), 1000, 1000)  # made by a user before MPS ran
    mounted, problems = mps_mounted(root)
    assert not mounted
    assert problems["/tmp/nvidia-mps"].startswith(
        "uid 1000, the owner of /tmp/nvidia-mps, could replace it")
    os.chown(root.local("/tmp/nvidia-mps"), 0, 0)
    os.chmod(root.local("/tmp"), 0o777)  # writable by all, not sticky: anyone could
    assert "anyone who may write to /tmp" in mps_mounted(root)[1]["/tmp/nvidia-mps"]
    # nvidia-persistenced --user (Ubuntu's unit): root gave it its run directory, and
    # only it may replace what is there; a directory anyone may write to is refused
    os.chown(root.local("/run/nvidia-persistenced"), 1000, 1000)
    assert f"/run/{PERSIST}" in ipc_mounts(root)[0]
    os.chmod(root.local("/run/nvidia-persistenced"), 0o777)
    sockets, problems = ipc_mounts(root)
    assert f"/run/{PERSIST}" not in sockets
    assert problems[f"/run/{PERSIST}"].startswith(
        "anyone who may write to /run/nvidia-persistenced could replace it")
