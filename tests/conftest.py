"""Shared test helpers: checkpoints, engines and real gRPC servers on real sockets."""
from __future__ import annotations

import asyncio
import pathlib
import sys
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if not (ROOT / "metrale" / "worker" / "v1" / "worker_pb2.py").exists():  # a source checkout without a build
    import runpy

    runpy.run_path(str(ROOT / "protos" / "generate.py"))["generate"]()
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from engine.checkpoint import write_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from metrale.worker.v1 import worker_pb2 as pb  # noqa: E402
from metrale.worker.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402

# Tiny checkpoints covering the four architectures, two configs each: GQA ratios, tied and untied
# embeddings, rope scaling (llama3, linear, dynamic), q/k/v bias, q/k norm, a sliding window, and a
# head_dim * heads != hidden layout.
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama-gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha-tied-llama3": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "mistral-gqa4-window": ("mistral", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=24)),
    "mistral-linear": ("mistral", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-dynamic": ("qwen2", dict(max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "qwen3-qknorm": ("qwen3", dict()),
    "qwen3-gqa8-wide-heads": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=16,
                                            tie_word_embeddings=True)),
}


# Chat prompts asked of the default model, by the CPU and the GPU real-model tests alike.
DEFAULT_MODEL_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Name three prime numbers."},
     {"role": "assistant", "content": "2, 3 and 5."},
     {"role": "user", "content": "And the next one?"}],
]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: write_checkpoint(root / name, arch=arch, shape="tiny", seed=i + 1, **overrides)
            for i, (name, (arch, overrides)) in enumerate(TINY_CONFIGS.items())}


@pytest.fixture(scope="session")
def tiny_model(checkpoints) -> pathlib.Path:
    return checkpoints["llama-gqa"]


def engine_config(model: pathlib.Path, **changes) -> EngineConfig:
    base = dict(model=str(model), device="cpu", num_kv_blocks=512, max_seq_len=512, max_slots=64)
    base.update(changes)
    return EngineConfig(**base)


class ServerThread:
    """A real Worker (grpc.aio server on a real socket) on its own event loop thread."""

    def __init__(self, worker_config: WorkerConfig, engine_cfg: EngineConfig):
        from worker.server import Worker

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.thread.start()
        self.worker = Worker(worker_config, engine_cfg)
        self.port = self.run(self.worker.start(), timeout=120)
        self.address = f"localhost:{self.port}"

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def engine(self):
        return self.worker.runner.engine

    def engine_call(self, fn):
        """Runs fn(engine) on the engine thread (for checks of internal state)."""
        return self.run(self.worker.runner.call(fn))

    def stub(self) -> pb_grpc.ModelWorkerStub:
        return pb_grpc.ModelWorkerStub(grpc.insecure_channel(self.address))

    def stop(self) -> None:
        try:
            self.run(self.worker.stop(0.5))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def start_server(model: pathlib.Path, worker_changes: dict | None = None, **engine_changes) -> ServerThread:
    wc = WorkerConfig(host="127.0.0.1", port=0, **(worker_changes or {}))
    return ServerThread(wc, engine_config(model, **engine_changes))


@pytest.fixture(scope="session")
def default_model() -> pathlib.Path:
    """The built-in default model (SmolLM2-135M-Instruct) converted into the cache dir: fetched and
    converted on the first run on a machine, shared by every test after."""
    from engine.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model)
    yield srv
    srv.stop()


@pytest.fixture()
def stub(server) -> pb_grpc.ModelWorkerStub:
    return server.stub()


def alloc(stub, max_total_tokens=64, **kwargs) -> int:
    sampling = kwargs.pop("sampling", None)
    stopping = kwargs.pop("stopping", None)
    req = pb.AllocSequenceRequest(max_total_tokens=max_total_tokens, sampling=sampling, stopping=stopping, **kwargs)
    return stub.AllocSequence(req).sequence_id


def generate_via_grpc(stub, prompts: list[list[int]], max_new_tokens: int, sampling=None,
                      chunk: int = 0, ignore_eos: bool = True) -> list[list[int]]:
    """Alloc -> Prefill (one batch; chunked when chunk > 0) -> Decode (one batch) ... -> Release."""
    stopping = pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    ids = [alloc(stub, len(p) + max_new_tokens + 1, sampling=sampling, stopping=stopping) for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in ids}
    if chunk:
        longest = max(len(p) for p in prompts)
        for start in range(0, longest, chunk):
            items = [pb.PrefillItem(sequence_id=i, token_ids=p[start:start + chunk],
                                    partial=start + chunk < len(p))
                     for i, p in zip(ids, prompts) if start < len(p)]
            for t in stub.Prefill(pb.PrefillRequest(items=items)).tokens:
                out[t.sequence_id].append(t.token_id)
    else:
        resp = stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=i, token_ids=p)
                                                     for i, p in zip(ids, prompts)]))
        for t in resp.tokens:
            out[t.sequence_id].append(t.token_id)
    running = [i for i in ids]
    while running:
        resp = stub.Decode(pb.DecodeRequest(sequence_ids=running))
        for t in resp.tokens:
            out[t.sequence_id].append(t.token_id)
        running = [t.sequence_id for t in resp.tokens if t.finish_reason == pb.FINISH_REASON_NONE]
    stub.Release(pb.ReleaseRequest(sequence_ids=ids))
    return [out[i] for i in ids]


class ExecBackend:
    """Records the step at capture and runs it at every replay (what a CUDA graph does, minus the device)."""

    def capture(self, step):
        return step

    def replay(self, graph):
        graph()
        return None

    def is_done(self, marker):
        return True

    def destroy(self, graph):
        pass

    def pool_bytes(self):
        return 4096

    def recoverable(self, error):
        return True


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
