"""grpc.health.v1 check over TLS, run by the kubelet's exec probes (its own gRPC probes speak plaintext only).

    python tls_health_probe.py --port 50051 --server-name NAME --ca-file ca.crt [--cert-file C --key-file K]

Connects to 127.0.0.1:PORT, verifies the worker's certificate against --ca-file for NAME, presents
--cert-file/--key-file when the worker demands client certificates (mutual TLS), and exits 0 only when
Health/Check("") answers SERVING within --timeout seconds.
"""
import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    parser = argparse.ArgumentParser(prog="tls_health_probe")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--server-name", required=True)
    parser.add_argument("--ca-file", required=True)
    parser.add_argument("--cert-file")
    parser.add_argument("--key-file")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()

    def read(path):
        with open(path, "rb") as f:
            return f.read()

    client = args.cert_file and args.key_file
    creds = grpc.ssl_channel_credentials(root_certificates=read(args.ca_file),
                                         private_key=read(args.key_file) if client else None,
                                         certificate_chain=read(args.cert_file) if client else None)
    options = [("grpc.ssl_target_name_override", args.server_name), ("grpc.default_authority", args.server_name)]
    with grpc.secure_channel(f"127.0.0.1:{args.port}", creds, options=options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"health check failed: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


sys.exit(main())
