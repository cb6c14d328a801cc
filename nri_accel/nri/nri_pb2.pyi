from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Event(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNKNOWN: _ClassVar[Event]
    RUN_POD_SANDBOX: _ClassVar[Event]
    STOP_POD_SANDBOX: _ClassVar[Event]
    REMOVE_POD_SANDBOX: _ClassVar[Event]
    CREATE_CONTAINER: _ClassVar[Event]
    POST_CREATE_CONTAINER: _ClassVar[Event]
    START_CONTAINER: _ClassVar[Event]
    POST_START_CONTAINER: _ClassVar[Event]
    UPDATE_CONTAINER: _ClassVar[Event]
    POST_UPDATE_CONTAINER: _ClassVar[Event]
    STOP_CONTAINER: _ClassVar[Event]
    REMOVE_CONTAINER: _ClassVar[Event]
    UPDATE_POD_SANDBOX: _ClassVar[Event]
    POST_UPDATE_POD_SANDBOX: _ClassVar[Event]
    VALIDATE_CONTAINER_ADJUSTMENT: _ClassVar[Event]
    LAST: _ClassVar[Event]

class Field(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    None: _ClassVar[Field]
    Annotations: _ClassVar[Field]
    Mounts: _ClassVar[Field]
    OciHooks: _ClassVar[Field]
    Devices: _ClassVar[Field]
    CdiDevices: _ClassVar[Field]
    Env: _ClassVar[Field]
    Args: _ClassVar[Field]
    MemLimit: _ClassVar[Field]
    MemReservation: _ClassVar[Field]
    MemSwapLimit: _ClassVar[Field]
    MemKernelLimit: _ClassVar[Field]
    MemTCPLimit: _ClassVar[Field]
    MemSwappiness: _ClassVar[Field]
    MemDisableOomKiller: _ClassVar[Field]
    MemUseHierarchy: _ClassVar[Field]
    CPUShares: _ClassVar[Field]
    CPUQuota: _ClassVar[Field]
    CPUPeriod: _ClassVar[Field]
    CPURealtimeRuntime: _ClassVar[Field]
    CPURealtimePeriod: _ClassVar[Field]
    CPUSetCPUs: _ClassVar[Field]
    CPUSetMems: _ClassVar[Field]
    PidsLimit: _ClassVar[Field]
    HugepageLimits: _ClassVar[Field]
    BlockioClass: _ClassVar[Field]
    RdtClass: _ClassVar[Field]
    CgroupsUnified: _ClassVar[Field]
    CgroupsPath: _ClassVar[Field]
    OomScoreAdj: _ClassVar[Field]
    Rlimits: _ClassVar[Field]
    IoPriority: _ClassVar[Field]
    SeccompPolicy: _ClassVar[Field]
    Namespace: _ClassVar[Field]
    Sysctl: _ClassVar[Field]
    LinuxNetDevices: _ClassVar[Field]
    LinuxSched: _ClassVar[Field]
    RdtClosID: _ClassVar[Field]
    RdtSchemata: _ClassVar[Field]
    RdtEnableMonitoring: _ClassVar[Field]
    MemoryPolicy: _ClassVar[Field]

class ContainerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTAINER_UNKNOWN: _ClassVar[ContainerState]
    CONTAINER_CREATED: _ClassVar[ContainerState]
    CONTAINER_PAUSED: _ClassVar[ContainerState]
    CONTAINER_RUNNING: _ClassVar[ContainerState]
    CONTAINER_STOPPED: _ClassVar[ContainerState]

class IOPrioClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IOPRIO_CLASS_NONE: _ClassVar[IOPrioClass]
    IOPRIO_CLASS_RT: _ClassVar[IOPrioClass]
    IOPRIO_CLASS_BE: _ClassVar[IOPrioClass]
    IOPRIO_CLASS_IDLE: _ClassVar[IOPrioClass]

class LinuxSchedulerPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHED_NONE: _ClassVar[LinuxSchedulerPolicy]
    SCHED_OTHER: _ClassVar[LinuxSchedulerPolicy]
    SCHED_FIFO: _ClassVar[LinuxSchedulerPolicy]
    SCHED_RR: _ClassVar[LinuxSchedulerPolicy]
    SCHED_BATCH: _ClassVar[LinuxSchedulerPolicy]
    SCHED_ISO: _ClassVar[LinuxSchedulerPolicy]
    SCHED_IDLE: _ClassVar[LinuxSchedulerPolicy]
    SCHED_DEADLINE: _ClassVar[LinuxSchedulerPolicy]

class LinuxSchedulerFlag(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHED_FLAG_RESET_ON_FORK: _ClassVar[LinuxSchedulerFlag]
    SCHED_FLAG_RECLAIM: _ClassVar[LinuxSchedulerFlag]
    SCHED_FLAG_DL_OVERRUN: _ClassVar[LinuxSchedulerFlag]
    SCHED_FLAG_KEEP_POLICY: _ClassVar[LinuxSchedulerFlag]
    SCHED_FLAG_KEEP_PARAMS: _ClassVar[LinuxSchedulerFlag]
    SCHED_FLAG_UTIL_CLAMP_MIN: _ClassVar[LinuxSchedulerFlag]
    SCHED_FLAG_UTIL_CLAMP_MAX: _ClassVar[LinuxSchedulerFlag]

class MpolMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MPOL_DEFAULT: _ClassVar[MpolMode]
    MPOL_PREFERRED: _ClassVar[MpolMode]
    MPOL_BIND: _ClassVar[MpolMode]
    MPOL_INTERLEAVE: _ClassVar[MpolMode]
    MPOL_LOCAL: _ClassVar[MpolMode]
    MPOL_PREFERRED_MANY: _ClassVar[MpolMode]
    MPOL_WEIGHTED_INTERLEAVE: _ClassVar[MpolMode]

class MpolFlag(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MPOL_F_STATIC_NODES: _ClassVar[MpolFlag]
    MPOL_F_RELATIVE_NODES: _ClassVar[MpolFlag]
    MPOL_F_NUMA_BALANCING: _ClassVar[MpolFlag]
UNKNOWN: Event
RUN_POD_SANDBOX: Event
STOP_POD_SANDBOX: Event
REMOVE_POD_SANDBOX: Event
CREATE_CONTAINER: Event
POST_CREATE_CONTAINER: Event
START_CONTAINER: Event
POST_START_CONTAINER: Event
UPDATE_CONTAINER: Event
POST_UPDATE_CONTAINER: Event
STOP_CONTAINER: Event
REMOVE_CONTAINER: Event
UPDATE_POD_SANDBOX: Event
POST_UPDATE_POD_SANDBOX: Event
VALIDATE_CONTAINER_ADJUSTMENT: Event
LAST: Event
None: Field
Annotations: Field
Mounts: Field
OciHooks: Field
Devices: Field
CdiDevices: Field
Env: Field
Args: Field
MemLimit: Field
MemReservation: Field
MemSwapLimit: Field
MemKernelLimit: Field
MemTCPLimit: Field
MemSwappiness: Field
MemDisableOomKiller: Field
MemUseHierarchy: Field
CPUShares: Field
CPUQuota: Field
CPUPeriod: Field
CPURealtimeRuntime: Field
CPURealtimePeriod: Field
CPUSetCPUs: Field
CPUSetMems: Field
PidsLimit: Field
HugepageLimits: Field
BlockioClass: Field
RdtClass: Field
CgroupsUnified: Field
CgroupsPath: Field
OomScoreAdj: Field
Rlimits: Field
IoPriority: Field
SeccompPolicy: Field
Namespace: Field
Sysctl: Field
LinuxNetDevices: Field
LinuxSched: Field
RdtClosID: Field
RdtSchemata: Field
RdtEnableMonitoring: Field
MemoryPolicy: Field
CONTAINER_UNKNOWN: ContainerState
CONTAINER_CREATED: ContainerState
CONTAINER_PAUSED: ContainerState
CONTAINER_RUNNING: ContainerState
CONTAINER_STOPPED: ContainerState
IOPRIO_CLASS_NONE: IOPrioClass
IOPRIO_CLASS_RT: IOPrioClass
IOPRIO_CLASS_BE: IOPrioClass
IOPRIO_CLASS_IDLE: IOPrioClass
SCHED_NONE: LinuxSchedulerPolicy
SCHED_OTHER: LinuxSchedulerPolicy
SCHED_FIFO: LinuxSchedulerPolicy
SCHED_RR: LinuxSchedulerPolicy
SCHED_BATCH: LinuxSchedulerPolicy
SCHED_ISO: LinuxSchedulerPolicy
SCHED_IDLE: LinuxSchedulerPolicy
SCHED_DEADLINE: LinuxSchedulerPolicy
SCHED_FLAG_RESET_ON_FORK: LinuxSchedulerFlag
SCHED_FLAG_RECLAIM: LinuxSchedulerFlag
SCHED_FLAG_DL_OVERRUN: LinuxSchedulerFlag
SCHED_FLAG_KEEP_POLICY: LinuxSchedulerFlag
SCHED_FLAG_KEEP_PARAMS: LinuxSchedulerFlag
SCHED_FLAG_UTIL_CLAMP_MIN: LinuxSchedulerFlag
SCHED_FLAG_UTIL_CLAMP_MAX: LinuxSchedulerFlag
MPOL_DEFAULT: MpolMode
MPOL_PREFERRED: MpolMode
MPOL_BIND: MpolMode
MPOL_INTERLEAVE: MpolMode
MPOL_LOCAL: MpolMode
MPOL_PREFERRED_MANY: MpolMode
MPOL_WEIGHTED_INTERLEAVE: MpolMode
MPOL_F_STATIC_NODES: MpolFlag
MPOL_F_RELATIVE_NODES: MpolFlag
MPOL_F_NUMA_BALANCING: MpolFlag

class RegisterPluginRequest(_message.Message):
    __slots__ = ("plugin_name", "plugin_idx", "NRI_version")
    PLUGIN_NAME_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_IDX_FIELD_NUMBER: _ClassVar[int]
    NRI_VERSION_FIELD_NUMBER: _ClassVar[int]
    plugin_name: str
    plugin_idx: str
    NRI_version: str
    def __init__(self, plugin_name: _Optional[str] = ..., plugin_idx: _Optional[str] = ..., NRI_version: _Optional[str] = ...) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("config", "runtime_name", "runtime_version", "registration_timeout", "request_timeout", "NRI_version")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_NAME_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_VERSION_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    NRI_VERSION_FIELD_NUMBER: _ClassVar[int]
    config: str
    runtime_name: str
    runtime_version: str
    registration_timeout: int
    request_timeout: int
    NRI_version: str
    def __init__(self, config: _Optional[str] = ..., runtime_name: _Optional[str] = ..., runtime_version: _Optional[str] = ..., registration_timeout: _Optional[int] = ..., request_timeout: _Optional[int] = ..., NRI_version: _Optional[str] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ("events", "request_timeout")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    events: int
    request_timeout: int
    def __init__(self, events: _Optional[int] = ..., request_timeout: _Optional[int] = ...) -> None: ...

class SynchronizeRequest(_message.Message):
    __slots__ = ("pods", "containers", "more")
    PODS_FIELD_NUMBER: _ClassVar[int]
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    pods: _containers.RepeatedCompositeFieldContainer[PodSandbox]
    containers: _containers.RepeatedCompositeFieldContainer[Container]
    more: bool
    def __init__(self, pods: _Optional[_Iterable[_Union[PodSandbox, _Mapping]]] = ..., containers: _Optional[_Iterable[_Union[Container, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class SynchronizeResponse(_message.Message):
    __slots__ = ("update", "more")
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    update: _containers.RepeatedCompositeFieldContainer[ContainerUpdate]
    more: bool
    def __init__(self, update: _Optional[_Iterable[_Union[ContainerUpdate, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class UpdateContainersRequest(_message.Message):
    __slots__ = ("update", "evict")
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    update: _containers.RepeatedCompositeFieldContainer[ContainerUpdate]
    evict: _containers.RepeatedCompositeFieldContainer[ContainerEviction]
    def __init__(self, update: _Optional[_Iterable[_Union[ContainerUpdate, _Mapping]]] = ..., evict: _Optional[_Iterable[_Union[ContainerEviction, _Mapping]]] = ...) -> None: ...

class UpdateContainersResponse(_message.Message):
    __slots__ = ("failed",)
    FAILED_FIELD_NUMBER: _ClassVar[int]
    failed: _containers.RepeatedCompositeFieldContainer[ContainerUpdate]
    def __init__(self, failed: _Optional[_Iterable[_Union[ContainerUpdate, _Mapping]]] = ...) -> None: ...

class LogRequest(_message.Message):
    __slots__ = ("msg", "level")
    class Level(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        LEVEL_UNSPECIFIED: _ClassVar[LogRequest.Level]
        LEVEL_DEBUG: _ClassVar[LogRequest.Level]
        LEVEL_INFO: _ClassVar[LogRequest.Level]
        LEVEL_WARN: _ClassVar[LogRequest.Level]
        LEVEL_ERROR: _ClassVar[LogRequest.Level]
    LEVEL_UNSPECIFIED: LogRequest.Level
    LEVEL_DEBUG: LogRequest.Level
    LEVEL_INFO: LogRequest.Level
    LEVEL_WARN: LogRequest.Level
    LEVEL_ERROR: LogRequest.Level
    MSG_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    msg: str
    level: LogRequest.Level
    def __init__(self, msg: _Optional[str] = ..., level: _Optional[_Union[LogRequest.Level, str]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunPodSandboxRequest(_message.Message):
    __slots__ = ("pod",)
    POD_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ...) -> None: ...

class RunPodSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdatePodSandboxRequest(_message.Message):
    __slots__ = ("pod", "overhead_linux_resources", "linux_resources")
    POD_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_LINUX_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    LINUX_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    overhead_linux_resources: LinuxResources
    linux_resources: LinuxResources
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., overhead_linux_resources: _Optional[_Union[LinuxResources, _Mapping]] = ..., linux_resources: _Optional[_Union[LinuxResources, _Mapping]] = ...) -> None: ...

class UpdatePodSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PostUpdatePodSandboxRequest(_message.Message):
    __slots__ = ("pod",)
    POD_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ...) -> None: ...

class PostUpdatePodSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopPodSandboxRequest(_message.Message):
    __slots__ = ("pod",)
    POD_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ...) -> None: ...

class StopPodSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemovePodSandboxRequest(_message.Message):
    __slots__ = ("pod",)
    POD_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ...) -> None: ...

class RemovePodSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateContainerRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    container: Container
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[Container, _Mapping]] = ...) -> None: ...

class CreateContainerResponse(_message.Message):
    __slots__ = ("adjust", "update", "evict")
    ADJUST_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    adjust: ContainerAdjustment
    update: _containers.RepeatedCompositeFieldContainer[ContainerUpdate]
    evict: _containers.RepeatedCompositeFieldContainer[ContainerEviction]
    def __init__(self, adjust: _Optional[_Union[ContainerAdjustment, _Mapping]] = ..., update: _Optional[_Iterable[_Union[ContainerUpdate, _Mapping]]] = ..., evict: _Optional[_Iterable[_Union[ContainerEviction, _Mapping]]] = ...) -> None: ...

class PostCreateContainerRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    container: Container
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[Container, _Mapping]] = ...) -> None: ...

class PostCreateContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartContainerRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    container: Container
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[Container, _Mapping]] = ...) -> None: ...

class StartContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PostStartContainerRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    container: Container
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[Container, _Mapping]] = ...) -> None: ...

class PostStartContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateContainerRequest(_message.Message):
    __slots__ = ("pod", "container", "linux_resources")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    LINUX_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    container: Container
    linux_resources: LinuxResources
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[Container, _Mapping]] = ..., linux_resources: _Optional[_Union[LinuxResources, _Mapping]] = ...) -> None: ...

class UpdateContainerResponse(_message.Message):
    __slots__ = ("update", "evict")
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    update: _containers.RepeatedCompositeFieldContainer[ContainerUpdate]
    evict: _containers.RepeatedCompositeFieldContainer[ContainerEviction]
    def __init__(self, update: _Optional[_Iterable[_Union[ContainerUpdate, _Mapping]]] = ..., evict: _Optional[_Iterable[_Union[ContainerEviction, _Mapping]]] = ...) -> None: ...

class PostUpdateContainerRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    container: Container
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[Container, _Mapping]] = ...) -> None: ...

class PostUpdateContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopContainerRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    container: Container
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[Container, _Mapping]] = ...) -> None: ...

class StopContainerResponse(_message.Message):
    __slots__ = ("update",)
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    update: _containers.RepeatedCompositeFieldContainer[ContainerUpdate]
    def __init__(self, update: _Optional[_Iterable[_Union[ContainerUpdate, _Mapping]]] = ...) -> None: ...

class RemoveContainerRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    container: Container
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[Container, _Mapping]] = ...) -> None: ...

class RemoveContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StateChangeEvent(_message.Message):
    __slots__ = ("event", "pod", "container")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    event: Event
    pod: PodSandbox
    container: Container
    def __init__(self, event: _Optional[_Union[Event, str]] = ..., pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[Container, _Mapping]] = ...) -> None: ...

class ValidateContainerAdjustmentRequest(_message.Message):
    __slots__ = ("pod", "container", "adjust", "update", "owners", "plugins")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    ADJUST_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    PLUGINS_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    container: Container
    adjust: ContainerAdjustment
    update: _containers.RepeatedCompositeFieldContainer[ContainerUpdate]
    owners: OwningPlugins
    plugins: _containers.RepeatedCompositeFieldContainer[PluginInstance]
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[Container, _Mapping]] = ..., adjust: _Optional[_Union[ContainerAdjustment, _Mapping]] = ..., update: _Optional[_Iterable[_Union[ContainerUpdate, _Mapping]]] = ..., owners: _Optional[_Union[OwningPlugins, _Mapping]] = ..., plugins: _Optional[_Iterable[_Union[PluginInstance, _Mapping]]] = ...) -> None: ...

