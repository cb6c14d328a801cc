"""The NVML adapter: the one module of nri-accel that imports pynvml.

Owns: loading a given libnvidia-ml file into pynvml, one query of everything discovery
needs (`query`), and the health event watch (`EventWatch`). Imports pynvml, ctypes, msgspec,
nri_accel.log and the standard library. Returns plain frozen data (NvmlSnapshot,
GpuEvent); nri_accel.vendors.nvidia.discover turns snapshots into Devices and
nri_accel.vendors.nvidia.health turns events into health. Never runs on a CreateContainer.

pynvml loads "libnvidia-ml.so.1" by bare name into a module global (`pynvml.nvmlLib`)
and caches function pointers in another (`pynvml._nvmlGetFunctionPointer_cache`). To
load the file discovery located inside the driver root, to be called again with
another root (tests, a driver upgrade), and to let a discovery run while the health
watch holds NVML open, every user here owns its own CDLL handle and its own function
cache and installs both into pynvml's globals only while it calls pynvml, under
`_LOCK` (`_installed`), which clears them again on the way out. NVML itself is
reference counted and thread-safe, so the watch's session (nvmlInit for its whole
life) and a discovery's (nvmlInit ... nvmlShutdown) coexist: the same file is one
library with two references, a different file (a driver upgrade) another library.
The watch's blocking wait is the one NVML call made outside the lock, straight
through its own handle with pynvml's nvmlEventData_t structure and error classes, so
a discovery never waits behind it. (The alternative, one process-wide session shared
by reference count, would tie discovery to the library file the watch loaded: after
a driver upgrade discovery could not load the new one while the watch runs.)

Older drivers lack some functions: pynvml raises NVMLError_FunctionNotFound (symbol
absent from the library) or the pynvml build lacks the wrapper (AttributeError). Such
a field is left empty and the function is named once in `NvmlSnapshot.missing`.
NVML_ERROR_NOT_SUPPORTED also leaves the field empty, silently: it is the device's
answer, not a defect.

The health watch follows NVIDIA's k8s-device-plugin (internal/rm/health.go): one event
set, every GPU registered for what it supports of nvmlEventTypeXidCriticalError and
nvmlEventTypeDoubleBitEccError (nvmlDeviceGetSupportedEventTypes: ECC events exist
only where ECC is enabled), application XIDs ignored (APPLICATION_XIDS), MIG events
arriving on the parent GPU with the GPU and compute instance ids (0xFFFFFFFF: not
attributable to one instance). Where it differs: double-bit ECC events are reported
(health.go registers them but only acts on XIDs); a GPU whose events NVML does not
offer is reported in `EventWatch.unwatched`, not marked unhealthy; a wait answering
NVML_ERROR_GPU_IS_LOST reports the GPUs that answer so (a lost GPU) rather than every
device, and the event set is rebuilt without them (NVML cannot unregister a device).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import pynvml
from msgspec import Struct

from nri_accel.log import get_logger

log = get_logger(__name__)

_LOCK = threading.Lock()  # held while pynvml's globals point at one user's library
_MISSING = (pynvml.NVMLError_FunctionNotFound, AttributeError)
_NOT_SUPPORTED = pynvml.NVMLError_NotSupported

# NVIDIA k8s-device-plugin internal/rm/health.go: errors of applications, after which
# the GPU is still healthy: 13 graphics engine exception, 31 GPU memory page fault,
# 43 GPU stopped processing, 45 preemptive cleanup due to previous errors, 68 video
# processor exception, 109 context switch timeout.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
_XID = pynvml.nvmlEventTypeXidCriticalError
_DBE = pynvml.nvmlEventTypeDoubleBitEccError
_ANY_INSTANCE = 0xFFFFFFFF  # NVML_GPU_INSTANCE_ID_ANY, NVML_COMPUTE_INSTANCE_ID_ANY
_DRAIN = 64  # events taken at most per wait() once one has arrived


class NvmlUnavailable(Exception):
    """NVML cannot be used at all (library not loadable, nvmlInit failed)."""


class LinkInfo(Struct, frozen=True):
    """One active NVLink: remote device type (0 GPU, 1 IBM NPU, 2 NVSwitch; None when
    the driver cannot say) and the remote end's PCI bus id as NVML writes it."""

    link: int
    remote_type: int | None
    remote_bus_id: str


class MigInfo(Struct, frozen=True):
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


class GpuInfo(Struct, frozen=True):
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


class NvmlSnapshot(Struct, frozen=True):
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
    lib = _load(library)
    with _installed(lib, {}):
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"nvmlInit failed: {e}") from e
        try:
            return _Session().snapshot()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML query failed: {e}") from e
        finally:
            # The handle is dropped by _installed whatever NVML answers here.
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()


def _load(library: str) -> ctypes.CDLL:
    if not hasattr(pynvml, "_nvmlGetFunctionPointer_cache"):
        raise NvmlUnavailable("this pynvml (nvidia-ml-py) lacks the function cache "
                              "nri-accel resets; nvidia-ml-py >= 12.535 is required")
    try:
        return ctypes.CDLL(library)
    except OSError as e:
        raise NvmlUnavailable(f"cannot load {library}: {e}") from e


