"""WorkerConfig (the gRPC layer's settings) and the CLI flags derived from it and EngineConfig.

Every field of both dataclasses is a `serve` flag named after it (max_slots -> --max-slots), with the
dataclass default as its default; the Helm chart renders the same flags."""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.errors import ConfigError


@dataclass(frozen=True)
class WorkerConfig:
    host: str = field(default="0.0.0.0", metadata={"help": "address to listen on"})
    port: int = field(default=50051, metadata={"help": "gRPC port"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics HTTP port; 0: off"})
    health_port: int = field(default=0, metadata={
        "help": "plaintext port serving only grpc.health.v1, for probes when the main port needs TLS or a "
                "token; 0: off"})
    max_message_bytes: int = field(default=64 << 20, metadata={"help": "largest gRPC message, each direction"})
    grace_period_s: float = field(default=30.0, metadata={
        "help": "on SIGTERM/SIGINT: seconds to let live sequences finish before the server stops"})
    reflection: bool = field(default=True, metadata={"help": "serve gRPC server reflection (grpcurl list/describe)"})
    tls_cert_file: str = field(default="", metadata={"help": "PEM server certificate chain; empty: plaintext"})
    tls_key_file: str = field(default="", metadata={"help": "PEM private key of tls_cert_file"})
    tls_client_ca_file: str = field(default="", metadata={
        "help": "PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)"})
    auth_token_file: str = field(default="", metadata={
        "help": "file holding a bearer token every call must carry ('authorization: Bearer <token>'); "
                "health checks stay open for probes; empty: no token"})
    max_live_sequences_per_client: int = field(default=0, metadata={
        "help": "most live sequences one client (peer address, or x-client-id metadata) may hold; 0: no limit"})
    sequence_idle_timeout_s: float = field(default=0.0, metadata={
        "help": "release a sequence no call touched for this many seconds (a crashed router's lease); 0: never"})
    step_watchdog_s: float = field(default=0.0, metadata={
        "help": "health turns NOT_SERVING while one engine step runs longer than this; 0: off"})
    stream_interval: int = field(default=1, metadata={
        "help": "the gateway service's streamed Generate: send a choice's tokens in chunks of this many (its first "
                "token and its last chunk at once), as vLLM's --stream-interval: fewer messages for the event loop "
                "that also launches the steps, at the cost of a burstier stream; 1: every token as it comes"})
    profile_dir: str = field(default="", metadata={
        "help": "directory the gateway service's StartProfile / StopProfile write torch.profiler traces under "
                "(vLLM's VLLM_TORCH_PROFILER_DIR; a call may name a directory inside it); empty: profiling is off"})
    gil_switch_interval_us: int = field(default=0, metadata={
        "help": "the worker process's Python thread switch interval (sys.setswitchinterval), in microseconds: "
                "how long a thread that wants the GIL waits before the holder is made to drop it; 0: Python's "
                "default (5000)"})

    def __post_init__(self):
        for name in ("port", "metrics_port", "health_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        ports = [(name, getattr(self, name)) for name in ("port", "metrics_port", "health_port") if getattr(self, name)]
        for i, (a, port) in enumerate(ports):
            for b, other in ports[i + 1:]:
                if port == other:
                    raise ConfigError(f"{a} and {b} are both {port}: each needs a port of its own")
        if self.max_message_bytes < 1024:
            raise ConfigError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        for name in ("grace_period_s", "sequence_idle_timeout_s", "step_watchdog_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.stream_interval < 1:
            raise ConfigError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.gil_switch_interval_us < 0:
            raise ConfigError(f"gil_switch_interval_us must be >= 0, got {self.gil_switch_interval_us}")
        if self.max_live_sequences_per_client < 0:
            raise ConfigError(f"max_live_sequences_per_client must be >= 0, got {self.max_live_sequences_per_client}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per dataclass field, default from the dataclass; a field's metadata may add vLLM's names for it
    ("aliases", the same flag under another name; "negated_by", a flag that sets a bool field false)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        kwargs = {"default": f.default, "help": f"{f.metadata.get('help', '')} (default: %(default)s)"}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            kwargs["metavar"] = f.name.upper()
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        group.add_argument(flag_name(f.name), *f.metadata.get("aliases", ()), dest=f.name, **kwargs)
        if "negated_by" in f.metadata:
            group.add_argument(f.metadata["negated_by"], dest=f.name, action="store_false", default=argparse.SUPPRESS,
                               help=f"the same as {flag_name('no_' + f.name)}")


def name_the_flag(message: str) -> str:
    """A configuration error as the command line shows it: a message that opens with a WorkerConfig or EngineConfig
    field's name ("port must be ...", "fp8_skip_layers: layer 40 ...") opens with its flag instead ("--port must
    be ..."): what the user typed. Others as they are."""
    head, sep, rest = message.partition(" ")
    field = head.removesuffix(":")
    names = {f.name for cls in (WorkerConfig, EngineConfig) for f in dataclasses.fields(cls)}
    if field not in names:
        return message
    return flag_name(field) + head[len(field):] + sep + rest


def config_from_args(cls: type, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The `serve` subcommand's flags: WorkerConfig's then EngineConfig's."""
    parser = parser or argparse.ArgumentParser(prog="metrale-worker serve")
    add_config_arguments(parser, WorkerConfig)
    add_config_arguments(parser, EngineConfig)
    return parser