class ValidateContainerAdjustmentResponse(_message.Message):
    __slots__ = ("reject", "reason")
    REJECT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reject: bool
    reason: str
    def __init__(self, reject: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class PluginInstance(_message.Message):
    __slots__ = ("name", "index")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: str
    def __init__(self, name: _Optional[str] = ..., index: _Optional[str] = ...) -> None: ...

class CompoundFieldOwners(_message.Message):
    __slots__ = ("owners",)
    class OwnersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    owners: _containers.ScalarMap[str, str]
    def __init__(self, owners: _Optional[_Mapping[str, str]] = ...) -> None: ...

class FieldOwners(_message.Message):
    __slots__ = ("simple", "compound")
    class SimpleEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class CompoundEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: CompoundFieldOwners
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[CompoundFieldOwners, _Mapping]] = ...) -> None: ...
    SIMPLE_FIELD_NUMBER: _ClassVar[int]
    COMPOUND_FIELD_NUMBER: _ClassVar[int]
    simple: _containers.ScalarMap[int, str]
    compound: _containers.MessageMap[int, CompoundFieldOwners]
    def __init__(self, simple: _Optional[_Mapping[int, str]] = ..., compound: _Optional[_Mapping[int, CompoundFieldOwners]] = ...) -> None: ...

class OwningPlugins(_message.Message):
    __slots__ = ("owners",)
    class OwnersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: FieldOwners
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[FieldOwners, _Mapping]] = ...) -> None: ...
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    owners: _containers.MessageMap[str, FieldOwners]
    def __init__(self, owners: _Optional[_Mapping[str, FieldOwners]] = ...) -> None: ...