@contextlib.contextmanager
def _installed(lib: ctypes.CDLL, cache: dict[str, Any]) -> Iterator[None]:
    """pynvml's globals pointing at `lib` and the caller's function cache `cache`, for
    the body of the with statement, under _LOCK; both cleared again after it."""
    with _LOCK:
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache = cache
        try:
            yield
        finally:
            pynvml.nvmlLib = None
            pynvml._nvmlGetFunctionPointer_cache = {}


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


# ---- health events ------------------------------------------------------------------


class GpuEvent(Struct, frozen=True):
    """What NVML told about one GPU that bears on its health.

    kind "xid": a critical XID error (`xid`), attributed to MIG GPU instance `gi` and
    compute instance `ci` where NVML could (None: not attributable, the whole GPU);
    "dbe": a double-bit (uncorrectable) ECC error; "lost": the GPU fell off the bus or
    NVML no longer lists it."""

    uuid: str  # the GPU's, also for an event of one of its MIG devices
    kind: str
    xid: int | None = None
    gi: int | None = None
    ci: int | None = None


class EventWatch:
    """One NVML session watching GPUs (by UUID) for critical XIDs, double-bit ECC errors
    and GPUs falling off the bus. Opened by the constructor, closed by close(); meant
    for one worker thread: wait() blocks up to its timeout, so a loop calling it can
    be stopped within that time.

    GPUs that NVML does not list or that are lost when the watch opens come out of the
    first wait() as "lost" events. `unwatched` maps the GPUs NVML offers no events for
    to the reason. check() is the recovery probe; a lost GPU that passes it is watched
    again.
    """

    def __init__(self, library: str, gpus: Iterable[str], ignored_xids: Iterable[int] = ()
                 ) -> None:
        self._lib = _load(library)
        self._cache: dict[str, Any] = {}
        self._gpus = tuple(dict.fromkeys(gpus))
        self._ignored = APPLICATION_XIDS | frozenset(ignored_xids)
        self._handles: dict[str, Any] = {}  # registered GPUs
        self._by_address: dict[int, str] = {}  # registered handle -> UUID
        self._dropped: set[str] = set()  # GPUs out of the event set: lost or not listed
        self._pending: list[GpuEvent] = []
        self._set: Any = None
        self._initialised = False
        self.unwatched: dict[str, str] = {}
        # Before R450 (MIG) only the unversioned wait exists; it writes the layout without
        # the instance ids, which then keep their "any" preset (see wait()).
        self._wait = getattr(self._lib, "nvmlEventSetWait_v2", None) or \
            getattr(self._lib, "nvmlEventSetWait", None)
        if self._wait is None:
            raise NvmlUnavailable(f"{library} lacks nvmlEventSetWait: no NVML events")
        try:
            with _installed(self._lib, self._cache):
                self._open()
        except pynvml.NVMLError as e:
            self.close()
            raise NvmlUnavailable(f"NVML event watch failed to open: {e}") from e
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        pynvml.nvmlInit()
        self._initialised = True
        self._set = pynvml.nvmlEventSetCreate()
        listed = self._listed()
        for uuid in self._gpus:
            handle = listed.get(uuid)
            if handle is None:
                self._dropped.add(uuid)
                self._pending.append(GpuEvent(uuid, "lost"))
            else:
                self._register(uuid, handle)

    def _listed(self) -> dict[str, Any]:
        """UUID -> handle of every GPU NVML lists and that answers."""
        out = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                out[_text(pynvml.nvmlDeviceGetUUID(handle))] = handle
            except pynvml.NVMLError:
                continue  # lost (NVML_ERROR_GPU_IS_LOST) or unusable: it answers no UUID
        return out

    def _register(self, uuid: str, handle: Any) -> None:
        try:
            mask = pynvml.nvmlDeviceGetSupportedEventTypes(handle) & (_XID | _DBE)
            if not mask:
                self.unwatched[uuid] = "NVML offers neither XID nor ECC events for it"
                return
            pynvml.nvmlDeviceRegisterEvents(handle, mask, self._set)
        except _MISSING:
            self.unwatched[uuid] = "the driver lacks NVML events"
            return
        except _NOT_SUPPORTED:
            self.unwatched[uuid] = "NVML does not support events on it"
            return
        except pynvml.NVMLError_GpuIsLost:
            self._dropped.add(uuid)
            self._pending.append(GpuEvent(uuid, "lost"))
            return
        except pynvml.NVMLError as e:
            self.unwatched[uuid] = f"registering for events failed: {e}"
            return
        self._handles[uuid] = handle
        self._by_address[_address(handle)] = uuid
        self._dropped.discard(uuid)
        self.unwatched.pop(uuid, None)

    def wait(self, timeout_ms: int) -> list[GpuEvent]:
        """The events that arrive within `timeout_ms` (all those queued once one has
        arrived, up to a bound), ignored XIDs left out; [] when none did. Raises
        NvmlUnavailable when the wait fails otherwise than by timing out or by a lost
        GPU (the watch is then unusable: close it)."""
        if self._pending:
            return self._take_pending()
        out: list[GpuEvent] = []
        timeout = timeout_ms
        for _ in range(_DRAIN):
            data = pynvml.c_nvmlEventData_t()
            data.gpuInstanceId = data.computeInstanceId = _ANY_INSTANCE
            ret = self._wait(self._set, ctypes.byref(data), ctypes.c_uint(timeout))
            if ret == pynvml.NVML_ERROR_TIMEOUT:
                break
            if ret == pynvml.NVML_ERROR_GPU_IS_LOST:
                out.extend(self._find_lost())
                break
            if ret != pynvml.NVML_SUCCESS:
                raise NvmlUnavailable(f"nvmlEventSetWait failed: {pynvml.NVMLError(ret)}")
            event = self._event(data)
            if event is not None:
                out.append(event)
            timeout = 0
        return out

    def _event(self, data: Any) -> GpuEvent | None:
        uuid = self._by_address.get(_address(data.device))
        if uuid is None:
            return None  # a device this watch did not register
        if data.eventType == _DBE:
            return GpuEvent(uuid, "dbe")
        if data.eventType != _XID:
            return None
        xid = int(data.eventData)
        if xid in self._ignored:
            log.info("nvml_xid_ignored", gpu=uuid, xid=xid)
            return None
        gi, ci = data.gpuInstanceId, data.computeInstanceId
        return GpuEvent(uuid, "xid", xid, None if gi == _ANY_INSTANCE else int(gi),
                        None if ci == _ANY_INSTANCE else int(ci))

    def _find_lost(self) -> list[GpuEvent]:
        """The wait answered NVML_ERROR_GPU_IS_LOST: which registered GPUs are lost?"""
        with _installed(self._lib, self._cache):
            lost = []
            for uuid, handle in self._handles.items():
                try:
                    pynvml.nvmlDeviceGetMemoryInfo(handle)  # asks the GPU, not a cache
                except pynvml.NVMLError_GpuIsLost:
                    lost.append(uuid)
                except pynvml.NVMLError:
                    continue
            if not lost:
                raise NvmlUnavailable("nvmlEventSetWait: GPU is lost, yet every watched "
                                      "GPU answers")
            try:
                self._rebuild(lost)
            except pynvml.NVMLError as e:
                raise NvmlUnavailable(f"rebuilding the NVML event set failed: {e}") from e
        return [GpuEvent(uuid, "lost") for uuid in lost] + self._take_pending()

    def _rebuild(self, lost: list[str]) -> None:
        keep = {u: h for u, h in self._handles.items() if u not in lost}
        self._dropped.update(lost)
        self._handles.clear()
        self._by_address.clear()
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlEventSetFree(self._set)
        self._set = None
        self._set = pynvml.nvmlEventSetCreate()
        for uuid, handle in keep.items():
            self._register(uuid, handle)

    def _take_pending(self) -> list[GpuEvent]:
        out, self._pending = self._pending, []
        return out

    def check(self, gpu: str, mig: str | None = None) -> str | None:
        """Why GPU `gpu` (or its MIG device `mig`) is not healthy now, or None: NVML lists
        it and it answers (not lost), no page retirement or row remapping waits for a
        GPU reset, no row remapping failed, and the MIG device still exists. A GPU that
        passes and had been dropped from the event set is registered again."""
        with _installed(self._lib, self._cache):
            try:
                handle = self._listed().get(gpu)
                if handle is None:
                    return "GPU does not answer NVML"
                pynvml.nvmlDeviceGetMemoryInfo(handle)
                problem = _repair_pending(handle)
                if problem is None and mig is not None and not _has_mig(handle, mig):
                    problem = "MIG device no longer exists"
            except pynvml.NVMLError_GpuIsLost:
                return "GPU lost"
            except pynvml.NVMLError as e:
                return f"NVML: {e}"
            if problem is None and gpu in self._dropped:
                self._register(gpu, handle)
            return problem

    def close(self) -> None:
        """Free the event set and end the NVML session (idempotent)."""
        with _installed(self._lib, self._cache):
            if self._set is not None:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlEventSetFree(self._set)
                self._set = None
            if self._initialised:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlShutdown()
                self._initialised = False


def _repair_pending(handle: Any) -> str | None:
    """A GPU's memory repair waiting for a reset (page retirement before Ampere, row
    remapping from Ampere on), or a failed row remapping; None where neither applies."""
    try:
        if pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
            return "page retirement pending a GPU reset"
    except (*_MISSING, _NOT_SUPPORTED):
        pass
    try:
        _, _, pending, failure = pynvml.nvmlDeviceGetRemappedRows(handle)
    except (*_MISSING, _NOT_SUPPORTED):
        return None
    if failure:
        return "row remapping failed"
    return "row remapping pending a GPU reset" if pending else None


def _has_mig(handle: Any, uuid: str) -> bool:
    for index in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError_NotFound:
            continue
        if _text(pynvml.nvmlDeviceGetUUID(mig)) == uuid:
            return True
    return False


def _address(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
