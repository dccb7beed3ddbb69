"""Engine errors -> gRPC status codes, in one place."""
from __future__ import annotations

import grpc

from engine import errors

STATUS: dict[type[errors.EngineError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ConfigError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
}


class Unavailable(errors.EngineError):
    """The worker is draining and takes no new sequences."""


class Unauthenticated(errors.EngineError):
    """A call without the bearer token the worker requires."""


STATUS[Unavailable] = grpc.StatusCode.UNAVAILABLE
STATUS[Unauthenticated] = grpc.StatusCode.UNAUTHENTICATED


def status_of(exc: errors.EngineError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL
