"""--kv-cache-dtype fp8 on CPU: the cache holds E4M3 (scale 1, saturated), half the bytes of a 16-bit cache and
so twice the blocks in the same memory (four times an fp32 cache); prefix caching and Verify (its rollback included) give the tokens plain
decoding gives on the same FP8 cache; served over real gRPC, Info says what the cache holds. Accuracy on the real
model: tests/e2e/test_fp8_accuracy.py. On a GPU: the rule in tests/unit/test_fp8_kv_kernels.py, the kernels in
tests/gpu/test_fp8_kv_gpu.py."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ROOT, engine_config, generate_via_grpc, random_prompts, start_server
from engine.api import PrefillItem
from engine.engine import Engine
from engine.ops.torch_ops import TorchOps
from engine.quant import FP8_DTYPE
from engine.sampling import SamplingParams, StoppingCriteria
from metrale.worker.v1 import worker_pb2 as pb
from pipeline_checks import verify_as_decoded

VOCAB = 64  # below every tiny checkpoint's vocabulary


def test_the_cache_write_rounds_to_e4m3_and_saturates():
    k_cache = torch.zeros(4, 2, 1, 4, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    q = torch.zeros(2, 1, 4)
    k = torch.tensor([[[0.1, 1.0, 3.3, 1000.0]], [[-2.7, 0.0, -600.0, 5.0]]])
    v = -k
    cos_sin = torch.cat([torch.ones(1, 2), torch.zeros(1, 2)], dim=1)  # position 0: no rotation
    slots = torch.tensor([3, -1])  # the second token writes nothing
    TorchOps().rope_cache_write(q, k, v, cos_sin, torch.tensor([0, 0]), k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(8, 1, 4).float(), v_cache.view(8, 1, 4).float()
    want = k[0].clamp(-448, 448).to(FP8_DTYPE).float()
    assert torch.equal(flat_k[3], want) and torch.equal(flat_v[3], -want)
    assert flat_k[3, 0, 3].item() == 448.0 and flat_k[3, 0, 2].item() == 3.25  # saturated; 3.3 rounded to E4M3
    assert flat_k.abs().sum().item() == flat_k[3].abs().sum().item()  # nothing else written


def test_the_same_memory_holds_more_blocks_by_the_element_sizes_ratio(tiny_model):
    sizes = {}
    for dtype in ("auto", "fp8"):
        engine = Engine(engine_config(tiny_model, kv_cache_dtype=dtype, num_kv_blocks=0, kv_cache_memory=1.5))
        try:
            sizes[dtype] = (engine.runtime.kv.num_blocks, engine.runtime.kv.nbytes, engine.info().kv_cache_dtype)
        finally:
            engine.close()
    (b16, n16, d16), (b8, n8, d8) = sizes["auto"], sizes["fp8"]
    assert d16 == "float32" and d8 == "float8_e4m3fn"  # the CPU engine's model dtype is fp32: a quarter
    assert b8 == pytest.approx(4 * b16, rel=0.01) and n8 == pytest.approx(n16, rel=0.01)


@pytest.mark.parametrize("mixed", [False, True])
def test_verify_and_its_rollback_give_the_decoded_tokens_on_an_fp8_cache(tiny_model, mixed):
    engine = Engine(engine_config(tiny_model, kv_cache_dtype="fp8"))
    try:
        ref, sid, other = verify_as_decoded(engine, SamplingParams(), StoppingCriteria(ignore_eos=True),
                                            [3, 1, 4, 1, 5, 9, 2, 6], 14, VOCAB, mixed)
        engine.release([sid, other])
    finally:
        engine.close()


def test_a_prefix_cache_hit_gives_the_tokens_of_a_fresh_prefill_on_an_fp8_cache(tiny_model):
    engine = Engine(engine_config(tiny_model, kv_cache_dtype="fp8", prefix_caching=True))
    stop = StoppingCriteria(ignore_eos=True)
    prompt = [int(t) for t in torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(3))]
    try:
        runs = []
        for _ in range(2):
            sid = engine.alloc_sequence(100, SamplingParams(), stop).seq_id
            first = engine.prefill([PrefillItem(sid, prompt)]).tokens[0]
            tokens = [first.token_id] + [engine.decode([sid]).tokens[0].token_id for _ in range(8)]
            runs.append((first.cached_tokens, tokens))
            engine.release([sid])
        (cached0, first_run), (cached1, second_run) = runs
        assert cached0 == 0 and cached1 >= 64  # the second prompt's full blocks came from the cache
        assert second_run == first_run
    finally:
        engine.close()


def test_served_over_grpc_info_says_fp8(checkpoints):
    srv = start_server(checkpoints["llama-gqa"], kv_cache_dtype="fp8")
    try:
        stub = srv.stub()
        info = stub.Info(pb.InfoRequest())
        assert info.kv_cache_dtype == "float8_e4m3fn" and info.dtype == "float32"
        prompts = random_prompts([5, 23], VOCAB, seed=5)
        outputs = generate_via_grpc(stub, prompts, max_new_tokens=6)
        for prompt, out in zip(prompts, outputs):  # the engine's own teacher-forced argmax on the same cache
            logp = srv.engine_call(lambda e, seq=prompt + out: e.score(seq))
            assert logp[len(prompt) - 1:-1].argmax(-1).tolist() == out
    finally:
        srv.stop()


def test_an_unknown_kv_cache_dtype_is_one_line_and_exit_2(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "worker", "serve", "--model", str(tiny_model), "--device", "cpu",
                           "--kv-cache-dtype", "int4"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert "kv-cache-dtype" in lines[-1] and "int4" in lines[-1], proc.stderr
