"""CudaOps: TorchOps with its primitives computed by the kernels of kernels_cu/. Activations are bfloat16
or float16; logits are float32.

Small batches (at most SKINNY_MAX_M tokens: decode and verify steps) run each fused op as one
"skinny linear" kernel (kernels_cu/skinny_linear.cu): the projection on tensor cores with its
neighbours fused in: the rms_norm before it (its statistics computed by the kernel from the x it
loads), and after it RoPE with the KV-cache write, SiLU-and-mul, the residual add, or fp32 logits. Larger
forwards (prefill) use TorchOps' composition of the kernels below with cuBLAS GEMMs; decode forwards of up
to SPLIT_K_TOKENS tokens run each residual linear layer as a split-K bmm whose reduce kernel (residual_norm)
also makes the next op's rms_norm (linear_add). With METRALE_GEMM=sm90 / sm90-all on an sm_90 device, forwards of 9-256 rows
(decode, verify and short prompts) run some or all of their projections on our Hopper GEMM instead
(engine/cuda/hopper_gemm.py ROUTES).

Every decode-path method (the fused ops, embedding, rms_norm, rope_cache_write, decode_attention,
silu_and_mul, sample) is sync-free and capturable in a CUDA graph: it allocates its outputs with
sizes taken from tensor shapes and host-known configuration only, reads no device value on the host,
and launches on the current torch stream. prefill_attention sizes its grid from its host lists and
copies a small work list to the device (it runs eagerly).

The KV cache is the activations' dtype or E4M3 (--kv-cache-dtype fp8): every kernel that writes or reads it
(rope_cache_write, the skinny QKV kernel's rope_kv, decode and prefill attention) has a _kvfp8 entry, which the
wrappers pick from the cache's dtype; the prefill path through FlashAttention converts the gathered keys.

Beyond TorchOps: `accept_drafts` (batched speculative acceptance, the sync-free form of
engine.sampling.accept_drafts for B sequences with K drafts each).
"""
from __future__ import annotations

import torch

from engine import env, sampling
from engine.batch import prefill_work
from engine.cuda.driver import CudaError, KernelArgError, KernelLoadError
from engine.cuda import device_sampling, fp8_linear, prefill_varlen
from engine.cuda.fp8_linear import fp8_projection
from engine.cuda.hopper_gemm import HopperGemm
from engine.cuda.library import KernelLibrary
from engine.cuda.prefill_fused import FUSED_MIN_TOKENS, FusedPrefill
from engine.cuda.wrappers import (
    decode_attention,
    embedding,
    gemm_sm90,
    prefill_attention,
    rms_norm,
    rope_cache_write,
    silu_and_mul,
    skinny_linear,
)
from engine.errors import ConfigError
from engine.ops.torch_ops import AttentionMeta, LayerKV, TorchOps
from engine.quant import FP8_DTYPE, W8A16_MAX_ROWS, Fp8Weight, Weight

SKINNY_TOKENS = W8A16_MAX_ROWS  # forwards of at most this many tokens use the skinny kernels (faster than cuBLAS up to ~8)
SPLIT_K_TOKENS = 64  # decode forwards of SKINNY_TOKENS + 1 .. this many tokens run linear_add as a split-K bmm
SPLIT_K = 4  # ... over this many slices of K (fp32 partials summed by residual_norm)
DECODE_COUNTERS = 1 << 16  # decode attention's split tickets: one per (query row, KV head, head chunk)


def skinny_fits(x: torch.Tensor, weight: Weight, span: int, max_rows: int = SKINNY_TOKENS) -> bool:
    """Whether the skinny kernels take x [M, K] @ weight^T: at most max_rows rows of 16-bit x, and a weight
    [N, K] they can cut into 16-row tiles of row pairs (r, r + span / 2): 16-bit, or an Fp8Weight with per-channel
    scales (the _fp8 kernels; other blocks keep CudaOps.linear's torch paths)."""
    if isinstance(weight, Fp8Weight):
        if not weight.per_channel or weight.data.dtype != FP8_DTYPE or not weight.data.is_contiguous():
            return False
    elif weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    n, k = weight.shape
    return (0 < x.shape[0] <= max_rows and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16)
            and k % 32 == 0 and span % 16 == 0 and n % span == 0)


