"""HostRoot maps host paths into a mounted root, resolving symlinks as the host would."""

from __future__ import annotations

import os
import stat

import pytest

from nri_accel.discover.hostroot import HostRoot


def test_identity_at_slash() -> None:
    assert HostRoot().local("/dev/nvidia0") == "/dev/nvidia0"


def test_relative_and_dotdot_refused(tmp_path) -> None:
    r = HostRoot.at(tmp_path)
    with pytest.raises(ValueError, match="absolute"):
        r.local("dev/x")
    with pytest.raises(ValueError, match=r"'\.\.'"):
        r.local("/dev/../etc/shadow")


def test_absolute_symlink_in_a_parent_stays_inside_the_root(tmp_path) -> None:
    # A host's /var/run -> /run: read the host's /run, not this process's.
    (tmp_path / "run" / "cdi").mkdir(parents=True)
    (tmp_path / "run" / "cdi" / "x.yaml").write_text("host spec")
    (tmp_path / "var").mkdir()
    os.symlink("/run", tmp_path / "var" / "run")
    r = HostRoot.at(tmp_path)
    assert r.local("/var/run/cdi/x.yaml") == str(tmp_path / "run" / "cdi" / "x.yaml")
    assert r.read_text("/var/run/cdi/x.yaml") == "host spec"


def test_relative_symlink_cannot_climb_out_of_the_root(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    os.symlink("../../../../etc", tmp_path / "a" / "up")
    r = HostRoot.at(tmp_path)
    assert r.local("/a/up/passwd") == str(tmp_path / "etc" / "passwd")


def test_last_component_is_not_followed(tmp_path) -> None:
    (tmp_path / "dev").mkdir()
    os.symlink("/dev/null", tmp_path / "dev" / "nvidia0")
    r = HostRoot.at(tmp_path)
    assert r.local("/dev/nvidia0") == str(tmp_path / "dev" / "nvidia0")
    assert stat.S_ISLNK(r.lstat("/dev/nvidia0").st_mode)  # the link, not /dev/null


def test_listdir_follows_a_last_link_inside_the_root(tmp_path) -> None:
    # /dev/nvidia-caps -> /etc on the host is the host's /etc, never this process's
    (tmp_path / "dev").mkdir()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "host-only").write_text("")
    os.symlink("/etc", tmp_path / "dev" / "nvidia-caps")
    r = HostRoot.at(tmp_path)
    assert r.listdir("/dev/nvidia-caps") == ["host-only"]
    os.symlink("/nowhere", tmp_path / "dev" / "gone")
    assert r.listdir("/dev/gone") == []


def test_symlink_loop_is_an_error(tmp_path) -> None:
    os.symlink("/b", tmp_path / "a")
    os.symlink("/a", tmp_path / "b")
    with pytest.raises(OSError, match="symbolic links"):
        HostRoot.at(tmp_path).local("/a/file")


def test_resolve_follows_every_link_inside_the_root_and_keeps_missing_parts(tmp_path) -> None:
    # What a bind mount's source names once the runtime has followed its links.
    (tmp_path / "var" / "lib" / "kubelet").mkdir(parents=True)
    (tmp_path / "opt").mkdir()
    os.symlink("/var/lib/kubelet", tmp_path / "opt" / "k")  # absolute: a host path
    os.symlink("../var/lib", tmp_path / "opt" / "lib")  # relative: from /opt
    r = HostRoot.at(tmp_path)
    assert r.resolve("/opt/k/device-plugins") == "/var/lib/kubelet/device-plugins"
    assert r.resolve("/opt/lib") == "/var/lib"
    assert r.resolve("/usr/lib/missing.so") == "/usr/lib/missing.so"
    with pytest.raises(ValueError, match="absolute"):
        r.resolve("opt/k")


# ---- writes (discovery creating device nodes the driver left uncreated) -----------------


def test_makedirs_mknod_and_symlink_inside_the_root(tmp_path) -> None:
    (tmp_path / "dev").mkdir(mode=0o755)
    r = HostRoot.at(tmp_path)
    r.makedirs("/dev/nvidia-caps", 0o755)
    r.mknod_char("/dev/nvidia-caps/nvidia-cap21", 236, 21, 0o444)
    r.makedirs("/dev/char", 0o755)
    r.symlink("/dev/char/236:21", "../nvidia-caps/nvidia-cap21")
    st = os.lstat(tmp_path / "dev/nvidia-caps/nvidia-cap21")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(236, 21)
    assert stat.S_IMODE(st.st_mode) == 0o444
    assert stat.S_IMODE(os.lstat(tmp_path / "dev/nvidia-caps").st_mode) == 0o755
    assert os.readlink(tmp_path / "dev/char/236:21") == "../nvidia-caps/nvidia-cap21"
    r.makedirs("/dev/nvidia-caps", 0o755)  # exists: fine


def test_exact_mode_whatever_the_umask(tmp_path) -> None:
    (tmp_path / "dev").mkdir(mode=0o755)
    old = os.umask(0o077)
    try:
        HostRoot.at(tmp_path).mknod_char("/dev/x", 1, 3, 0o666)
        HostRoot.at(tmp_path).makedirs("/dev/d", 0o755)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(tmp_path / "dev/x").st_mode) == 0o666
    assert stat.S_IMODE(os.lstat(tmp_path / "dev/d").st_mode) == 0o755


def test_existing_entries_are_never_replaced(tmp_path) -> None:
    (tmp_path / "dev").mkdir(mode=0o755)
    (tmp_path / "dev" / "x").write_text("keep")
    r = HostRoot.at(tmp_path)
    with pytest.raises(FileExistsError):
        r.mknod_char("/dev/x", 1, 3, 0o666)
    with pytest.raises(FileExistsError):
        r.symlink("/dev/x", "y")
    assert (tmp_path / "dev" / "x").read_text() == "keep"
    with pytest.raises(NotADirectoryError):
        r.makedirs("/dev/x/y")


def test_writes_refuse_a_symlinked_or_shared_directory(tmp_path) -> None:
    (tmp_path / "dev").mkdir(mode=0o755)
    (tmp_path / "elsewhere").mkdir(mode=0o755)
    os.symlink("/elsewhere", tmp_path / "dev" / "nvidia-caps")
    r = HostRoot.at(tmp_path)
    with pytest.raises(NotADirectoryError):
        r.mknod_char("/dev/nvidia-caps/nvidia-cap1", 236, 1, 0o444)
    with pytest.raises(NotADirectoryError):
        r.makedirs("/dev/nvidia-caps/sub")
    assert list((tmp_path / "elsewhere").iterdir()) == []
    (tmp_path / "tmp").mkdir()
    os.chmod(tmp_path / "tmp", 0o1777)  # others could swap the entry before its chmod
    with pytest.raises(PermissionError, match="writable by others"):
        r.mknod_char("/tmp/x", 1, 3, 0o666)
