"""Security: TLS, mutual TLS, the bearer token, message and request limits, reflection off."""
from __future__ import annotations

import datetime

import grpc
import pytest

from conftest import start_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from metrale.worker.v1 import worker_pb2 as pb
from metrale.worker.v1 import worker_pb2_grpc as pb_grpc


def make_ca_and_cert(tmp_path, name: str, ca=None, server: bool = True):
    """A CA (when ca is None) or a certificate signed by ca; PEM files under tmp_path."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1)))
    if ca is None:
        builder = builder.issuer_name(subject).add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        cert = builder.sign(key, hashes.SHA256())
    else:
        ca_key, ca_cert = ca
        builder = builder.issuer_name(ca_cert.subject).add_extension(
            x509.BasicConstraints(ca=False, path_length=None), True)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), False)
        cert = builder.sign(ca_key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / f"{name}.key").write_bytes(key_pem)
    (tmp_path / f"{name}.crt").write_bytes(cert_pem)
    return key, cert, tmp_path / f"{name}.key", tmp_path / f"{name}.crt"


def test_tls_and_mutual_tls(tiny_model, tmp_path):
    ca_key, ca_cert, _, ca_file = make_ca_and_cert(tmp_path, "ca")
    _, _, server_key, server_crt = make_ca_and_cert(tmp_path, "server", ca=(ca_key, ca_cert))
    _, _, client_key, client_crt = make_ca_and_cert(tmp_path, "client", ca=(ca_key, ca_cert), server=False)
    from test_cli import free_port
    health_port = free_port()
    server = start_server(tiny_model, worker_changes=dict(tls_cert_file=str(server_crt), tls_key_file=str(server_key),
                                                          tls_client_ca_file=str(ca_file), health_port=health_port))
    try:
        target = f"localhost:{server.port}"
        # Probes reach health in plaintext on the health port, and only health.
        probe = grpc.insecure_channel(f"127.0.0.1:{health_port}")
        assert health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.ModelWorkerStub(probe).Info(pb.InfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with_cert = grpc.ssl_channel_credentials(ca_file.read_bytes(), client_key.read_bytes(),
                                                 client_crt.read_bytes())
        stub = pb_grpc.ModelWorkerStub(grpc.secure_channel(target, with_cert))
        assert stub.Info(pb.InfoRequest(), timeout=10).architecture == "llama"
        no_cert = pb_grpc.ModelWorkerStub(grpc.secure_channel(target, grpc.ssl_channel_credentials(ca_file.read_bytes())))
        with pytest.raises(grpc.RpcError) as info:
            no_cert.Info(pb.InfoRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        plaintext = pb_grpc.ModelWorkerStub(grpc.insecure_channel(target))
        with pytest.raises(grpc.RpcError):
            plaintext.Info(pb.InfoRequest(), timeout=5)
    finally:
        server.stop()
    server = start_server(tiny_model, worker_changes=dict(tls_cert_file=str(server_crt), tls_key_file=str(server_key)))
    try:  # server-only TLS: any client that trusts the CA gets in
        creds = grpc.ssl_channel_credentials(ca_file.read_bytes())
        stub = pb_grpc.ModelWorkerStub(grpc.secure_channel(f"localhost:{server.port}", creds))
        assert stub.Info(pb.InfoRequest(), timeout=10).vocab_size == 512
    finally:
        server.stop()


def test_bearer_token_required_except_for_health(tiny_model, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    server = start_server(tiny_model, worker_changes=dict(auth_token_file=str(token_file)))
    try:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.ModelWorkerStub(channel)
        for md in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret-token")]):
            with pytest.raises(grpc.RpcError) as info:
                stub.Info(pb.InfoRequest(), metadata=md)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], stopping=pb.StoppingCriteria(max_new_tokens=2))))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            list(stub.DecodeStream(iter([pb.DecodeRequest(sequence_ids=[1])])))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        with pytest.raises(grpc.RpcError) as info:
            list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = [("authorization", "Bearer s3cret-token")]
        assert stub.Info(pb.InfoRequest(), metadata=ok).vocab_size == 512
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()


def test_message_size_limit_and_reflection_off(tiny_model):
    server = start_server(tiny_model, worker_changes=dict(max_message_bytes=4096, reflection=False))
    try:
        stub = server.stub()
        sid = stub.AllocSequence(pb.AllocSequenceRequest(max_total_tokens=400)).sequence_id
        with pytest.raises(grpc.RpcError) as info:
            stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=sid, token_ids=[300] * 3000)]))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=sid, token_ids=[1, 2])])).tokens
        stub.Release(pb.ReleaseRequest(sequence_ids=[sid]))
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        refl = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(server.address))
        with pytest.raises(grpc.RpcError) as info:
            list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop()
