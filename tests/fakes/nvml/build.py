"""Compile the fake libnvidia-ml (fake_nvml.c) with the system C compiler.

Owns: the compiler command line and the build variants. Imports the standard library.

The fake stands for NVIDIA's libnvidia-ml.so.1 (see README.md beside this file). It is
built by the tests, never committed: `library(variant)` compiles it once per process
into a temporary directory removed at exit; `build(out_dir, variant)` compiles it
into a directory of the caller's choosing. Variants leave symbols out to mimic older
drivers ("omit-numa": no nvmlDeviceGetNumaNodeId, as before driver 535;
"omit-event-wait-v2": no nvmlEventSetWait_v2, as before R450, only the unversioned
nvmlEventSetWait).

Command line use: ``PYTHONPATH=tests python -m fakes.nvml.build OUT_DIR [VARIANT]``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("fake_nvml.c")

# Variant name -> extra compiler flags.
VARIANTS: dict[str, tuple[str, ...]] = {
    "": (),
    "omit-numa": ("-DFAKE_NVML_OMIT_NUMA",),
    "omit-event-wait-v2": ("-DFAKE_NVML_OMIT_EVENT_WAIT_V2",),
}

_built: dict[str, Path] = {}
_build_dir: Path | None = None


class BuildError(RuntimeError):
    """The fake NVML library could not be compiled (no compiler, or a compile error)."""


class NoCompilerError(BuildError):
    """No C compiler here: tests/conftest.py skips the tests that need the library (or
    fails them under NRI_ACCEL_REQUIRE_CC)."""


NO_COMPILER = ("a C compiler (cc) is needed to build the fake libnvidia-ml.so.1 for the "
               "NVIDIA tests: apt-get install gcc (or set CC)")


def compiler() -> str | None:
    """The C compiler to use: $CC when set (a name on PATH or a path), else cc or gcc."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def build(out_dir: Path, variant: str = "") -> Path:
    """Compile the fake library for `variant` into `out_dir` and return its path."""
    if variant not in VARIANTS:
        raise BuildError(f"unknown fake NVML variant {variant!r} (known: {sorted(VARIANTS)})")
    cc = compiler()
    if not cc:
        given = os.environ.get("CC")
        raise NoCompilerError(NO_COMPILER + (f"; CC={given} is not found" if given else ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / (f"libnvidia-ml-fake-{variant}.so" if variant else "libnvidia-ml-fake.so")
    cmd = [cc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-std=c11",
           "-pthread", "-Wl,-soname,libnvidia-ml.so.1", *VARIANTS[variant], "-o", str(out),
           str(SOURCE), "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return out


def library(variant: str = "") -> Path:
    """The fake library for `variant`, compiled at most once per process."""
    global _build_dir
    if variant not in _built:
        if _build_dir is None:
            _build_dir = Path(tempfile.mkdtemp(prefix="fake-nvml-"))
            atexit.register(shutil.rmtree, _build_dir, True)
        _built[variant] = build(_build_dir, variant)
    return _built[variant]


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m fakes.nvml.build OUT_DIR [VARIANT]")
    print(build(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) == 3 else ""))
