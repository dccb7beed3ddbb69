"""The message and service stubs of Shepherd Model Gateway's vLLM worker protocol, in one place.

`vllm.grpc.engine.VllmEngine` (vllm_engine.proto) and `smg.grpc.common` (common.proto) come from the
pinned PyPI package smg-grpc-proto, whose own generated stubs we import: they were made by protoc for
protobuf 6.33.5 and import under our protobuf 7 runtime (gencode older than the runtime is accepted;
tests/e2e/test_gateway.py imports them with warnings as errors). Should a later protobuf refuse them, the
.proto files ship in the same package (smg_grpc_proto/proto/) for protos/generate.py to compile; only
this module would change.
"""
from __future__ import annotations

from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

__all__ = ["SERVICE_NAME", "cpb", "vpb", "vpb_grpc"]
SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name  # "vllm.grpc.engine.VllmEngine"