class PodSandbox(_message.Message):
    __slots__ = ("id", "name", "uid", "namespace", "labels", "annotations", "runtime_handler", "linux", "pid", "ips")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_HANDLER_FIELD_NUMBER: _ClassVar[int]
    LINUX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    IPS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    uid: str
    namespace: str
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    runtime_handler: str
    linux: LinuxPodSandbox
    pid: int
    ips: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., uid: _Optional[str] = ..., namespace: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., runtime_handler: _Optional[str] = ..., linux: _Optional[_Union[LinuxPodSandbox, _Mapping]] = ..., pid: _Optional[int] = ..., ips: _Optional[_Iterable[str]] = ...) -> None: ...

class LinuxPodSandbox(_message.Message):
    __slots__ = ("pod_overhead", "pod_resources", "cgroup_parent", "cgroups_path", "namespaces", "resources")
    POD_OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    POD_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    CGROUP_PARENT_FIELD_NUMBER: _ClassVar[int]
    CGROUPS_PATH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    pod_overhead: LinuxResources
    pod_resources: LinuxResources
    cgroup_parent: str
    cgroups_path: str
    namespaces: _containers.RepeatedCompositeFieldContainer[LinuxNamespace]
    resources: LinuxResources
    def __init__(self, pod_overhead: _Optional[_Union[LinuxResources, _Mapping]] = ..., pod_resources: _Optional[_Union[LinuxResources, _Mapping]] = ..., cgroup_parent: _Optional[str] = ..., cgroups_path: _Optional[str] = ..., namespaces: _Optional[_Iterable[_Union[LinuxNamespace, _Mapping]]] = ..., resources: _Optional[_Union[LinuxResources, _Mapping]] = ...) -> None: ...

