"""The test fakes themselves: fakes.roots.materialise (fake host roots) and the fake
libnvidia-ml's own error reporting. Other tests trust them, so they are checked too."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from fakes import roots
from fakes.roots import FakeRootError, materialise

from nri_accel.discover.elf import read_elf
from nri_accel.discover.ldcache import parse_ld_so_cache
from nri_accel.vendors.nvidia.discover import discover_nvidia


def test_materialise_creates_nodes_links_sockets_and_the_fake_library(tmp_path: Path) -> None:
    root = materialise("a100-mig", tmp_path / "node")
    st = os.lstat(root.local("/dev/nvidia3"))
    assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, 3)
    assert os.readlink(root.local("/dev/char/195:3")) == "../nvidia3"
    assert stat.S_ISSOCK(os.lstat(root.local("/run/nvidia-persistenced/socket")).st_mode)
    assert os.path.isdir(root.local("/tmp/nvidia-mps"))
    lib = root.local("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15")
    info = read_elf(lib)
    assert info is not None and info.soname == "libnvidia-ml.so.1"
    assert os.path.exists(os.path.join(os.path.dirname(lib), roots.FAKE_NVML_CONF_NAME))
    assert os.path.getsize(root.local("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15")) == 0


def test_ld_so_cache_is_written_in_the_driver_root(tmp_path: Path) -> None:
    root = materialise("h100", tmp_path / "node")
    assert root.driver_root == "/run/nvidia/driver"
    with open(root.local("/run/nvidia/driver/etc/ld.so.cache"), "rb") as f:
        keys = {e.key for e in parse_ld_so_cache(f.read())}
    assert {"libcuda.so.1", "libnvidia-ml.so.1"} <= keys
    assert not os.path.exists(root.local("/etc/ld.so.cache"))


def test_unknown_root_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(FakeRootError, match=r"no such fake root.*a100-mig"):
        materialise("nope", tmp_path / "x")


@pytest.mark.parametrize(("line", "error"), [
    ("c 195 /dev/nvidia0", "cannot parse"),
    ("l /dev/a b", "cannot parse"),
    ("c 195 0 dev/nvidia0", "must be absolute"),
    ("c 195 0 /dev/../../etc/x", "without '..'"),
])
def test_bad_devices_lines_name_file_and_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              line: str, error: str) -> None:
    (tmp_path / "roots/bad/tree").mkdir(parents=True)
    (tmp_path / "roots/bad/devices.txt").write_text(f"# comment\n{line}\n")
    monkeypatch.setattr(roots, "ROOTS_DIR", tmp_path / "roots")
    with pytest.raises(FakeRootError, match=rf"devices.txt:2: .*{error}"):
        materialise("bad", tmp_path / "node")


def test_fake_nvml_reports_a_bad_description(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    root = materialise("h100", tmp_path / "node")
    conf = tmp_path / "bad.conf"
    conf.write_text("driver_version 1.2.3\n\nbogus_key 1\n")
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(conf))
    found = discover_nvidia(root)
    assert found.devices == ()
    assert "nvmlInit failed: Unknown Error" in found.problems[0].message
    assert f"fake_nvml: {conf}:3: unknown key 'bogus_key'" in capfd.readouterr().err


@pytest.mark.parametrize(("line", "error"), [
    ("events sometimes", "expected 'events none' or 'events <hex event type mask>'"),
    ("row_remapping 0 0 1", "expected 'row_remapping <correctable> <uncorrectable>"),
    ("page_retirement 2", "expected 'page_retirement <pending 0|1>'"),
])
def test_fake_nvml_reports_bad_health_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capfd: pytest.CaptureFixture[str], line: str,
                                           error: str) -> None:
    root = materialise("h100", tmp_path / "node")
    conf = tmp_path / "bad.conf"
    conf.write_text(f"driver_version 1.2.3\ngpu\nuuid GPU-x\n{line}\n")
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(conf))
    found = discover_nvidia(root)
    assert "nvmlInit failed: Unknown Error" in found.problems[0].message
    assert f"fake_nvml: {conf}:4: {error}" in capfd.readouterr().err
