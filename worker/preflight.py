"""Start-up checks that run before the worker opens its port or loads the model, so an operator learns
of a typo in a flag at once: each problem is a ConfigError naming the flag, the file or the port, and
what to do (the command line prints it as one line and exits 2)."""
from __future__ import annotations

import os
import pathlib
import socket
import ssl

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.loader import check_checkpoint


def read_file(path: str, flag: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror or e})") from e


def read_token(path: str) -> str:
    """The bearer token in --auth-token-file: its text without surrounding whitespace."""
    try:
        token = read_file(path, "--auth-token-file").decode().strip()
    except UnicodeDecodeError as e:
        raise ConfigError(f"--auth-token-file {path}: not text (a token is printable ASCII)") from e
    if not token:
        raise ConfigError(f"--auth-token-file {path} is empty: write the bearer token into it, or leave the flag "
                          f"out to serve without a token")
    if not all(" " <= c <= "~" for c in token):
        raise ConfigError(f"--auth-token-file {path}: the token holds characters other than printable ASCII, which "
                          f"an 'authorization' header cannot carry")
    return token


def _no_password() -> bytes:
    return b""  # an encrypted key then fails to load (gRPC cannot use one) instead of prompting on a tty


def read_tls(cert_file: str, key_file: str, ca_file: str) -> tuple[bytes, bytes, bytes | None]:
    """(key, certificate chain, client CA bundle or None) as PEM bytes, after checking that the key
    belongs to the certificate and that the CA bundle holds a certificate."""
    cert = read_file(cert_file, "--tls-cert-file")
    key = read_file(key_file, "--tls-key-file")
    ca = read_file(ca_file, "--tls-client-ca-file") if ca_file else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_password)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"--tls-cert-file {cert_file} / --tls-key-file {key_file}: not a PEM certificate chain "
                          f"and its unencrypted private key ({getattr(e, 'reason', None) or e})") from e
    if ca is not None:
        try:
            context.load_verify_locations(cadata=ca.decode())
        except (ssl.SSLError, ValueError) as e:
            raise ConfigError(f"--tls-client-ca-file {ca_file}: not a PEM CA bundle "
                              f"({getattr(e, 'reason', None) or e})") from e
    return key, cert, ca


def check_writable_dir(path: str, flag: str) -> None:
    """path is a directory this process can write into (made if missing)."""
    directory = pathlib.Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".metrale-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: not a directory this worker can write into ({e.strerror or e})") from e


def check_port(host: str, port: int, flag: str) -> None:
    """Refuses a port another process listens on. Binds a throwaway socket the way gRPC does
    (SO_REUSEADDR, so a port in TIME_WAIT passes), on each address `host` resolves to; one that binds is
    enough, as for gRPC. Port 0 (any free port, or off) passes."""
    if not port:
        return
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: cannot resolve it ({e.strerror})") from e
    failures = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
                return
            except OSError as e:
                failures.append(e)
    raise port_error(host, port, flag, failures[0])


def port_error(host: str, port: int, flag: str, cause: BaseException) -> ConfigError:
    reason = getattr(cause, "strerror", None) or str(cause).splitlines()[0]
    return ConfigError(f"{flag} {port}: cannot listen on {host}:{port} ({reason}); another process holds the port: "
                       f"stop it, or choose another {flag}")


def check_model(model: str) -> None:
    """The checkpoint in --model parses and holds every tensor its config.json needs (headers only).
    The built-in default model (empty `model`) is the worker's own and is not checked."""
    if model:
        check_checkpoint(model, ModelConfig.from_dir(model))
