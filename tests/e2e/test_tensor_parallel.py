"""Tensor parallelism on CPU: the worker with --tensor-parallel-size N starts N-1 more processes (gloo), and a
router over real gRPC gets the greedy tokens of the same worker at TP = 1, for each architecture the engine
serves, KV-head counts that do and do not divide by N, and the real default model. A rank that dies ends the
worker with a clear message."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.checkpoint import write_checkpoint
from engine.config import ModelConfig
from engine.shard import ShardPlan
from metrale.worker.v1 import worker_pb2 as pb
from tests.conftest import DEFAULT_MODEL_CHATS, ROOT, generate_via_grpc, random_prompts, start_server

# (arch, config overrides, TP size): KV heads 2 over 2 ranks (split), 1 over 2 (replicated), 3 over 2 (neither:
# ranks hold KV heads 0,0,1 and 1,2,2), and 3 ranks.
CASES = {
    "llama-kv2": ("llama", dict(num_attention_heads=4, num_key_value_heads=2), 2),
    "qwen2-bias-kv1-tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True), 2),
    "qwen3-qknorm-kv3": ("qwen3", dict(num_attention_heads=6, num_key_value_heads=3, head_dim=16), 2),
    "llama-tp3-odd-vocab": ("llama", dict(num_attention_heads=6, num_key_value_heads=2, vocab_size=511,
                                          intermediate_size=100), 3),
}


def serve_tokens(model, prompts, tp: int, max_new_tokens: int = 8, **changes) -> tuple[list, list, int]:
    """Greedy tokens of `prompts` over Prefill/Decode, of one more prompt over Generate (a stream the runner
    decodes with steps in flight), and the Info's TP size, from a worker at tensor_parallel_size tp."""
    srv = start_server(model, tensor_parallel_size=tp, **changes)
    try:
        stub = srv.stub()
        tokens = generate_via_grpc(stub, prompts, max_new_tokens)
        stream = [r.token.token_id for r in stub.Generate(pb.GenerateRequest(
            prompt_token_ids=prompts[0], stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens,
                                                                                 ignore_eos=True)))]
        return tokens, stream, stub.Info(pb.InfoRequest()).tensor_parallel_size
    finally:
        srv.stop()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_over_grpc_match_tp1(tmp_path, case):
    arch, overrides, tp = CASES[case]
    model = write_checkpoint(tmp_path / case, arch=arch, shape="tiny", seed=7, **overrides)
    cfg = ModelConfig.from_dir(model)
    if cfg.num_kv_heads % tp:  # the case holds what its name says
        assert ShardPlan(cfg, 0, tp).num_kv_heads * tp > cfg.num_kv_heads
    prompts = random_prompts([3, 19, 40], cfg.vocab_size, seed=1)
    want = serve_tokens(model, prompts, 1)
    got = serve_tokens(model, prompts, tp)
    assert want[2] == 1 and got[2] == tp
    assert got[:2] == want[:2]