class Container(_message.Message):
    __slots__ = ("id", "pod_sandbox_id", "name", "state", "labels", "annotations", "args", "env", "mounts", "hooks", "linux", "pid", "rlimits", "created_at", "started_at", "finished_at", "exit_code", "status_reason", "status_message", "CDI_devices", "user")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    HOOKS_FIELD_NUMBER: _ClassVar[int]
    LINUX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RLIMITS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_REASON_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CDI_DEVICES_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    id: str
    pod_sandbox_id: str
    name: str
    state: ContainerState
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.RepeatedScalarFieldContainer[str]
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    hooks: Hooks
    linux: LinuxContainer
    pid: int
    rlimits: _containers.RepeatedCompositeFieldContainer[POSIXRlimit]
    created_at: int
    started_at: int
    finished_at: int
    exit_code: int
    status_reason: str
    status_message: str
    CDI_devices: _containers.RepeatedCompositeFieldContainer[CDIDevice]
    user: User
    def __init__(self, id: _Optional[str] = ..., pod_sandbox_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[ContainerState, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., args: _Optional[_Iterable[str]] = ..., env: _Optional[_Iterable[str]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., hooks: _Optional[_Union[Hooks, _Mapping]] = ..., linux: _Optional[_Union[LinuxContainer, _Mapping]] = ..., pid: _Optional[int] = ..., rlimits: _Optional[_Iterable[_Union[POSIXRlimit, _Mapping]]] = ..., created_at: _Optional[int] = ..., started_at: _Optional[int] = ..., finished_at: _Optional[int] = ..., exit_code: _Optional[int] = ..., status_reason: _Optional[str] = ..., status_message: _Optional[str] = ..., CDI_devices: _Optional[_Iterable[_Union[CDIDevice, _Mapping]]] = ..., user: _Optional[_Union[User, _Mapping]] = ...) -> None: ...

class User(_message.Message):
    __slots__ = ("uid", "gid", "additional_gids")
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    ADDITIONAL_GIDS_FIELD_NUMBER: _ClassVar[int]
    uid: int
    gid: int
    additional_gids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, uid: _Optional[int] = ..., gid: _Optional[int] = ..., additional_gids: _Optional[_Iterable[int]] = ...) -> None: ...

class Mount(_message.Message):
    __slots__ = ("destination", "type", "source", "options")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    destination: str
    type: str
    source: str
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, destination: _Optional[str] = ..., type: _Optional[str] = ..., source: _Optional[str] = ..., options: _Optional[_Iterable[str]] = ...) -> None: ...

class Hooks(_message.Message):
    __slots__ = ("prestart", "create_runtime", "create_container", "start_container", "poststart", "poststop")
    PRESTART_FIELD_NUMBER: _ClassVar[int]
    CREATE_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    CREATE_CONTAINER_FIELD_NUMBER: _ClassVar[int]
    START_CONTAINER_FIELD_NUMBER: _ClassVar[int]
    POSTSTART_FIELD_NUMBER: _ClassVar[int]
    POSTSTOP_FIELD_NUMBER: _ClassVar[int]
    prestart: _containers.RepeatedCompositeFieldContainer[Hook]
    create_runtime: _containers.RepeatedCompositeFieldContainer[Hook]
    create_container: _containers.RepeatedCompositeFieldContainer[Hook]
    start_container: _containers.RepeatedCompositeFieldContainer[Hook]
    poststart: _containers.RepeatedCompositeFieldContainer[Hook]
    poststop: _containers.RepeatedCompositeFieldContainer[Hook]
    def __init__(self, prestart: _Optional[_Iterable[_Union[Hook, _Mapping]]] = ..., create_runtime: _Optional[_Iterable[_Union[Hook, _Mapping]]] = ..., create_container: _Optional[_Iterable[_Union[Hook, _Mapping]]] = ..., start_container: _Optional[_Iterable[_Union[Hook, _Mapping]]] = ..., poststart: _Optional[_Iterable[_Union[Hook, _Mapping]]] = ..., poststop: _Optional[_Iterable[_Union[Hook, _Mapping]]] = ...) -> None: ...

class Hook(_message.Message):
    __slots__ = ("path", "args", "env", "timeout")
    PATH_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    path: str
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.RepeatedScalarFieldContainer[str]
    timeout: OptionalInt
    def __init__(self, path: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., env: _Optional[_Iterable[str]] = ..., timeout: _Optional[_Union[OptionalInt, _Mapping]] = ...) -> None: ...

