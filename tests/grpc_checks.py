"""Checks shared by the gRPC tests of the colocated stack and of the cluster."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def assert_health_and_reflection(target: str) -> None:
    """Both health services answer SERVING and reflection lists the Generation service's methods."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "pdserve.v1.Generation"):
            reply = check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "pdserve.v1.Generation" in db.get_services()
        methods = DescriptorPool(db).FindServiceByName("pdserve.v1.Generation").methods_by_name
        assert set(methods) == {"Generate", "ListModels"}
