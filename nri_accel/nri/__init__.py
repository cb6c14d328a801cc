"""NRI, the Node Resource Interface of containerd and CRI-O, for nri-accel.

Modules, bottom up (each says what it owns and imports):
- nri_pb2: generated from api/nri.proto (wire-compatible with NRI v0.12.0); imported
  only by modules of this package;
- nri_views_pb2: generated from api/nri_views.proto, what is read of each request;
- fields: a message's encoding cut into runs of whole fields, decoded one at a time
  (a large request, the event loop free in between);
- mux: the connection multiplexer (two logical connections over one socket);
- stub: the plugin stub (registration, Configure, Synchronize, events, reconnect,
  pre-registered launch) that drives a plugin object's optional handlers;
- adjust: the one builder of ContainerAdjustment, and its protobuf JSON form;
- convert: NRI pods and containers -> the plain ContainerInfo of the pipeline;
- simulator: the runtime side, for tests, benchmarks and the demo.
Nothing outside this package reads or builds an NRI protobuf message itself.

A pure adapter: it imports no domain module, only the plain data it converts to and from
(nri_accel.container, the edit types of nri_accel.inventory), the ttrpc library and
logging. A refusal's status comes from the exception's `status` attribute, not its type.
"""

DEFAULT_SOCKET = "/var/run/nri/nri.sock"
"""Where containerd and CRI-O serve NRI by default."""