class LinuxContainer(_message.Message):
    __slots__ = ("namespaces", "devices", "resources", "oom_score_adj", "cgroups_path", "io_priority", "seccomp_profile", "seccomp_policy", "sysctl", "net_devices", "scheduler", "rdt")
    class SysctlEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class NetDevicesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: LinuxNetDevice
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[LinuxNetDevice, _Mapping]] = ...) -> None: ...
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    OOM_SCORE_ADJ_FIELD_NUMBER: _ClassVar[int]
    CGROUPS_PATH_FIELD_NUMBER: _ClassVar[int]
    IO_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SECCOMP_PROFILE_FIELD_NUMBER: _ClassVar[int]
    SECCOMP_POLICY_FIELD_NUMBER: _ClassVar[int]
    SYSCTL_FIELD_NUMBER: _ClassVar[int]
    NET_DEVICES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    RDT_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[LinuxNamespace]
    devices: _containers.RepeatedCompositeFieldContainer[LinuxDevice]
    resources: LinuxResources
    oom_score_adj: OptionalInt
    cgroups_path: str
    io_priority: LinuxIOPriority
    seccomp_profile: SecurityProfile
    seccomp_policy: LinuxSeccomp
    sysctl: _containers.ScalarMap[str, str]
    net_devices: _containers.MessageMap[str, LinuxNetDevice]
    scheduler: LinuxScheduler
    rdt: LinuxRdt
    def __init__(self, namespaces: _Optional[_Iterable[_Union[LinuxNamespace, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[LinuxDevice, _Mapping]]] = ..., resources: _Optional[_Union[LinuxResources, _Mapping]] = ..., oom_score_adj: _Optional[_Union[OptionalInt, _Mapping]] = ..., cgroups_path: _Optional[str] = ..., io_priority: _Optional[_Union[LinuxIOPriority, _Mapping]] = ..., seccomp_profile: _Optional[_Union[SecurityProfile, _Mapping]] = ..., seccomp_policy: _Optional[_Union[LinuxSeccomp, _Mapping]] = ..., sysctl: _Optional[_Mapping[str, str]] = ..., net_devices: _Optional[_Mapping[str, LinuxNetDevice]] = ..., scheduler: _Optional[_Union[LinuxScheduler, _Mapping]] = ..., rdt: _Optional[_Union[LinuxRdt, _Mapping]] = ...) -> None: ...

class LinuxNamespace(_message.Message):
    __slots__ = ("type", "path")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    type: str
    path: str
    def __init__(self, type: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LinuxDevice(_message.Message):
    __slots__ = ("path", "type", "major", "minor", "file_mode", "uid", "gid")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    FILE_MODE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    path: str
    type: str
    major: int
    minor: int
    file_mode: OptionalFileMode
    uid: OptionalUInt32
    gid: OptionalUInt32
    def __init__(self, path: _Optional[str] = ..., type: _Optional[str] = ..., major: _Optional[int] = ..., minor: _Optional[int] = ..., file_mode: _Optional[_Union[OptionalFileMode, _Mapping]] = ..., uid: _Optional[_Union[OptionalUInt32, _Mapping]] = ..., gid: _Optional[_Union[OptionalUInt32, _Mapping]] = ...) -> None: ...

class LinuxDeviceCgroup(_message.Message):
    __slots__ = ("allow", "type", "major", "minor", "access")
    ALLOW_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    allow: bool
    type: str
    major: OptionalInt64
    minor: OptionalInt64
    access: str
    def __init__(self, allow: _Optional[bool] = ..., type: _Optional[str] = ..., major: _Optional[_Union[OptionalInt64, _Mapping]] = ..., minor: _Optional[_Union[OptionalInt64, _Mapping]] = ..., access: _Optional[str] = ...) -> None: ...

class CDIDevice(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class LinuxNetDevice(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class LinuxResources(_message.Message):
    __slots__ = ("memory", "cpu", "hugepage_limits", "blockio_class", "rdt_class", "unified", "devices", "pids")
    class UnifiedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    HUGEPAGE_LIMITS_FIELD_NUMBER: _ClassVar[int]
    BLOCKIO_CLASS_FIELD_NUMBER: _ClassVar[int]
    RDT_CLASS_FIELD_NUMBER: _ClassVar[int]
    UNIFIED_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    memory: LinuxMemory
    cpu: LinuxCPU
    hugepage_limits: _containers.RepeatedCompositeFieldContainer[HugepageLimit]
    blockio_class: OptionalString
    rdt_class: OptionalString
    unified: _containers.ScalarMap[str, str]
    devices: _containers.RepeatedCompositeFieldContainer[LinuxDeviceCgroup]
    pids: LinuxPids
    def __init__(self, memory: _Optional[_Union[LinuxMemory, _Mapping]] = ..., cpu: _Optional[_Union[LinuxCPU, _Mapping]] = ..., hugepage_limits: _Optional[_Iterable[_Union[HugepageLimit, _Mapping]]] = ..., blockio_class: _Optional[_Union[OptionalString, _Mapping]] = ..., rdt_class: _Optional[_Union[OptionalString, _Mapping]] = ..., unified: _Optional[_Mapping[str, str]] = ..., devices: _Optional[_Iterable[_Union[LinuxDeviceCgroup, _Mapping]]] = ..., pids: _Optional[_Union[LinuxPids, _Mapping]] = ...) -> None: ...

class LinuxMemory(_message.Message):
    __slots__ = ("limit", "reservation", "swap", "kernel", "kernel_tcp", "swappiness", "disable_oom_killer", "use_hierarchy")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    SWAP_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    KERNEL_TCP_FIELD_NUMBER: _ClassVar[int]
    SWAPPINESS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_OOM_KILLER_FIELD_NUMBER: _ClassVar[int]
    USE_HIERARCHY_FIELD_NUMBER: _ClassVar[int]
    limit: OptionalInt64
    reservation: OptionalInt64
    swap: OptionalInt64
    kernel: OptionalInt64
    kernel_tcp: OptionalInt64
    swappiness: OptionalUInt64
    disable_oom_killer: OptionalBool
    use_hierarchy: OptionalBool
    def __init__(self, limit: _Optional[_Union[OptionalInt64, _Mapping]] = ..., reservation: _Optional[_Union[OptionalInt64, _Mapping]] = ..., swap: _Optional[_Union[OptionalInt64, _Mapping]] = ..., kernel: _Optional[_Union[OptionalInt64, _Mapping]] = ..., kernel_tcp: _Optional[_Union[OptionalInt64, _Mapping]] = ..., swappiness: _Optional[_Union[OptionalUInt64, _Mapping]] = ..., disable_oom_killer: _Optional[_Union[OptionalBool, _Mapping]] = ..., use_hierarchy: _Optional[_Union[OptionalBool, _Mapping]] = ...) -> None: ...

class LinuxCPU(_message.Message):
    __slots__ = ("shares", "quota", "period", "realtime_runtime", "realtime_period", "cpus", "mems")
    SHARES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    REALTIME_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    REALTIME_PERIOD_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMS_FIELD_NUMBER: _ClassVar[int]
    shares: OptionalUInt64
    quota: OptionalInt64
    period: OptionalUInt64
    realtime_runtime: OptionalInt64
    realtime_period: OptionalUInt64
    cpus: str
    mems: str
    def __init__(self, shares: _Optional[_Union[OptionalUInt64, _Mapping]] = ..., quota: _Optional[_Union[OptionalInt64, _Mapping]] = ..., period: _Optional[_Union[OptionalUInt64, _Mapping]] = ..., realtime_runtime: _Optional[_Union[OptionalInt64, _Mapping]] = ..., realtime_period: _Optional[_Union[OptionalUInt64, _Mapping]] = ..., cpus: _Optional[str] = ..., mems: _Optional[str] = ...) -> None: ...

class HugepageLimit(_message.Message):
    __slots__ = ("page_size", "limit")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    page_size: str
    limit: int
    def __init__(self, page_size: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class LinuxPids(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class POSIXRlimit(_message.Message):
    __slots__ = ("type", "hard", "soft")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    HARD_FIELD_NUMBER: _ClassVar[int]
    SOFT_FIELD_NUMBER: _ClassVar[int]
    type: str
    hard: int
    soft: int
    def __init__(self, type: _Optional[str] = ..., hard: _Optional[int] = ..., soft: _Optional[int] = ...) -> None: ...

class LinuxIOPriority(_message.Message):
    __slots__ = ("priority",)
    CLASS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    priority: int
    def __init__(self, priority: _Optional[int] = ..., **kwargs) -> None: ...

class SecurityProfile(_message.Message):
    __slots__ = ("profile_type", "localhost_ref")
    class ProfileType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RUNTIME_DEFAULT: _ClassVar[SecurityProfile.ProfileType]
        UNCONFINED: _ClassVar[SecurityProfile.ProfileType]
        LOCALHOST: _ClassVar[SecurityProfile.ProfileType]
    RUNTIME_DEFAULT: SecurityProfile.ProfileType
    UNCONFINED: SecurityProfile.ProfileType
    LOCALHOST: SecurityProfile.ProfileType
    PROFILE_TYPE_FIELD_NUMBER: _ClassVar[int]
    LOCALHOST_REF_FIELD_NUMBER: _ClassVar[int]
    profile_type: SecurityProfile.ProfileType
    localhost_ref: str
    def __init__(self, profile_type: _Optional[_Union[SecurityProfile.ProfileType, str]] = ..., localhost_ref: _Optional[str] = ...) -> None: ...

class LinuxSeccomp(_message.Message):
    __slots__ = ("default_action", "default_errno", "architectures", "flags", "listener_path", "listener_metadata", "syscalls")
    DEFAULT_ACTION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_ERRNO_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURES_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    LISTENER_PATH_FIELD_NUMBER: _ClassVar[int]
    LISTENER_METADATA_FIELD_NUMBER: _ClassVar[int]
    SYSCALLS_FIELD_NUMBER: _ClassVar[int]
    default_action: str
    default_errno: OptionalUInt32
    architectures: _containers.RepeatedScalarFieldContainer[str]
    flags: _containers.RepeatedScalarFieldContainer[str]
    listener_path: str
    listener_metadata: str
    syscalls: _containers.RepeatedCompositeFieldContainer[LinuxSyscall]
    def __init__(self, default_action: _Optional[str] = ..., default_errno: _Optional[_Union[OptionalUInt32, _Mapping]] = ..., architectures: _Optional[_Iterable[str]] = ..., flags: _Optional[_Iterable[str]] = ..., listener_path: _Optional[str] = ..., listener_metadata: _Optional[str] = ..., syscalls: _Optional[_Iterable[_Union[LinuxSyscall, _Mapping]]] = ...) -> None: ...

class LinuxSyscall(_message.Message):
    __slots__ = ("names", "action", "errno_ret", "args")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ERRNO_RET_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    action: str
    errno_ret: OptionalUInt32
    args: _containers.RepeatedCompositeFieldContainer[LinuxSeccompArg]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., action: _Optional[str] = ..., errno_ret: _Optional[_Union[OptionalUInt32, _Mapping]] = ..., args: _Optional[_Iterable[_Union[LinuxSeccompArg, _Mapping]]] = ...) -> None: ...

class LinuxSeccompArg(_message.Message):
    __slots__ = ("index", "value", "value_two", "op")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VALUE_TWO_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    index: int
    value: int
    value_two: int
    op: str
    def __init__(self, index: _Optional[int] = ..., value: _Optional[int] = ..., value_two: _Optional[int] = ..., op: _Optional[str] = ...) -> None: ...

class LinuxScheduler(_message.Message):
    __slots__ = ("policy", "nice", "priority", "flags", "runtime", "deadline", "period")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NICE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    policy: LinuxSchedulerPolicy
    nice: int
    priority: int
    flags: _containers.RepeatedScalarFieldContainer[LinuxSchedulerFlag]
    runtime: int
    deadline: int
    period: int
    def __init__(self, policy: _Optional[_Union[LinuxSchedulerPolicy, str]] = ..., nice: _Optional[int] = ..., priority: _Optional[int] = ..., flags: _Optional[_Iterable[_Union[LinuxSchedulerFlag, str]]] = ..., runtime: _Optional[int] = ..., deadline: _Optional[int] = ..., period: _Optional[int] = ...) -> None: ...

class LinuxRdt(_message.Message):
    __slots__ = ("clos_id", "schemata", "enable_monitoring", "remove")
    CLOS_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEMATA_FIELD_NUMBER: _ClassVar[int]
    ENABLE_MONITORING_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    clos_id: OptionalString
    schemata: OptionalRepeatedString
    enable_monitoring: OptionalBool
    remove: bool
    def __init__(self, clos_id: _Optional[_Union[OptionalString, _Mapping]] = ..., schemata: _Optional[_Union[OptionalRepeatedString, _Mapping]] = ..., enable_monitoring: _Optional[_Union[OptionalBool, _Mapping]] = ..., remove: _Optional[bool] = ...) -> None: ...

class LinuxMemoryPolicy(_message.Message):
    __slots__ = ("mode", "nodes", "flags")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    mode: MpolMode
    nodes: str
    flags: _containers.RepeatedScalarFieldContainer[MpolFlag]
    def __init__(self, mode: _Optional[_Union[MpolMode, str]] = ..., nodes: _Optional[str] = ..., flags: _Optional[_Iterable[_Union[MpolFlag, str]]] = ...) -> None: ...

class ContainerAdjustment(_message.Message):
    __slots__ = ("annotations", "mounts", "env", "hooks", "linux", "rlimits", "CDI_devices", "args")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    HOOKS_FIELD_NUMBER: _ClassVar[int]
    LINUX_FIELD_NUMBER: _ClassVar[int]
    RLIMITS_FIELD_NUMBER: _ClassVar[int]
    CDI_DEVICES_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    annotations: _containers.ScalarMap[str, str]
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    env: _containers.RepeatedCompositeFieldContainer[KeyValue]
    hooks: Hooks
    linux: LinuxContainerAdjustment
    rlimits: _containers.RepeatedCompositeFieldContainer[POSIXRlimit]
    CDI_devices: _containers.RepeatedCompositeFieldContainer[CDIDevice]
    args: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, annotations: _Optional[_Mapping[str, str]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., env: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., hooks: _Optional[_Union[Hooks, _Mapping]] = ..., linux: _Optional[_Union[LinuxContainerAdjustment, _Mapping]] = ..., rlimits: _Optional[_Iterable[_Union[POSIXRlimit, _Mapping]]] = ..., CDI_devices: _Optional[_Iterable[_Union[CDIDevice, _Mapping]]] = ..., args: _Optional[_Iterable[str]] = ...) -> None: ...

class LinuxContainerAdjustment(_message.Message):
    __slots__ = ("devices", "resources", "cgroups_path", "oom_score_adj", "io_priority", "seccomp_policy", "namespaces", "sysctl", "net_devices", "scheduler", "rdt", "memory_policy")
    class SysctlEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class NetDevicesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: LinuxNetDevice
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[LinuxNetDevice, _Mapping]] = ...) -> None: ...
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    CGROUPS_PATH_FIELD_NUMBER: _ClassVar[int]
    OOM_SCORE_ADJ_FIELD_NUMBER: _ClassVar[int]
    IO_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SECCOMP_POLICY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    SYSCTL_FIELD_NUMBER: _ClassVar[int]
    NET_DEVICES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    RDT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_POLICY_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[LinuxDevice]
    resources: LinuxResources
    cgroups_path: str
    oom_score_adj: OptionalInt
    io_priority: LinuxIOPriority
    seccomp_policy: LinuxSeccomp
    namespaces: _containers.RepeatedCompositeFieldContainer[LinuxNamespace]
    sysctl: _containers.ScalarMap[str, str]
    net_devices: _containers.MessageMap[str, LinuxNetDevice]
    scheduler: LinuxScheduler
    rdt: LinuxRdt
    memory_policy: LinuxMemoryPolicy
    def __init__(self, devices: _Optional[_Iterable[_Union[LinuxDevice, _Mapping]]] = ..., resources: _Optional[_Union[LinuxResources, _Mapping]] = ..., cgroups_path: _Optional[str] = ..., oom_score_adj: _Optional[_Union[OptionalInt, _Mapping]] = ..., io_priority: _Optional[_Union[LinuxIOPriority, _Mapping]] = ..., seccomp_policy: _Optional[_Union[LinuxSeccomp, _Mapping]] = ..., namespaces: _Optional[_Iterable[_Union[LinuxNamespace, _Mapping]]] = ..., sysctl: _Optional[_Mapping[str, str]] = ..., net_devices: _Optional[_Mapping[str, LinuxNetDevice]] = ..., scheduler: _Optional[_Union[LinuxScheduler, _Mapping]] = ..., rdt: _Optional[_Union[LinuxRdt, _Mapping]] = ..., memory_policy: _Optional[_Union[LinuxMemoryPolicy, _Mapping]] = ...) -> None: ...

class ContainerUpdate(_message.Message):
    __slots__ = ("container_id", "linux", "ignore_failure")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    LINUX_FIELD_NUMBER: _ClassVar[int]
    IGNORE_FAILURE_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    linux: LinuxContainerUpdate
    ignore_failure: bool
    def __init__(self, container_id: _Optional[str] = ..., linux: _Optional[_Union[LinuxContainerUpdate, _Mapping]] = ..., ignore_failure: _Optional[bool] = ...) -> None: ...

class LinuxContainerUpdate(_message.Message):
    __slots__ = ("resources",)
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    resources: LinuxResources
    def __init__(self, resources: _Optional[_Union[LinuxResources, _Mapping]] = ...) -> None: ...

class ContainerEviction(_message.Message):
    __slots__ = ("container_id", "reason")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    reason: str
    def __init__(self, container_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class KeyValue(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class OptionalString(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: str
    def __init__(self, value: _Optional[str] = ...) -> None: ...

class OptionalRepeatedString(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, value: _Optional[_Iterable[str]] = ...) -> None: ...

class OptionalInt(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class OptionalInt32(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class OptionalUInt32(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class OptionalInt64(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class OptionalUInt64(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class OptionalBool(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bool
    def __init__(self, value: _Optional[bool] = ...) -> None: ...

class OptionalFileMode(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...