def test_default_model_tp3_matches_tp1(default_model):
    """SmolLM2-135M: 9 query heads and 3 KV heads, so TP 3 (one KV head per rank)."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model)
    prompts = [tok.encode_chat(chat) for chat in DEFAULT_MODEL_CHATS[:2]]
    want = serve_tokens(default_model, prompts, 1, max_new_tokens=6, max_seq_len=256)
    got = serve_tokens(default_model, prompts, 3, max_new_tokens=6, max_seq_len=256)
    assert got[:2] == want[:2]
    assert "Paris" in tok.decode(want[0][0])


def test_verify_and_prefix_cache_under_tp(tmp_path):
    """Verify (draft scoring and KV rollback) and a prefix-cache hit, mirrored to rank 1, agree with TP = 1."""
    model = write_checkpoint(tmp_path / "m", arch="llama", shape="tiny", seed=5, num_key_value_heads=1)
    prompt = random_prompts([33], 512, seed=2)[0]

    def run(tp: int):
        srv = start_server(model, tensor_parallel_size=tp)
        try:
            stub, out = srv.stub(), []
            for _ in range(2):  # the second prompt hits the first one's cached blocks
                seq = stub.AllocSequence(pb.AllocSequenceRequest(max_total_tokens=64)).sequence_id
                first = stub.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(sequence_id=seq, token_ids=prompt)]))
                out.append((first.tokens[0].token_id, first.tokens[0].cached_tokens))
                resp = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(
                    sequence_id=seq, draft_token_ids=[first.tokens[0].token_id, 1, 2])]))
                out.append([(t.token_id, t.seq_len) for t in resp.results[0].tokens])
                out.append(stub.Decode(pb.DecodeRequest(sequence_ids=[seq])).tokens[0].token_id)
                stub.Release(pb.ReleaseRequest(sequence_ids=[seq]))
            return out
        finally:
            srv.stop()

    want, got = run(1), run(2)
    assert want[3][1] > 0  # the second prompt's cached tokens
    assert got == want


def test_a_tp_size_that_does_not_divide_the_heads_is_one_line(tmp_path):
    model = write_checkpoint(tmp_path / "m", arch="llama", shape="tiny")  # 4 heads
    proc = subprocess.run([sys.executable, "-m", "worker", "serve", "--model", str(model), "--device", "cpu",
                           "--port", "0", "--tensor-parallel-size", "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("metrale-worker: ") and "--tensor-parallel-size 3" in last and "4 attention heads" in last


def test_killing_rank_1_ends_the_worker_with_a_clear_message(tmp_path):
    """Rank 1 killed while the worker serves: health turns NOT_SERVING and the worker exits non-zero, naming the
    rank, within seconds (no collective waits forever for the lost rank)."""
    model = write_checkpoint(tmp_path / "m", arch="llama", shape="tiny")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "worker", "serve", "--model", str(model), "--device", "cpu",
                             "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", "2",
                             "--num-kv-blocks", "256", "--max-seq-len", "256"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the worker never served")
        stub = pb_stub(channel)
        prompts = random_prompts([5], 512, seed=0)
        assert len(generate_via_grpc(stub, prompts, 4)[0]) == 4  # both ranks serve
        rank1 = _child_pids(proc.pid)
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode not in (0, None)
        assert time.monotonic() - killed < 30
        last = err.strip().splitlines()[-1]
        assert last.startswith("metrale-worker: tensor-parallel rank 1") and "killed by signal 9" in last
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def pb_stub(channel):
    from metrale.worker.v1 import worker_pb2_grpc as pb_grpc

    return pb_grpc.ModelWorkerStub(channel)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_pids(pid: int) -> list[int]:
    """Children of every thread of pid (the ranks are started from the engine thread)."""
    import pathlib

    return [int(p) for f in pathlib.Path(f"/proc/{pid}/task").glob("*/children") for p in f.read_text().split()]


def test_a_start_up_error_on_every_rank_is_rank_0s_one_line(tmp_path):
    """The same config fails on every rank: the worker reports its own error (exit 2), not the lost rank."""
    model = write_checkpoint(tmp_path / "m", arch="llama", shape="tiny")
    proc = subprocess.run([sys.executable, "-m", "worker", "serve", "--model", str(model), "--device", "cpu",
                           "--port", "0", "--tensor-parallel-size", "2", "--kv-cache-memory", "0.000001"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("metrale-worker: the KV cache budget") and "--kv-cache-memory" in last, proc.stderr


def test_gateway_extras_under_tp_match_tp1(default_model):
    """The gateway service's per-step host work under TP = 3 (the real model): a structured-output stream (its
    token masks set on every rank), prompt logprobs (a forward of their own), a stop string and an embedding (the
    final hidden state, which every rank holds whole) give what TP = 1 gives."""
    pytest.importorskip("xgrammar")
    from engine.tokenizer import Tokenizer
    from worker.gateway_pb import vpb, vpb_grpc

    tok = Tokenizer.from_dir(default_model)
    prompt = tok.encode_chat(DEFAULT_MODEL_CHATS[0])

    def run(tp: int):
        srv = start_server(default_model, tensor_parallel_size=tp, max_seq_len=256)
        try:
            stub = vpb_grpc.VllmEngineStub(grpc.insecure_channel(srv.address))
            out = []
            for rid, extra in (("regex", dict(regex=r"The capital is [A-Z][a-z]+\.")),
                               ("plp", dict(prompt_logprobs=2)), ("stop", dict(stop=[" of"]))):
                req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=prompt),
                                          sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=12, **extra))
                done = list(stub.Generate(req, timeout=120))[-1].complete
                lp = [round(e.value, 3) for e in done.input_logprobs.token_logprobs[1:]]
                out.append((list(done.output_ids), done.finish_reason, done.matched_stop_str, lp,
                            [list(t.token_ids) for t in done.input_logprobs.top_logprobs]))
            embedding = stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=prompt)), timeout=120)
            return out, torch.tensor(list(embedding.embedding))
        finally:
            srv.stop()

    (want, want_embedding), (got, got_embedding) = run(1), run(3)
    assert want_embedding.numel() == 576 and (got_embedding - want_embedding).abs().max().item() <= 1e-4
    assert want[0][1] == "stop" and tok.decode(want[0][0]).startswith("The capital is ")
    assert want[1][3] and want[2][2] == " of"
    assert [g[:3] + (g[4],) for g in got] == [w[:3] + (w[4],) for w in want]
    for g, w in zip(got, want):  # logprobs: the same up to the all-reduce's float order
        assert g[3] == pytest.approx(w[3], abs=2e-3)
