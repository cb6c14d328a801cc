"""The NVML adapter: the one module of nri-accel that imports pynvml.

Owns: loading a given libnvidia-ml file into pynvml, one query of everything discovery
needs, and shutting NVML down again. Imports pynvml, ctypes and the standard library.
Returns plain frozen data (NvmlSnapshot); nri_accel.discover.nvidia turns it into
Devices. Runs at discovery time only, never on a CreateContainer.

pynvml loads "libnvidia-ml.so.1" by bare name into a module global (`pynvml.nvmlLib`)
and caches function pointers (`pynvml._nvmlGetFunctionPointer_cache`). To load the
file discovery located inside the driver root, and to be called again with another
root (tests, a driver upgrade), `query` installs its own CDLL handle into both under
a lock and clears them after nvmlShutdown, so every call starts clean.

Older drivers lack some functions: pynvml raises NVMLError_FunctionNotFound (symbol
absent from the library) or the pynvml build lacks the wrapper (AttributeError). Such
a field is left empty and the function is named once in `NvmlSnapshot.missing`.
NVML_ERROR_NOT_SUPPORTED also leaves the field empty, silently: it is the device's
answer, not a defect.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import pynvml

_LOCK = threading.Lock()
_MISSING = (pynvml.NVMLError_FunctionNotFound, AttributeError)
_NOT_SUPPORTED = pynvml.NVMLError_NotSupported


class NvmlUnavailable(Exception):
    """NVML cannot be used at all (library not loadable, nvmlInit failed)."""


@dataclass(frozen=True, slots=True)
class LinkInfo:
    """One active NVLink: remote device type (0 GPU, 1 IBM NPU, 2 NVSwitch; None when
    the driver cannot say) and the remote end's PCI bus id as NVML writes it."""

    link: int
    remote_type: int | None
    remote_bus_id: str


