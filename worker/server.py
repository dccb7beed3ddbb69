"""The grpc.aio server: servicer, the gateway service, health, reflection, auth interceptor, TLS, drain.

Start-up: the token and TLS files, the ports and the checkpoint's headers are checked first (worker/
preflight.py: one ConfigError, before anything loads); the port opens with health NOT_SERVING (probes
get an answer while the model loads), then the engine loads on its thread and runs one real step
(warm-up), then health turns SERVING. A signal during start-up stops the load (see serve).
Drain (SIGTERM/SIGINT, or Worker.drain): health NOT_SERVING at once, AllocSequence and Generate get
UNAVAILABLE, every other call keeps working so live sequences can finish, and the server stops
once none is left or the grace period is over (open DecodeStreams end then, with OK)."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from engine.engine import Engine
from engine.warm_up import warm_up
from engine.config import EngineConfig
from engine.errors import LoadCancelled
from engine.loader import cancel_loading
from engine.tokenizer import Tokenizer
from metrale.worker.v1 import worker_pb2_grpc as pb_grpc
from worker import preflight, ranks
from worker.config import WorkerConfig
from worker.errors import Unavailable
from worker.gateway import SERVICE_NAME as GATEWAY_SERVICE_NAME
from worker.gateway import VllmEngineServicer
from worker.gateway_pb import vpb_grpc
from worker.leases import Leases
from worker.metrics import Metrics
from worker.runner import EngineRunner
from worker.servicer import SERVICE_NAME, ModelWorkerServicer

log = logging.getLogger(__name__)
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# After a signal during start-up: how long start-up may take to stop (the weight load checks between
# tensors; kernel compilation and graph capture do not stop) before the process exits without waiting.
START_STOP_GRACE_S = 5.0
# A tensor-parallel rank that ends ends the worker: its exit code, and how long health says NOT_SERVING first.
RANK_EXIT_CODE = 3
RANK_EXIT_DELAY_S = 1.0


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health checks must carry `authorization: Bearer <token>`."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token "
                                                                 "(metadata 'authorization: Bearer <token>')")
        # A refusal must have the arity of the method it answers: the streaming methods by name.
        self._deny = {"Generate": grpc.unary_stream_rpc_method_handler(deny),
                      "GetTokenizer": grpc.unary_stream_rpc_method_handler(deny),
                      "SubscribeKvEvents": grpc.unary_stream_rpc_method_handler(deny),
                      "DecodeStream": grpc.stream_stream_rpc_method_handler(deny),
                      "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(deny)}
        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if metadata.get("authorization") == self._expected:
            return await continuation(details)
        return self._deny.get(details.method.rsplit("/", 1)[-1], self._deny_unary)


class Worker:
    def __init__(self, config: WorkerConfig, engine_config: EngineConfig):
        self.config = config
        self.engine_config = engine_config
        self.metrics = Metrics()
        self.leases = Leases(config.max_live_sequences_per_client, config.sequence_idle_timeout_s)
        self.health = health_aio.HealthServicer()
        self.runner: EngineRunner | None = None
        self.servicer: ModelWorkerServicer | None = None
        self.gateway: VllmEngineServicer | None = None
        self.server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self.port = 0
        self.health_port = 0
        self.metrics_port = 0
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._watchdog_tripped = False

    async def start(self) -> int:
        """Checks the token and TLS files, the ports and the checkpoint's headers (worker/preflight.py:
        a ConfigError before anything loads), opens the ports, loads the engine, warms up, turns health
        SERVING. Returns the bound port. On failure it stops what it started, then raises."""
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> int:
        cfg = self.config
        token = preflight.read_token(cfg.auth_token_file) if cfg.auth_token_file else None
        tls = preflight.read_tls(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file) \
            if cfg.tls_cert_file else None
        for flag, port in (("--port", cfg.port), ("--health-port", cfg.health_port),
                           ("--metrics-port", cfg.metrics_port)):
            preflight.check_port(cfg.host, port, flag)
        preflight.check_model(self.engine_config.model)
        if cfg.profile_dir:
            preflight.check_writable_dir(cfg.profile_dir, "--profile-dir")
        ranks.check(self.engine_config)

        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        interceptors = [BearerTokenInterceptor(token)] if token else []
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self._set_health(NOT_SERVING)
        if tls:
            key, cert, ca = tls
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                require_client_auth=ca is not None)
            self.port = _add_port(lambda a: self.server.add_secure_port(a, creds), cfg.host, cfg.port, "--port")
        else:
            self.port = _add_port(self.server.add_insecure_port, cfg.host, cfg.port, "--port")
        if cfg.health_port:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = _add_port(self.health_server.add_insecure_port, cfg.host, cfg.health_port,
                                         "--health-port")
            await self.health_server.start()
        if cfg.metrics_port:  # serves the RPC metrics at once; the engine's gauges appear once it loaded
            try:
                self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.host)
            except OSError as e:
                raise preflight.port_error(cfg.host, cfg.metrics_port, "--metrics-port", e) from e

        self.servicer = ModelWorkerServicer(None, self.leases, self.metrics)
        pb_grpc.add_ModelWorkerServicer_to_server(self.servicer, self.server)
        self.gateway = VllmEngineServicer(self.metrics, self._unhealthy_reason, cfg.stream_interval, cfg.profile_dir)
        vpb_grpc.add_VllmEngineServicer_to_server(self.gateway, self.server)
        if cfg.reflection:
            reflection.enable_server_reflection((SERVICE_NAME, GATEWAY_SERVICE_NAME, HEALTH_SERVICE,
                                                 reflection.SERVICE_NAME), self.server)
        await self.server.start()

        # The engine loads on its own thread while health answers NOT_SERVING and calls get UNAVAILABLE.
        t0 = time.perf_counter()
        log.info("loading %s", self.engine_config.model or "the built-in default model")
        self._loop = asyncio.get_running_loop()
        self.runner = await EngineRunner.start(lambda: ranks.start_engine(self.engine_config, self._rank_exited))
        await self.runner.call(warm_up)
        self.metrics.engine.engine = self.runner.engine
        self.runner.streams.metrics = self.metrics  # the Generate streams' tokens, recorded per step
        # Generate's text and chat prompts (people with grpcurl): the checkpoint's tokenizer, read once here
        # and never on the engine's path; None without tokenizer.json, a ConfigError when it cannot be read.
        self.servicer.tokenizer = await asyncio.to_thread(Tokenizer.from_dir, self.runner.engine.model_path)
        await self.gateway.attach(self.runner, self.servicer.tokenizer)
        self.servicer.grammars = self.gateway.grammars  # one compiler (and its cache) for both services
        self.servicer.runner = self.runner  # ModelWorker answers from here on
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        # Everything alive after start-up (torch, the model, ~200k objects) moves out of the collector's
        # reach: a full collection over it would pause every thread for tens of milliseconds.
        gc.freeze()
        if cfg.gil_switch_interval_us:
            sys.setswitchinterval(cfg.gil_switch_interval_us / 1e6)
        await self._set_health(SERVING)
        log.info("serving %s on %s (port %d) in %.1fs; metrics port %s", self.runner.engine.model_path, cfg.host,
                 self.port, time.perf_counter() - t0, self.metrics_port or "off")
        return self.port

    def _rank_exited(self, message: str) -> None:
        """A tensor-parallel rank ended (worker/ranks.py, on its watcher thread): health NOT_SERVING, then the
        process exits with RANK_EXIT_CODE and `message` as its last line, whatever the engine was doing (a
        collective waiting for the lost rank included)."""
        log.error("%s: health NOT_SERVING, exiting", message)
        try:
            asyncio.run_coroutine_threadsafe(self._set_health(NOT_SERVING), self._loop).result(RANK_EXIT_DELAY_S)
            time.sleep(RANK_EXIT_DELAY_S)  # probes see NOT_SERVING before the port closes
        except Exception:  # noqa: BLE001 - the loop is stuck or gone: exit all the same
            pass
        print(f"metrale-worker: {message}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(RANK_EXIT_CODE)

    async def _set_health(self, status) -> None:
        for service in ("", SERVICE_NAME, GATEWAY_SERVICE_NAME):
            await self.health.set(service, status)

    def _unhealthy_reason(self) -> str:
        """Why the gateway service's HealthCheck says unhealthy once the model has loaded; "" if it is not."""
        if self.servicer.draining:
            return "the worker is draining (shutting down)"
        if self._watchdog_tripped:
            return f"an engine step has run for over {self.config.step_watchdog_s:g}s (step watchdog)"
        return ""

    async def _housekeeping(self) -> None:
        """Once a second: release sequences idle past their lease; the step watchdog."""
        while True:
            await asyncio.sleep(min(1.0, self.config.step_watchdog_s or 1.0))
            expired = self.leases.expired()
            if expired:
                def release_idle(engine: Engine) -> list[int]:
                    ids = [i for i in self.leases.expired() if i in engine.sequences]
                    if ids:
                        engine.release(ids)
                    self.leases.remove(self.leases.expired())
                    return ids
                ids = await self.runner.run(release_idle)
                if ids:
                    log.warning("released %d sequences idle for over %.0fs: %s", len(ids),
                                self.config.sequence_idle_timeout_s, ids[:16])
            if self.config.step_watchdog_s:
                started = self.runner.busy_since
                stuck = started is not None and time.monotonic() - started > self.config.step_watchdog_s
                if stuck != self._watchdog_tripped:
                    self._watchdog_tripped = stuck
                    if stuck:
                        log.error("an engine step has run for over %.1fs: health NOT_SERVING",
                                  self.config.step_watchdog_s)
                    if not self.servicer.draining:
                        await self._set_health(NOT_SERVING if stuck else SERVING)

    async def drain(self, grace_s: float | None = None) -> None:
        """Stops taking new sequences, lets live ones finish, then stops the server."""
        grace = self.config.grace_period_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        await self._set_health(NOT_SERVING)
        if self.servicer is not None:
            self.servicer.draining = self.gateway.draining = True
            # Generate calls still waiting for room go to another worker now (the live ones finish here).
            self.runner.streams.refuse_waiting(Unavailable("the worker is draining; send the request to another "
                                                           "worker"))
            log.info("draining: %d live sequences, grace %.1fs", len(self.runner.engine.sequences), grace)
            while time.monotonic() < deadline and (self.runner.engine.sequences or len(self.runner.streams)):
                await asyncio.sleep(0.05)
            self.servicer.end_streams()  # an open DecodeStream would otherwise hold the stop to the grace
        await self.stop(max(0.0, deadline - time.monotonic()))

    async def stop(self, grace_s: float = 0.0) -> None:
        for task in self._tasks:
            task.cancel()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.runner is not None:
            await self.runner.shutdown()
        if self.gateway is not None:
            self.gateway.profiler.close()
        self.metrics.close()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def _add_port(add, host: str, port: int, flag: str) -> int:
    """add(address) -> bound port (a grpc server's add_*_port), its failure as a ConfigError naming flag."""
    try:
        bound = add(f"{host}:{port}")
    except RuntimeError as e:  # recent grpcio raises where older versions returned 0
        raise preflight.port_error(host, port, flag, e) from e
    if not bound:
        raise preflight.port_error(host, port, flag, OSError("bind failed"))
    return bound


