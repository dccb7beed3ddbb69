"""Runs every kernel once on small shapes, for compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python bench/sanitize_kernels.py

(no caching allocator, so an access past a tensor's end leaves its own allocation and is reported)."""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine import sampling  # noqa: E402
from engine.cuda.ops import CudaOps  # noqa: E402
from engine.cuda.wrappers import decode_step, fp8_quant  # noqa: E402
from engine.models.llama import LayerWeights  # noqa: E402
from engine.ops.torch_ops import AttentionMeta, AttentionSpec, LayerKV  # noqa: E402
from engine.quant import FP8_DTYPE, quantize_fp8  # noqa: E402


def decode_step_state(ops, dev, vocab: int) -> None:
    # Decode step state: prepare, then commit (a vocab of 3000 copies seen rows by bytes, 4096 by 16-byte vectors).
    for V in (vocab, 4096):
        S, MB, bs, B = 10, 8, 16, 4
        state = dict(num_cached=torch.randint(0, MB * bs, (S,), dtype=torch.int32, device=dev),
                     last_token=torch.randint(0, V, (S,), device=dev),
                     block_table=torch.randint(0, 100, (S, MB), dtype=torch.int32, device=dev),
                     temperature=torch.rand(S, device=dev), top_k=torch.zeros(S, dtype=torch.int64, device=dev),
                     top_p=torch.ones(S, device=dev), seed=torch.arange(S, device=dev),
                     penalty=torch.ones(S, device=dev), seen=torch.rand(S, V, device=dev) < 0.1)
        slots_t = torch.tensor([9, 0, 4, 7], device=dev)
        i64, i32, f32 = torch.int64, torch.int32, torch.float32
        rows = dict(input_ids=torch.empty(B, dtype=i64, device=dev), positions=torch.empty(B, dtype=i64, device=dev),
                    slot_mapping=torch.empty(B, dtype=i64, device=dev), seq_lens=torch.empty(B, dtype=i32, device=dev),
                    tables=torch.empty(B, MB, dtype=i32, device=dev), row_temperature=torch.empty(B, device=dev),
                    row_top_k=torch.empty(B, dtype=i64, device=dev), row_top_p=torch.empty(B, device=dev),
                    row_seed=torch.empty(B, dtype=i64, device=dev), row_penalty=torch.empty(B, device=dev),
                    row_position=torch.empty(B, dtype=i64, device=dev),
                    row_seen=torch.empty(B, V, dtype=torch.bool, device=dev))
        decode_step.prepare(ops.lib, slots_t, **state, block_size=bs, **rows)
        decode_step.commit(ops.lib, slots_t, torch.randint(0, V, (B,), device=dev), torch.randn(B, device=dev),
                           state["num_cached"], state["last_token"], state["seen"],
                           torch.empty(S, 2, dtype=i64, pin_memory=True), torch.empty(S, 2, dtype=f32, pin_memory=True))
        # A uniform Verify of k = 3 drafts: prepare with k + 1 rows per slot (strided drafts), then commit.
        k = 3
        drafts = torch.randint(0, V, (B, k + 2), device=dev)[:, :k]
        rows_v = {name: (t.new_empty((B * (k + 1),) + tuple(t.shape[1:]))) for name, t in rows.items()}
        state["num_cached"].clamp_(max=(MB - 1) * bs)  # room for the drafts in the block table
        decode_step.prepare(ops.lib, slots_t, **state, block_size=bs, **rows_v, drafts=drafts)
        decode_step.verify_commit(ops.lib, slots_t, drafts, torch.randint(0, V, (B * (k + 1),), device=dev),
                                  torch.randn(B * (k + 1), device=dev), state["num_cached"], state["last_token"],
                                  state["seen"], torch.empty(8, dtype=i64, device=dev),
                                  torch.empty(8, dtype=i64, device=dev), torch.empty(8, k + 2, dtype=f32, device=dev))