@dataclass(frozen=True, slots=True)
class MigInfo:
    """One MIG device (a GPU instance + compute instance) of a GPU."""

    index: int  # position in nvmlDeviceGetMigDeviceHandleByIndex
    uuid: str
    name: str
    gi: int
    ci: int
    memory_total: int | None  # bytes
    gi_slices: int | None
    ci_slices: int | None
    memory_size_mb: int | None  # from the device attributes


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU as NVML reports it; None where NVML could not tell."""

    index: int
    uuid: str
    minor: int
    name: str
    pci_bus_id: str  # NVML's form, "00000000:07:00.0"
    brand: int | None
    arch: int | None
    compute_capability: tuple[int, int] | None
    memory_total: int | None  # bytes
    numa_node: int | None
    mig_current: int | None  # None: not MIG capable
    mig_pending: int | None
    migs: tuple[MigInfo, ...]
    links: tuple[LinkInfo, ...]


@dataclass(frozen=True, slots=True)
class NvmlSnapshot:
    """Everything one NVML session told: driver, GPUs, and what it could not answer."""

    driver_version: str
    cuda_version: int | None  # e.g. 12040
    gpus: tuple[GpuInfo, ...]
    missing: tuple[str, ...]  # NVML functions the driver lacks, sorted
    errors: tuple[str, ...]  # other failures, one line each, in discovery order


def query(library: str) -> NvmlSnapshot:
    """Load the NVML library file at `library` (a path this process can open), query
    it, shut NVML down. Raises NvmlUnavailable when the library cannot be loaded or
    initialised."""
    if not hasattr(pynvml, "_nvmlGetFunctionPointer_cache"):
        raise NvmlUnavailable("this pynvml (nvidia-ml-py) lacks the function cache "
                              "nri-accel resets; nvidia-ml-py >= 12.535 is required")
    with _LOCK:
        try:
            handle = ctypes.CDLL(library)
        except OSError as e:
            raise NvmlUnavailable(f"cannot load {library}: {e}") from e
        pynvml.nvmlLib = handle
        pynvml._nvmlGetFunctionPointer_cache.clear()
        try:
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as e:
                raise NvmlUnavailable(f"nvmlInit failed: {e}") from e
            try:
                return _Session().snapshot()
            except pynvml.NVMLError as e:
                raise NvmlUnavailable(f"NVML query failed: {e}") from e
            finally:
                # The handle is dropped below whatever NVML answers here.
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlShutdown()
        finally:
            pynvml.nvmlLib = None
            pynvml._nvmlGetFunctionPointer_cache.clear()


class _Session:
    """One NVML query, collecting what is missing and what failed."""

    def __init__(self) -> None:
        self.missing: set[str] = set()
        self.errors: list[str] = []

    def opt(self, name: str, *args: Any, what: str) -> Any:
        """pynvml.<name>(*args), or None where the driver (or pynvml) lacks it, the device
        does not support it, or it fails (a failure other than "not supported" is
        recorded against `what`)."""
        try:
            return getattr(pynvml, name)(*args)
        except _MISSING:
            self.missing.add(name)
        except _NOT_SUPPORTED:
            pass
        except pynvml.NVMLError as e:
            self.errors.append(f"{what}: {name} failed: {e}")
        return None

    def snapshot(self) -> NvmlSnapshot:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = self.opt("nvmlSystemGetCudaDriverVersion_v2", what="driver")
        if cuda is None:
            cuda = self.opt("nvmlSystemGetCudaDriverVersion", what="driver")
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                gpus.append(self.gpu(index))
            except pynvml.NVMLError as e:
                self.errors.append(f"GPU {index}: left out: {e}")
        if cuda is not None:  # found through the _v1 fallback: _v2 missing is no defect
            self.missing.discard("nvmlSystemGetCudaDriverVersion_v2")
        return NvmlSnapshot(driver, cuda, tuple(gpus), tuple(sorted(self.missing)),
                            tuple(self.errors))

    def gpu(self, index: int) -> GpuInfo:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        what = f"GPU {index}"
        mem = self.opt("nvmlDeviceGetMemoryInfo", h, what=what)
        cc = self.opt("nvmlDeviceGetCudaComputeCapability", h, what=what)
        mig = self.opt("nvmlDeviceGetMigMode", h, what=what)
        numa = self.opt("nvmlDeviceGetNumaNodeId", h, what=what)
        return GpuInfo(
            index=index,
            uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
            minor=pynvml.nvmlDeviceGetMinorNumber(h),
            name=_text(pynvml.nvmlDeviceGetName(h)),
            pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(h).busId),
            brand=self.opt("nvmlDeviceGetBrand", h, what=what),
            arch=self.opt("nvmlDeviceGetArchitecture", h, what=what),
            compute_capability=tuple(cc) if cc is not None else None,  # type: ignore[arg-type]
            memory_total=mem.total if mem is not None else None,
            numa_node=numa if numa is not None and 0 <= numa < 1 << 31 else None,
            mig_current=mig[0] if mig is not None else None,
            mig_pending=mig[1] if mig is not None else None,
            migs=self.migs(h, what) if mig is not None and mig[0] else (),
            links=self.links(h, what),
        )

    def migs(self, h: Any, what: str) -> tuple[MigInfo, ...]:
        count = self.opt("nvmlDeviceGetMaxMigDeviceCount", h, what=what) or 0
        out = []
        for i in range(count):
            try:
                m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except pynvml.NVMLError_NotFound:
                continue  # an empty slot: MIG devices need not be contiguous
            except pynvml.NVMLError as e:
                self.errors.append(f"{what}: MIG device {i}: left out: {e}")
                continue
            where = f"{what} MIG device {i}"
            try:
                uuid = _text(pynvml.nvmlDeviceGetUUID(m))
                gi = pynvml.nvmlDeviceGetGpuInstanceId(m)
                ci = pynvml.nvmlDeviceGetComputeInstanceId(m)
            except pynvml.NVMLError as e:
                self.errors.append(f"{where}: left out: {e}")
                continue
            mem = self.opt("nvmlDeviceGetMemoryInfo", m, what=where)
            attrs = self.opt("nvmlDeviceGetAttributes", m, what=where)
            name = self.opt("nvmlDeviceGetName", m, what=where)
            out.append(MigInfo(
                index=i, uuid=uuid, name=_text(name) if name is not None else "", gi=gi, ci=ci,
                memory_total=mem.total if mem is not None else None,
                gi_slices=attrs.gpuInstanceSliceCount if attrs is not None else None,
                ci_slices=attrs.computeInstanceSliceCount if attrs is not None else None,
                memory_size_mb=attrs.memorySizeMB if attrs is not None else None,
            ))
        return tuple(out)

    def links(self, h: Any, what: str) -> tuple[LinkInfo, ...]:
        out = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                active = pynvml.nvmlDeviceGetNvLinkState(h, link)
            except _MISSING:
                self.missing.add("nvmlDeviceGetNvLinkState")
                break
            except (_NOT_SUPPORTED, pynvml.NVMLError_InvalidArgument):
                if link == 0:
                    break  # no NVLink on this GPU
                continue  # past this GPU's links, or a link slot not wired
            except pynvml.NVMLError as e:
                self.errors.append(f"{what}: NVLink {link}: {e}")
                continue
            if not active:
                continue
            pci = self.opt("nvmlDeviceGetNvLinkRemotePciInfo", h, link, what=what)
            if pci is None:
                continue
            remote = self.opt("nvmlDeviceGetNvLinkRemoteDeviceType", h, link, what=what)
            out.append(LinkInfo(link, remote, _text(pci.busId)))
        return tuple(out)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
