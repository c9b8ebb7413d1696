"""The pinned engine protocol's generated code, imported from `smg-grpc-proto` (the `gateway`
extra) rather than generated here: the package registers `common.proto` and `vllm_engine.proto`
in protobuf's default pool, and a second copy of the same files (vLLM's own servicer imports the
package) would be a duplicate registration. Importing this module raises ModuleNotFoundError
naming `smg_grpc_proto` when the extra is absent: the daemon then serves without it."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name

__all__ = ["SERVICE_NAME", "common_pb2", "vllm_engine_pb2", "vllm_engine_pb2_grpc"]
