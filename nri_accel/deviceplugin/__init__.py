"""The kubelet device plugin: advertises the Inventory's devices to kubelet and answers
Allocate with the trusted grant annotation that the NRI plugin honours.

Modules: resources (pure: resource names, device lists, preferred allocation, the grant
annotation; no grpc, safe for the NRI side to import), server (grpcio servers,
registration, `nri-accel device-plugin`), deviceplugin_pb2/_grpc (generated from
api/deviceplugin.proto). This package is the only importer of grpc; importing it does
not import grpc.
"""
