from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateContainerRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    container: Container
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[Container, _Mapping]] = ...) -> None: ...

class GlanceCreateContainerRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: PodSandbox
    container: GlanceContainer
    def __init__(self, pod: _Optional[_Union[PodSandbox, _Mapping]] = ..., container: _Optional[_Union[GlanceContainer, _Mapping]] = ...) -> None: ...

class GlanceContainer(_message.Message):
    __slots__ = ("id", "name", "annotations", "env")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    annotations: _containers.ScalarMap[str, str]
    env: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., annotations: _Optional[_Mapping[str, str]] = ..., env: _Optional[_Iterable[str]] = ...) -> None: ...

class SynchronizeRequest(_message.Message):
    __slots__ = ("pods", "containers", "more")
    PODS_FIELD_NUMBER: _ClassVar[int]
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    pods: _containers.RepeatedCompositeFieldContainer[PodSandbox]
    containers: _containers.RepeatedCompositeFieldContainer[SyncedContainer]
    more: bool
    def __init__(self, pods: _Optional[_Iterable[_Union[PodSandbox, _Mapping]]] = ..., containers: _Optional[_Iterable[_Union[SyncedContainer, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class BareSynchronizeRequest(_message.Message):
    __slots__ = ("pods", "containers", "more")
    PODS_FIELD_NUMBER: _ClassVar[int]
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    pods: _containers.RepeatedCompositeFieldContainer[BarePodSandbox]
    containers: _containers.RepeatedCompositeFieldContainer[BareSyncedContainer]
    more: bool
    def __init__(self, pods: _Optional[_Iterable[_Union[BarePodSandbox, _Mapping]]] = ..., containers: _Optional[_Iterable[_Union[BareSyncedContainer, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class BarePodSandbox(_message.Message):
    __slots__ = ("id", "name", "uid", "namespace")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    uid: str
    namespace: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., uid: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class BareSyncedContainer(_message.Message):
    __slots__ = ("id", "pod_sandbox_id", "name", "state")
    ID_FIELD_NUMBER: _ClassVar[int]
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    id: str
    pod_sandbox_id: str
    name: str
    state: int
    def __init__(self, id: _Optional[str] = ..., pod_sandbox_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[int] = ...) -> None: ...

class LargeSyncedContainer(_message.Message):
    __slots__ = ("id", "pod_sandbox_id", "name", "state", "annotations")
    ID_FIELD_NUMBER: _ClassVar[int]
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    pod_sandbox_id: str
    name: str
    state: int
    annotations: _containers.RepeatedCompositeFieldContainer[Annotation]
    def __init__(self, id: _Optional[str] = ..., pod_sandbox_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[int] = ..., annotations: _Optional[_Iterable[_Union[Annotation, _Mapping]]] = ...) -> None: ...

class PodSandbox(_message.Message):
    __slots__ = ("id", "name", "uid", "namespace", "annotations")
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
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    uid: str
    namespace: str
    annotations: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., uid: _Optional[str] = ..., namespace: _Optional[str] = ..., annotations: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Container(_message.Message):
    __slots__ = ("id", "name", "annotations", "env", "mounts", "linux")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    LINUX_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    annotations: _containers.ScalarMap[str, str]
    env: _containers.RepeatedScalarFieldContainer[str]
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    linux: LinuxContainer
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., annotations: _Optional[_Mapping[str, str]] = ..., env: _Optional[_Iterable[str]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., linux: _Optional[_Union[LinuxContainer, _Mapping]] = ...) -> None: ...

class SyncedContainer(_message.Message):
    __slots__ = ("id", "pod_sandbox_id", "name", "state", "annotations")
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
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    pod_sandbox_id: str
    name: str
    state: int
    annotations: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., pod_sandbox_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[int] = ..., annotations: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Mount(_message.Message):
    __slots__ = ("destination",)
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    destination: str
    def __init__(self, destination: _Optional[str] = ...) -> None: ...

class LinuxContainer(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[LinuxDevice]
    def __init__(self, devices: _Optional[_Iterable[_Union[LinuxDevice, _Mapping]]] = ...) -> None: ...

class LinuxDevice(_message.Message):
    __slots__ = ("path", "type", "major", "minor")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    path: str
    type: str
    major: int
    minor: int
    def __init__(self, path: _Optional[str] = ..., type: _Optional[str] = ..., major: _Optional[int] = ..., minor: _Optional[int] = ...) -> None: ...

class LargePodSandbox(_message.Message):
    __slots__ = ("id", "name", "uid", "namespace", "annotations")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    uid: str
    namespace: str
    annotations: _containers.RepeatedCompositeFieldContainer[Annotation]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., uid: _Optional[str] = ..., namespace: _Optional[str] = ..., annotations: _Optional[_Iterable[_Union[Annotation, _Mapping]]] = ...) -> None: ...

class LargeContainer(_message.Message):
    __slots__ = ("id", "name", "annotations", "env", "mounts", "linux")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    LINUX_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    annotations: _containers.RepeatedCompositeFieldContainer[Annotation]
    env: _containers.RepeatedScalarFieldContainer[str]
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    linux: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., annotations: _Optional[_Iterable[_Union[Annotation, _Mapping]]] = ..., env: _Optional[_Iterable[str]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., linux: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Annotation(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class StopContainerRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: EndedPod
    container: EndedContainer
    def __init__(self, pod: _Optional[_Union[EndedPod, _Mapping]] = ..., container: _Optional[_Union[EndedContainer, _Mapping]] = ...) -> None: ...

class StopPodSandboxRequest(_message.Message):
    __slots__ = ("pod",)
    POD_FIELD_NUMBER: _ClassVar[int]
    pod: EndedPod
    def __init__(self, pod: _Optional[_Union[EndedPod, _Mapping]] = ...) -> None: ...

class StateChangeEvent(_message.Message):
    __slots__ = ("event", "pod", "container")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    event: int
    pod: EndedPod
    container: EndedContainer
    def __init__(self, event: _Optional[int] = ..., pod: _Optional[_Union[EndedPod, _Mapping]] = ..., container: _Optional[_Union[EndedContainer, _Mapping]] = ...) -> None: ...

class EndedPod(_message.Message):
    __slots__ = ("id", "uid")
    ID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    id: str
    uid: str
    def __init__(self, id: _Optional[str] = ..., uid: _Optional[str] = ...) -> None: ...

class EndedContainer(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...