def main() -> int:
    """--decode-step: only the decode step state kernels (decode_prepare, decode_commit, verify_commit)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ops = CudaOps.create(dev, max_seq_len=4096)
    torch.manual_seed(0)
    vocab = 3000
    if "--decode-step" in sys.argv:
        decode_step_state(ops, dev, vocab)
        torch.cuda.synchronize()
        print("sanitize_kernels: the decode step kernels ran")
        return 0
    # (activations, head_dim, KV cache, weights): 16-bit caches, and E4M3 ones (--kv-cache-dtype fp8: the _kvfp8
    # entries); 16-bit weights, and per-channel FP8 ones (--quantization fp8: the skinny kernels' _fp8 entries)
    fp8 = FP8_DTYPE
    for dt, D, kv_dt, fp8_weights in (
            (torch.bfloat16, 64, None, False), (torch.float16, 64, None, False), (torch.bfloat16, 16, None, False),
            (torch.bfloat16, 80, None, False), (torch.bfloat16, 128, None, False), (torch.bfloat16, 64, fp8, False),
            (torch.float16, 80, fp8, False), (torch.bfloat16, 16, fp8, False), (torch.bfloat16, 128, fp8, False),
            (torch.bfloat16, 64, None, True), (torch.bfloat16, 64, fp8, True), (torch.float16, 80, fp8, True)):
        kv_dt = kv_dt or dt
        weight = quantize_fp8 if fp8_weights else (lambda t: t)
        B, H, Hkv, bs, hidden, inter = 3, 8, 2, 16, 512, 256
        ids = torch.randint(0, vocab, (B,), device=dev)
        emb = torch.randn(vocab, hidden, device=dev).to(dt)
        w = torch.ones(hidden, device=dev, dtype=dt)
        h = ops.embedding(ids, emb)
        ops.rms_norm(h, w, 1e-6)
        for T in (B, 40):  # the skinny kernels, and the cuBLAS composition
            ops.begin_forward(T, decode=True)
            hr = ops.embedding(torch.randint(0, vocab, (T,), device=dev), emb)
            wq = weight(torch.randn((H + 2 * Hkv) * D, hidden, device=dev).to(dt) * 0.05)
            kc0 = torch.zeros(T + 16, 16, Hkv, D, device=dev, dtype=kv_dt)
            slots_t = torch.arange(T, device=dev) * 3
            layer = LayerWeights(w, wq, None, None, None, None, None, None, None)
            spec = AttentionSpec(H, Hkv, D, 0.125, 1e-6)
            meta = AttentionMeta(spec, torch.randn(512, D, device=dev), torch.arange(T, device=dev), slots_t, None,
                                 None, True, [], [])
            qf = ops.norm_qkv_rope(hr, layer, meta, LayerKV(kc0, kc0.clone()))
            ops.linear_add(hr, qf.reshape(T, H * D), weight(torch.randn(hidden, H * D, device=dev).to(dt) * 0.05))
            act = ops.norm_gate_up(hr, w, weight(torch.randn(2 * inter, hidden, device=dev).to(dt) * 0.05), 1e-6)
            ops.linear_add(hr, act, weight(torch.randn(hidden, inter, device=dev).to(dt) * 0.05))
            ops.norm_logits(hr, None, w, weight(emb), 1e-6)
            # A decode layer's attention half: RoPE and the K/V write fused into decode attention at T = 40
            tbl = (torch.arange(2 * T, device=dev, dtype=torch.int32) + 1).view(T, 2)
            kc1 = torch.zeros(2 * T + 1, 16, Hkv, D, device=dev, dtype=kv_dt)
            meta = AttentionMeta(spec, torch.randn(512, D, device=dev), torch.full((T,), 19, device=dev),
                                 tbl[:, 1].long() * 16 + 3, tbl, torch.full((T,), 20, dtype=torch.int32, device=dev),
                                 True, [], [])
            ops.qkv_attention(hr, layer, meta, LayerKV(kc1, kc1.clone()))
        ops.silu_and_mul(torch.randn(B, 2 * inter, device=dev).to(dt))
        fp8_quant.quantize_rows(ops.lib, torch.randn(B + 5, 8 * 37, device=dev).to(dt))  # W8A8's activations
        qkv = torch.randn(B, (H + 2 * Hkv) * D, device=dev).to(dt)
        q, k, v = (qkv[:, :H * D].view(B, H, D), qkv[:, H * D:(H + Hkv) * D].view(B, Hkv, D),
                   qkv[:, (H + Hkv) * D:].view(B, Hkv, D))
        ops.rms_norm(q, torch.ones(D, device=dev, dtype=dt), 1e-6)
        seq_lens = [1, 70, 300]
        blocks = [-(-s // bs) for s in seq_lens]
        num_blocks = sum(blocks) + 1
        table = torch.zeros(B, max(blocks), dtype=torch.int32)
        at = 1
        for b, n in enumerate(blocks):
            table[b, :n] = torch.arange(at, at + n, dtype=torch.int32)
            at += n
        table = table.to(dev)
        kc = torch.randn(num_blocks, bs, Hkv, D, device=dev).to(kv_dt)
        vc = torch.randn(num_blocks, bs, Hkv, D, device=dev).to(kv_dt)
        pos = torch.tensor([s - 1 for s in seq_lens], device=dev)
        slots = table[torch.arange(B, device=dev), pos // bs].long() * bs + pos % bs
        cos_sin = torch.randn(512, D, device=dev)
        qr = ops.rope_cache_write(q, k, v, cos_sin, pos, kc, vc, slots)
        for window in (0, 50):
            ops.decode_attention(qr, kc, vc, table, torch.tensor(seq_lens, dtype=torch.int32, device=dev), 0.125, window)
            qsl = [0, 1, 31, 131]  # chunks that continue a cached prefix: the paged kernel
            qp = torch.randn(qsl[-1], H, D, device=dev).to(dt)
            ops.prefill_attention(qp, kc, vc, table, qsl, seq_lens, 0.125, window)
            qp = torch.randn(sum(seq_lens), H, D, device=dev).to(dt)  # fresh prompts: fused SDPA
            ops.prefill_attention(qp, kc, vc, table, [0, 1, 71, 371], seq_lens, 0.125, window)
    n = 6
    st = sampling.SamplingTensors(
        temperature=torch.tensor([0.0, 0.7, 1.0, 0.9, 0.8, 1.0], device=dev),
        top_k=torch.tensor([0, 0, 40, 0, 100, 1], device=dev), top_p=torch.tensor([1, 1, 1, 0.8, 0.9, 1.0], device=dev),
        seed=torch.arange(n, device=dev), repetition_penalty=torch.tensor([1.2, 1, 1, 1.1, 1, 1], device=dev),
        seen=torch.rand(n, vocab, device=dev) < 0.05, position=torch.arange(n, device=dev))
    ops.sample(torch.randn(n, vocab, device=dev), st, num_top=3)
    target = torch.log_softmax(torch.randn(2, 4, vocab, device=dev), dim=-1)
    drafts = torch.randint(0, vocab, (2, 3), device=dev)
    ops.accept_drafts(target, drafts, torch.softmax(torch.randn(2, 3, vocab, device=dev), -1),
                      torch.ones(2, 4, dtype=torch.int64, device=dev), torch.arange(8, device=dev).view(2, 4))
    ops.accept_drafts(target, drafts, None, torch.ones(2, 4, dtype=torch.int64, device=dev),
                      torch.arange(8, device=dev).view(2, 4))
    decode_step_state(ops, dev, vocab)
    torch.cuda.synchronize()
    print("sanitize_kernels: every kernel ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