async def serve(config: WorkerConfig, engine_config: EngineConfig) -> None:
    """Runs a worker until SIGTERM/SIGINT, then drains it. A signal during start-up stops the model load
    (engine.loader.cancel_loading) and returns without serving; where start-up does not stop within
    START_STOP_GRACE_S (a step that cannot be interrupted: kernel compilation, graph capture), the process
    exits at once, with code 0 like a clean stop: nothing was served, so nothing is lost."""
    worker = Worker(config, engine_config)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    starting = asyncio.create_task(worker.start())
    signalled = asyncio.create_task(stop_requested.wait())
    await asyncio.wait((starting, signalled), return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("signal received during start-up: stopping the load")
        cancel_loading()
        await asyncio.wait((starting,), timeout=START_STOP_GRACE_S)
        if not starting.done():
            log.warning("start-up did not stop within %.0fs of the signal: exiting now", START_STOP_GRACE_S)
            logging.shutdown()
            os._exit(0)
    if starting.exception() is not None:
        signalled.cancel()
        if isinstance(starting.exception(), LoadCancelled):
            log.info("stopped before serving")
            return
        starting.result()  # raises start-up's error (a ConfigError: one line and exit 2 in __main__)
    await signalled
    log.info("signal received: draining")
    await worker.drain()
    log.info("stopped")