def fp8_skinny_fits(x: torch.Tensor, weight: Fp8Weight, decode: bool) -> bool:
    """Whether the skinny W8A16 (_fp8) kernels take x @ weight^T in CudaOps: skinny_fits up to
    engine/cuda/fp8_linear.py skinny_rows (32 rows of a weight-only weight's decode forward, else 8)."""
    return skinny_fits(x, weight, weight.shape[0], fp8_linear.skinny_rows(weight, decode))


class CudaOps(TorchOps):
    name = "cuda"

    def __init__(self, lib: KernelLibrary, max_seq_len: int):
        self.lib = lib
        self.max_seq_len = max_seq_len
        # Decode attention's per-(sequence, head group) tickets (its last split block merges the splits).
        self._split_counters = torch.zeros(DECODE_COUNTERS, dtype=torch.int32, device=lib.device)
        self._skinny = False  # set per forward by begin_forward
        self._decode = False
        self._rows_per_seq = 1
        self._prefill_work_key: tuple | None = None
        self._prefill_work: torch.Tensor | None = None
        self.fused_min_tokens = FUSED_MIN_TOKENS
        self.fused_prefill = FusedPrefill(env.PREFILL_ATTENTION)
        self.varlen = prefill_varlen.VarlenPrefill()  # graphed fresh prompts' attention (longest >= 2048 tokens)
        # Forwards of at most gemm_sm90.MAX_ROWS rows (decode, verify, short prompts) run their projections on the
        # Hopper GEMM where env.GEMM asks and the device has it.
        self.gemm = HopperGemm.create(lib, env.GEMM)
        self._gemm: HopperGemm | None = None  # self.gemm in a forward it serves (begin_forward), else None

    @classmethod
    def create(cls, device: torch.device, max_seq_len: int) -> CudaOps:
        """Loads every kernel for `device`; max_seq_len bounds the context (it sizes decode attention's
        split-K grid). Raises ConfigError naming what is missing."""
        try:
            lib = KernelLibrary(device, pdl=env.PDL)
        except (KernelLoadError, CudaError, ImportError, OSError) as e:
            raise ConfigError(f"the CUDA kernel backend cannot start on {device}: {e}") from e
        return cls(lib, max_seq_len)

    # ---------------------------------------------------------------------------------------------
    # Fused ops: one skinny kernel each in decode and verify forwards of at most SKINNY_TOKENS tokens,
    # else TorchOps' composition (cuBLAS and the kernels below). Prompts always take the second path,
    # so a prompt's KV cache does not depend on how many other prompts share its forward (seeded
    # sampling gives the same tokens alone and in a batch).

    def prefill_tokens(self, num_tokens: int) -> int:
        """Prefill forwards run on a few token counts: cuBLAS picks its kernel per new GEMM shape, which
        costs host time per GEMM the first time (bench/profile_step.py --only ttft), i.e. milliseconds per
        forward for every new prompt length. Multiples of PREFILL_BUCKET up to
        PREFILL_BUCKET_UNTIL tokens, then of 4 * PREFILL_BUCKET."""
        return prefill_bucket(num_tokens)

    def prefill_buckets(self, limit: int) -> list[int]:
        return sorted({prefill_bucket(n) for n in range(1, limit + 1)})

    def varlen_prefill(self, longest: int, sliding_window: int, head_dim: int) -> bool:
        return self.varlen.takes(longest, sliding_window, head_dim)

    def warm_up_prefill_attention(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                                  chunk_tokens: int, max_seq_len: int) -> int:
        return self.fused_prefill.warm_up(num_heads, num_kv_heads, head_dim, dtype, self.lib.device, chunk_tokens,
                                          max_seq_len)

    def begin_forward(self, num_tokens: int, decode: bool, rows_per_seq: int = 1) -> None:
        self._skinny = decode and 0 < num_tokens <= SKINNY_TOKENS
        self._decode = decode
        self._rows_per_seq = rows_per_seq
        self._gemm = self.gemm if 0 < num_tokens <= gemm_sm90.MAX_ROWS else None
        # Attention plans are built at the first layer of each forward and serve its other layers:
        # they hold cache rows of this forward's sequences, so they never outlive it.
        self._prefill_work_key = None
        self.fused_prefill.forget()

    def norm_qkv_rope(self, h: torch.Tensor, layer, meta: AttentionMeta, kv: LayerKV,
                      normed: torch.Tensor | None = None) -> torch.Tensor:
        spec = meta.spec
        if layer.q_norm is not None or not self._skinny or not skinny_fits(h, layer.qkv, spec.head_dim):
            return super().norm_qkv_rope(h, layer, meta, kv, normed)
        q = torch.empty((h.shape[0], spec.num_heads, spec.head_dim), dtype=h.dtype, device=h.device)
        skinny_linear.rope_kv(self.lib, q, h, layer.qkv, layer.qkv_bias, layer.input_norm, meta.cos_sin,
                              meta.rope_index.long(), kv.k, kv.v, meta.slot_mapping.long(), spec.num_heads,
                              spec.num_kv_heads, spec.eps)
        return q

    def qkv_attention(self, h: torch.Tensor, layer, meta: AttentionMeta, kv: LayerKV,
                      normed: torch.Tensor | None = None) -> torch.Tensor:
        """Decode forwards: skinny batches run the skinny QKV kernel (RoPE and the KV write fused in) with
        decode attention launched behind it with programmatic dependent launch. Batches past the skinny
        kernels (cuBLAS QKV projection) whose attention grid fits on the GPU at once: decode attention rotates
        q and the new k itself and writes the new k and v into the cache, instead of a rope_cache_write launch
        before it (the same bits); with a second wave of attention blocks each wave would pay the fused part's
        latency, so those batches keep the separate launch. Prefill forwards: TorchOps' composition, but graphed
        forwards of fresh prompts that varlen_prefill gave their sequence starts (meta.cu_seqlens) attend through
        engine/cuda/prefill_varlen.py."""
        spec = meta.spec
        if not meta.is_decode:
            if meta.cu_seqlens is None:
                return super().qkv_attention(h, layer, meta, kv, normed)
            q = self.norm_qkv_rope(h, layer, meta, kv, normed)
            def paged() -> torch.Tensor:  # the staged work list: where the entry has refused
                return self.prefill_attention(q, kv.k, kv.v, meta.block_tables, meta.query_start_loc,
                                              meta.seq_lens_host, spec.scale, spec.sliding_window, meta.prefill_work,
                                              meta.max_kv_len)
            return self.varlen(q, kv.k, kv.v, meta.slot_mapping, meta.cu_seqlens, spec.scale, paged)
        B, H, Hkv, D = h.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
        if layer.q_norm is None and self._skinny and skinny_fits(h, layer.qkv, D):
            # Before waiting for the QKV kernel, attention reads everything that kernel did not write (it wrote
            # the last B positions' cache rows at most: one per token of this forward).
            q = self.norm_qkv_rope(h, layer, meta, kv, normed)
            return self.decode_attention(q, kv.k, kv.v, meta.block_tables, meta.seq_lens, spec.scale,
                                         spec.sliding_window, fresh=B)
        # Not for a verify forward: its rows read the cache rows their sequence's earlier rows write in this
        # launch (the fused kernel writes each row's own token only), so rope_cache_write goes first there.
        if layer.q_norm is not None or self._rows_per_seq > 1 or not decode_attention.fits_one_wave(
                self.lib, B, H, Hkv, D, self.max_seq_len, fp8_kv=kv.k.dtype == FP8_DTYPE):
            return super().qkv_attention(h, layer, meta, kv, normed)
        x = self.rms_norm(h, layer.input_norm, spec.eps) if normed is None else normed
        out = self.linear(x, layer.qkv, layer.qkv_bias)
        q, k, v = (t.view(B, -1, D) for t in out.split([H * D, Hkv * D, Hkv * D], dim=-1))
        # Serialised behind the GEMM (programmatic dependent launch with every older row read before the wait
        # measured the same).
        return self.decode_attention(q, kv.k, kv.v, meta.block_tables, meta.seq_lens, spec.scale,
                                     spec.sliding_window,
                                     rope=(k, v, meta.cos_sin, meta.rope_index.long(), meta.slot_mapping.long()))

    def linear_add(self, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, norm: torch.Tensor | None = None,
                   eps: float = 0.0) -> torch.Tensor | None:
        """Skinny forwards: one skinny_residual kernel; the next op's skinny kernel fuses the norm (None back).
        Larger forwards: the Hopper GEMM's residual entries where this forward has it (METRALE_GEMM) and it
        takes the operands, else (decode) an Fp8Weight's skinny FP8 residual kernel where one serves (skinny_residual);
        up to SPLIT_K_TOKENS tokens: the GEMM as one bmm over SPLIT_K slices of K into fp32 partials, then
        residual_norm sums them into h and makes the next op's rms_norm in the same launch: faster than
        cuBLAS's addmm_ (for down its own split-K kernel plus a reduce kernel) and the norm launch after it
        (bench/split_k_gemm.py; bench/RESULTS.md). gate_up stays on cuBLAS (slower split). Else TorchOps'."""
        if self._skinny and skinny_fits(h, weight, weight.shape[0]):
            skinny_linear.residual(self.lib, h, x.contiguous(), weight)
            return None
        if self._skinny:  # a skinny forward whose next op fuses the norm itself
            norm = None
        if (self._gemm is not None and self._gemm.linear(x, weight, None, h, None) is not None) or (
                self._decode and isinstance(weight, Fp8Weight) and fp8_linear.skinny_residual(
                    self.lib, h, x, weight, fp8_skinny_fits(x, weight, True))):
            return None if norm is None else self.rms_norm(h, norm, eps)
        M, K = x.shape
        if (not self._decode or not SKINNY_TOKENS < M <= SPLIT_K_TOKENS or K % (8 * SPLIT_K) or not x.is_contiguous()
                or isinstance(weight, Fp8Weight) or not h.is_contiguous() or not weight.is_contiguous()
                or x.dtype not in (torch.bfloat16, torch.float16)):
            return super().linear_add(h, x, weight, norm, eps)
        N, S = weight.shape[0], SPLIT_K
        parts = torch.bmm(x.view(M, S, K // S).transpose(0, 1), weight.view(N, S, K // S).permute(1, 2, 0),
                          out_dtype=torch.float32)
        normed = None if norm is None else torch.empty_like(h)
        rms_norm.residual_norm(self.lib, h, normed, parts, norm, eps)
        return normed

    def norm_gate_up(self, h: torch.Tensor, norm: torch.Tensor, gate_up: torch.Tensor, eps: float,
                     normed: torch.Tensor | None = None) -> torch.Tensor:
        if not self._skinny or not skinny_fits(h, gate_up, gate_up.shape[0]):
            if self._gemm is not None or (self._decode and isinstance(gate_up, Fp8Weight)):
                # past the skinny forwards: the Hopper GEMM's silu entries, else the FP8 skinny silu kernels
                x = self.rms_norm(h, norm, eps) if normed is None else normed
                out = self._gemm.silu_and_mul(x, gate_up) if self._gemm is not None else None
                if out is None and self._decode and isinstance(gate_up, Fp8Weight):
                    out = fp8_linear.skinny_silu(self.lib, x, gate_up, fp8_skinny_fits(x, gate_up, True))
                return out if out is not None else super().norm_gate_up(h, norm, gate_up, eps, x)
            return super().norm_gate_up(h, norm, gate_up, eps, normed)
        out = torch.empty((h.shape[0], gate_up.shape[0] // 2), dtype=h.dtype, device=h.device)
        skinny_linear.silu(self.lib, out, h, gate_up, norm, eps)
        return out

    def norm_logits(self, h: torch.Tensor, rows: torch.Tensor | None, norm: torch.Tensor, lm_head: torch.Tensor,
                    eps: float, normed: torch.Tensor | None = None) -> torch.Tensor:
        """Skinny kernels (norm fused) for decode forwards of <= 8 rows, and <= 32 for an FP8 head (not
        fp8_projection's W8A16, which converts the whole head per call: ~1.5 ms at 8B, bench/RESULTS.md)."""
        x = h if rows is None else h[rows]
        fp8_head = self._decode and isinstance(lm_head, Fp8Weight)
        max_rows = skinny_linear.FP8_MAX_M if fp8_head else SKINNY_TOKENS
        if not (self._skinny or fp8_head) or not skinny_fits(x, lm_head, lm_head.shape[0], max_rows):
            return super().norm_logits(h, rows, norm, lm_head, eps, normed)
        out = torch.empty((x.shape[0], lm_head.shape[0]), dtype=torch.float32, device=x.device)
        skinny_linear.store(self.lib, out, x, lm_head, None, norm, eps)
        return out

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None,
               add_to: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """TorchOps.linear; on the Hopper GEMM where this forward has it (begin_forward) and it takes the operands;
        an Fp8Weight (engine/quant.py) through engine/cuda/fp8_linear.py."""
        if self._gemm is not None:
            out = self._gemm.linear(x, weight, bias, add_to, out_dtype)
            if out is not None:
                return out
        if not isinstance(weight, Fp8Weight):
            return super().linear(x, weight, bias, add_to, out_dtype)
        skinny = fp8_skinny_fits(x, weight, self._decode) and (bias is None or bias.dtype == x.dtype)
        return fp8_projection(self.lib, x, weight, bias, add_to, out_dtype, skinny, self._decode)

    # ---------------------------------------------------------------------------------------------
    # Primitives.

    def embedding(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty((input_ids.shape[0], weight.shape[1]), dtype=weight.dtype, device=weight.device)
        embedding.launch(self.lib, out, input_ids, weight)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rms_norm.launch(self.lib, out, x, weight, eps)
        return out

    def rope_cache_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                         rope_index: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> torch.Tensor:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        rope_cache_write.launch(self.lib, q_out, q, k, v, cos_sin, rope_index.long(), k_cache, v_cache,
                                slot_mapping.long())
        return q_out

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         sliding_window: int = 0, rope: tuple[torch.Tensor, ...] | None = None,
                         fresh: int | None = None) -> torch.Tensor:
        """rope: the fused RoPE and KV write of qkv_attention (engine/cuda/wrappers/decode_attention.py).
        fresh: launched right behind the kernel that produced q (qkv_attention's QKV projection),
        with programmatic dependent launch; that kernel wrote no cache row of a position < seq_len - fresh,
        so the older rows (and the tables) are read before the wait. None: serialised, nothing read early.
        The caches are q's dtype or E4M3 (--kv-cache-dtype fp8: the kernels' _kvfp8 entries)."""
        batch, num_heads, head_dim = q.shape
        splits = decode_attention.key_splits(self.lib, batch, num_heads, k_cache.shape[2], head_dim, self.max_seq_len,
                                             fp8_kv=k_cache.dtype == FP8_DTYPE)
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
        part_o = part_lse = None
        if splits > 1:
            part_o = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
        int_lens = seq_lens.dtype == torch.int32  # else converted by a launch right before (not to be read early)
        decode_attention.launch(self.lib, out, part_o, part_lse, self._split_counters, q, k_cache, v_cache,
                                block_tables, seq_lens.to(torch.int32), scale, sliding_window, splits, rope=rope,
                                pdl=fresh is not None, fresh=fresh if fresh is not None and int_lens else -1)
        return out

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                          scale: float, sliding_window: int = 0, work: torch.Tensor | None = None,
                          max_kv_len: int = 0) -> torch.Tensor:
        """With `work` (a staged, padded work list: a forward replayed from a CUDA graph), the paged
        kernel runs it as given, split over the keys for its max_kv_len (prefill_attention.key_splits). Otherwise:
        forwards of at least fused_min_tokens prompt tokens (fresh prompts or chunks after a cached prefix, no
        active sliding window) run through a fused attention on the keys gathered from the cache (prefill_fused:
        cuDNN's or FlashAttention's); shorter ones run the paged kernel of kernels_cu/prefill_attention.cu: one
        launch per layer and no gathers, which short prompts, bound by host time, pay for more than they gain from
        the fused call (profile_step --only ttft)."""
        if work is not None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            # a staged work list has an empty row per padded sequence row (prefill_work_rows): one at least
            splits = prefill_attention.key_splits(self.lib, work.shape[0] - 1, q.shape[1], max_kv_len, q.shape[2],
                                                  k_cache.element_size() == 1)
            prefill_attention.launch(self.lib, out, q, k_cache, v_cache, block_tables.to(torch.int32), work, scale,
                                     sliding_window, splits)
            return out
        num_tokens = query_start_loc[-1] if query_start_loc else 0
        if (0 < num_tokens and num_tokens >= self.fused_min_tokens
                and (not sliding_window or max(seq_lens, default=0) <= sliding_window)):
            return self.fused_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
        key = (tuple(query_start_loc), tuple(seq_lens), q.shape[2])
        # The work list is the same for every layer of a forward: copied to the device once, since a
        # pageable host-to-device copy waits for the GPU work queued before it.
        if self._prefill_work_key != key:
            work = prefill_work(query_start_loc, seq_lens, q.shape[2])
            self._prefill_work = torch.tensor(work, dtype=torch.int32, device=q.device) if work else None
            self._prefill_work_key = key
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        work_t = self._prefill_work
        if work_t is None:
            return out
        splits = prefill_attention.key_splits(self.lib, work_t.shape[0], q.shape[1], max(seq_lens, default=0),
                                              q.shape[2], k_cache.element_size() == 1)
        prefill_attention.launch(self.lib, out, q, k_cache, v_cache, block_tables.to(torch.int32), work_t, scale,
                                 sliding_window, splits)
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
        silu_and_mul.launch(self.lib, out, x.contiguous())
        return out

    def sample(self, logits: torch.Tensor, st: sampling.SamplingTensors, num_top: int = 0) -> sampling.SampleOutput:
        return device_sampling.sample(self.lib, logits, st, num_top)

    def accept_drafts(self, target_logp: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                      seed: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """engine/cuda/device_sampling.py accept_drafts: batched speculative acceptance, no host sync."""
        return device_sampling.accept_drafts(self.lib, target_logp, draft_ids, draft_probs, seed, position)


PREFILL_BUCKET = 64  # prefill forwards are padded to a multiple of this many tokens (see prefill_tokens)
PREFILL_BUCKET_UNTIL = 2048  # ... and of 4 * PREFILL_BUCKET above this


def prefill_bucket(num_tokens: int) -> int:
    step = PREFILL_BUCKET if num_tokens <= PREFILL_BUCKET_UNTIL else 4 * PREFILL_BUCKET
    return -(-num_tokens // step) * step


__all__ = ["CudaOps", "KernelArgError", "prefill_bucket"]
