"""FP8 E4M3 weights with block-wise fp32 scales, and their reference arithmetic.

A quantized projection weight is an Fp8Weight in place of the [N, K] tensor in LayerWeights / ModelWeights:
data [N, K] float8_e4m3fn and one fp32 scale per block of bn rows x bk columns, scale [ceil(N / bn),
ceil(K / bk)]; a block that N or K does not fill (576 rows in blocks of 128) is the partial last one. Per
output channel (the default) is the block (1, K): scale [N, 1]. The op backends dispatch on the type in one
place (TorchOps.linear, CudaOps.linear).

Quantization (per block b): data[b] = clamp(w[b] / scale[b], -448, 448) cast to E4M3 (round to nearest
even); 448 is E4M3's largest finite value. The relative error of each element is at most 2^-4 (3 mantissa
bits); elements below scale * 2^-9 (E4M3's smallest subnormal) flush towards zero.
- Blocks other than a whole row: scale[b] = amax(|w[b]|) / 448 (1 for an all-zero block). Smaller blocks track
  the weights' magnitude more closely (fewer elements near the subnormal range) at 4 bytes of scale per block.
- Per output channel: each row's scale is searched among amax / 448 * 2^(j / 64), j = 0 .. 63, for the least
  squared error sum_k (w[k] - scale * data[k])^2 (quantize_rows: a histogram estimates every candidate's
  error in one pass over the row, the exact error decides among the best few and amax / 448 itself).
  E4M3's grid is logarithmic, so the relative error of an element depends on where it falls between two
  grid points, and a scale that moves a row's largest elements closer to grid points lowers the row's
  error; clipping (scales below amax / 448) does not pay with 3 mantissa bits. The storage and arithmetic
  are those of any per-channel scale; tests/e2e/test_fp8_accuracy.py measures the effect on the default
  model.

Reference arithmetic (W8A16, what a weight-only FP8 kernel computes): the E4M3 values are converted to a
wider dtype (exact: E4M3 is a subset of bf16, fp16 and fp32) and multiplied with the activations with fp32
accumulation.
- Per output channel the fp32 accumulators are scaled in the epilogue:
      y[m, n] = (sum_k x[m, k] * data[n, k]) * scale[n, 0]   (+ bias[n]), rounded once to the output dtype.
  Scaling after the accumulation, not the weights before it, is what a kernel that dequantizes in registers
  does cheaply, and it keeps dequant(W) = data * scale from being rounded to bf16.
- Any other block: the sum over the K-groups g of bk columns of (x[:, g] @ data[:, g]^T) * scale[n // bn, g].
  The reference computes it as one fp32 matmul of x with the weights dequantized to fp32
  (data[n, k] * scale[n // bn, k // bk], one fp32 rounding per element, 2^-24 relative), which is the same
  sum up to fp32 rounding.

Activation schemes: each Fp8Weight carries one (Fp8Weight.activation_scheme), which decides with the rows of x
what the projection computes; both backends decide through one rule, takes_w8a8.
- "dynamic" (the default, W8A8 where it pays): a per-channel weight times more than W8A16_MAX_ROWS rows of bf16
  activations into a 16-bit output (prefill, big decode batches), K and N multiples of 16, quantizes the
  activations too: each row of x to E4M3 with its own dynamic scale amax / 448 (quantize_activations), then
      y[m, n] = (sum_k xq[m, k] * data[n, k]) * a_scale[m] * scale[n, 0], rounded to bf16,
  which is what torch._scaled_mm's row-wise scaling and the skinny W8A8 kernels (decode batches of 9-32 rows)
  compute on FP8 tensor cores (CudaOps) and w8a8_linear computes in fp32 in torch (TorchOps): the kernels engine
  and the torch-ops engine run the same arithmetic at every batch, so each is the other's reference. Up to
  W8A16_MAX_ROWS rows (decode) stay W8A16: there the step reads the weights and the tensor cores idle, and
  activation quantization would cost accuracy for nothing.
- "none" (weight-only): W8A16, the reference arithmetic above, at every row count: what vLLM serves a
  compressed-tensors checkpoint without input activations as (Marlin), and on the default model the scheme that
  holds the accuracy floors in bf16, which W8A8 misses (tests/e2e/test_fp8_accuracy.py). On the GPU
  (engine/cuda/fp8_linear.py) the skinny _fp8 kernels serve decode batches of up to 32 rows, and larger ones a
  16-bit GEMM of x with the E4M3 values converted to x's dtype (exact) into an fp32 output, scaled per row in fp32
  and rounded once: fp8_linear's arithmetic up to the order of the fp32 sums.
The scheme comes from --fp8-activation-scheme and a published checkpoint's quantization_config
(engine/fp8_checkpoint.py resolve_activation_scheme says which wins); Info reports it (fp8_activation_scheme)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ConfigError

QUANTIZATIONS = ("none", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: E4M3 with scale 1 (fp8_kv)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Compute capability FP8 tensor cores (and torch._scaled_mm) need: Ada (8.9) and Hopper (9.0) on.
FP8_MIN_CAPABILITY = (8, 9)
W8A16_MAX_ROWS = 8  # projections of more rows than this take W8A8 where takes_w8a8 allows (module docstring)
# Fp8Weight.activation_scheme (EngineConfig.fp8_activation_scheme): "dynamic" (W8A8 above W8A16_MAX_ROWS rows where
# takes_w8a8 allows) or "none" (weight-only: W8A16 at every row count); module docstring.
DYNAMIC, WEIGHT_ONLY = "dynamic", "none"
ACTIVATION_SCHEMES = (DYNAMIC, WEIGHT_ONLY)
CHANNEL = "channel"  # EngineConfig.fp8_weight_block's value for one scale per output channel


def parse_block(text: str) -> tuple[int, int] | None:
    """EngineConfig.fp8_weight_block: "channel" -> None (per output channel), "RxC" -> (R, C) (rows x columns of
    the weight [N, K] per scale, positive ints, e.g. "1x64" or "128x128"); anything else is a ConfigError."""
    if text == CHANNEL:
        return None
    rows, sep, cols = text.partition("x")
    if not (sep and all(s.isascii() and s.isdigit() for s in (rows, cols)) and int(rows) > 0 and int(cols) > 0):
        raise ConfigError(f"fp8_weight_block must be {CHANNEL!r} or ROWSxCOLS with positive integers "
                          f"(e.g. 1x64, 128x128), got {text!r}")
    return int(rows), int(cols)


@dataclass(frozen=True)
class Fp8Weight:
    """A linear layer's weight [N, K] as E4M3 values and one fp32 scale per block of block[0] rows x block[1]
    columns: w[n, k] ~ data[n, k] * scale[n // block[0], k // block[1]], and how its activations are treated
    (module docstring)."""

    data: torch.Tensor  # [N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor  # [ceil(N / bn), ceil(K / bk)] float32, contiguous
    block: tuple[int, int]  # (bn, bk); per output channel: (1, K)
    activation_scheme: str = DYNAMIC  # DYNAMIC (W8A8 where takes_w8a8 allows) or WEIGHT_ONLY (W8A16 always)

    def __post_init__(self):
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"an FP8 weight's activation_scheme must be one of {ACTIVATION_SCHEMES}, got "
                             f"{self.activation_scheme!r}")
        (n, k), (bn, bk) = self.data.shape, self.block
        if self.scale.shape != (-(-n // bn), -(-k // bk)):
            raise ValueError(f"an FP8 weight [{n}, {k}] in blocks {bn}x{bk} needs scales [{-(-n // bn)}, "
                             f"{-(-k // bk)}], got {list(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    @property
    def per_channel(self) -> bool:
        """One scale per output row (block 1 x K or wider): the scale can be applied after the accumulation."""
        return self.block[0] == 1 and self.scale.shape[1] == 1

    @property
    def row_scale(self) -> torch.Tensor:
        """[N] fp32, the per-channel scales (a view); only for a per_channel weight."""
        if not self.per_channel:
            raise ValueError(f"row_scale needs per-channel scales, this weight has {self.block[0]}x{self.block[1]} "
                             f"blocks")
        return self.scale[:, 0]

    def expanded_scale(self) -> torch.Tensor:
        """[N, K] fp32: each element's block scale."""
        return expand_scale(self.scale, self.block, self.data.shape)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data, self.scale]


Weight = torch.Tensor | Fp8Weight


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None = None,
                 activation_scheme: str = DYNAMIC) -> Fp8Weight:
    """w [N, K] (any float dtype) -> Fp8Weight on w's device with scales per `block` (rows, columns; None: per
    output channel) and the given activation scheme; the arithmetic in fp32."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8 takes a 2-D weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    bn, bk = block or (1, k)
    if bn <= 0 or bk <= 0:
        raise ValueError(f"quantize_fp8: block sizes must be positive, got {bn}x{bk}")
    wf = w.float()
    if bn == 1 and bk >= k:  # per output channel
        data, scale = quantize_rows(wf)
        return Fp8Weight(data, scale, (bn, bk), activation_scheme)
    nb, kb = -(-n // bn), -(-k // bk)
    # zero padding to whole blocks leaves every block's amax as it is
    padded = torch.nn.functional.pad(wf.abs(), (0, kb * bk - k, 0, nb * bn - n))
    amax = padded.view(nb, bn, kb, bk).amax(dim=(1, 3))  # [nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).contiguous()
    data = to_e4m3(wf, expand_scale(scale, (bn, bk), (n, k))).contiguous()
    return Fp8Weight(data, scale, (bn, bk), activation_scheme)


def to_e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [N, K] fp32 / scale ([N, K] or [N, 1]) saturated at +-448 and rounded to E4M3 (nearest, ties to even)."""
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


SCALE_STEPS = 64  # candidate row scales amax / 448 * 2^(j / SCALE_STEPS), j = 0 .. SCALE_STEPS - 1
SHORTLIST = 3  # candidates per row whose exact error is computed (the histogram's least estimates)
MANTISSA_BINS = 256  # histogram bins of a row's |w| by its fp32 mantissa's leading 8 bits
SEARCH_CHUNK = 1 << 22  # elements per row chunk of quantize_rows: bounds its temporaries (~40 bytes each)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] fp32 -> (data [N, K] E4M3, scale [N, 1] fp32), one scale per row searched for the least squared
    error (module docstring; _quantize_chunk), in chunks of rows."""
    parts = [_quantize_chunk(part) for part in w.split(max(1, SEARCH_CHUNK // max(1, w.shape[1])))]
    return torch.cat([d for d, _ in parts]).contiguous(), torch.cat([s for _, s in parts]).contiguous()


def _quantize_chunk(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows of w [n, K]. With base = amax / 448 (1 for an all-zero row), v = |w| / base <= 448 and a
    candidate scale = base * 2^t (0 <= t < 1: nothing clips), an element in E4M3's normal range has the squared
    error (base * v)^2 * rho(m * 2^-t), where m in [1, 2) is v's mantissa and
    rho(x) = (round(8 x') / (8 x') - 1)^2 with x' = x or 2x, whichever is in [1, 2): with 3 mantissa bits the
    relative error depends on the mantissa only. One pass sums v^2 per row into MANTISSA_BINS bins of m, and a
    [n, MANTISSA_BINS] @ [MANTISSA_BINS, SCALE_STEPS] product estimates every candidate's error (up to the
    binning, which matters in rows that one element dominates, and E4M3's subnormals, v^2 below 2^-12). The
    SHORTLIST candidates of least estimate and base itself are then quantized, and the one of least exact error
    is kept: never a larger error than amax / 448's."""
    n = w.shape[0]
    amax = w.abs().amax(dim=1, keepdim=True)  # [n, 1]
    base = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    v = (w / base).abs_()  # [n, K] fp32 in [0, 448]
    # fp32 bits: 1 sign, 8 exponent, 23 mantissa; the mantissa's leading 8 bits are the bin (zeros weigh 0)
    bins = (v.view(torch.int32) >> 15).bitwise_and_(MANTISSA_BINS - 1).long()
    bins += torch.arange(0, n * MANTISSA_BINS, MANTISSA_BINS, device=w.device)[:, None]
    # float64 sums: the order of a GPU bincount's additions cannot move the shortlist
    hist = torch.bincount(bins.view(-1), weights=v.square_().view(-1).double(), minlength=n * MANTISSA_BINS)
    estimate = hist.view(n, MANTISSA_BINS) @ _relative_error_table(w.device)  # [n, SCALE_STEPS], base^2 units
    shortlist = estimate.topk(SHORTLIST, dim=1, largest=False).indices  # [n, SHORTLIST]
    scale, data = base, to_e4m3(w, base).view(torch.uint8)
    error = _squared_error(w, data, scale)
    factors = _scale_factors(w.device)
    for step in shortlist.unbind(dim=1):
        candidate = base * factors[step][:, None]
        candidate_data = to_e4m3(w, candidate).view(torch.uint8)
        candidate_error = _squared_error(w, candidate_data, candidate)
        better = candidate_error < error  # [n, 1]
        scale, data = torch.where(better, candidate, scale), torch.where(better, candidate_data, data)
        error = torch.where(better, candidate_error, error)
    return data.view(FP8_DTYPE), scale


def _scale_factors(device: torch.device) -> torch.Tensor:
    """[SCALE_STEPS] fp32: 2^(j / SCALE_STEPS), each rounded once from float64 (the same bits on any device and
    for any chunk of rows, which a vectorised fp32 exp2 does not promise)."""
    return torch.exp2(torch.arange(SCALE_STEPS, dtype=torch.float64) / SCALE_STEPS).float().to(device)


def _relative_error_table(device: torch.device) -> torch.Tensor:
    """[MANTISSA_BINS, SCALE_STEPS] float64: rho(m * 2^(-j / SCALE_STEPS)) at each bin's centre m
    (_quantize_chunk)."""
    m = 1 + (torch.arange(MANTISSA_BINS, dtype=torch.float64, device=device) + 0.5) / MANTISSA_BINS
    x = m[:, None] * torch.exp2(-torch.arange(SCALE_STEPS, dtype=torch.float64, device=device) / SCALE_STEPS)
    x = torch.where(x < 1, 2 * x, x) * 8  # [8, 16): the 8 E4M3 mantissas of a binade are the integers
    return (torch.round(x) / x - 1).square()


def _squared_error(w: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[n, 1]: sum_k (w[k] - scale * e4m3 data[k])^2 per row; data [n, K] E4M3 bits as uint8, scale [n, 1]."""
    return (data.view(FP8_DTYPE).float() * scale - w).square_().sum(dim=1, keepdim=True)


def expand_scale(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """scale [ceil(N / bn), ceil(K / bk)] -> [N, K], each element's block scale (expand + reshape: no host sync,
    capturable in a CUDA graph)."""
    (n, k), (bn, bk), (nb, kb) = shape, block, scale.shape
    return scale[:, None, :, None].expand(nb, bn, kb, bk).reshape(nb * bn, kb * bk)[:n, :k]


def dequantize(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data * (each element's block scale) as `dtype` [N, K] (computed in fp32)."""
    return (w.data.float() * w.expanded_scale()).to(dtype)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, add_to: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The reference W8A16 projection (module docstring): x [M, K] @ w^T with fp32 accumulation, + bias.
    Per channel the scale multiplies the fp32 accumulators; other blocks are one fp32 matmul with the weight
    dequantized to fp32. add_to [M, N]: add_to += that, in place, rounded once (returns add_to); else returns
    it as out_dtype (default x.dtype)."""
    if w.per_channel:
        acc = torch.mm(x.float(), w.data.float().t())  # every bf16/fp16/fp32 x and E4M3 w is exact in fp32
        y = acc * w.row_scale
    else:
        y = torch.mm(x.float(), dequantize(w).t())
    return finish_linear(y, bias, add_to, out_dtype or x.dtype)


def takes_w8a8(x: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype) -> bool:
    """Whether x [M, K] @ w^T runs W8A8 (module docstring): a per-channel weight of the "dynamic" activation scheme
    (never a weight-only one), more than W8A16_MAX_ROWS rows of bf16 x, a bf16 output (not fp32 logits, not fp16),
    K and N multiples of 16 (what _scaled_mm takes)."""
    n, k = w.shape
    return (w.activation_scheme == DYNAMIC and w.per_channel and x.shape[0] > W8A16_MAX_ROWS
            and x.dtype == torch.bfloat16 and out_dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0)


def w8a8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """The reference W8A8 projection (module docstring) in torch: bf16 [M, N], before bias and residual (see
    finish_linear). xq * data is exact in fp32 and so is every partial product; only the sum's order differs from
    the tensor cores'."""
    xq, a_scale = quantize_activations(x)
    acc = torch.mm(xq.float(), w.data.float().t())
    return (acc * a_scale * w.row_scale).to(torch.bfloat16)


def finish_linear(y: torch.Tensor, bias: torch.Tensor | None, add_to: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """The epilogue every FP8 projection shares: y (scaled, fp32 or the GEMM's output dtype) + bias, then
    added into add_to in place (computed in y's precision, one rounding to add_to's dtype) or cast."""
    if bias is not None:
        y = y + bias
    if add_to is not None:
        return add_to.add_(y)
    return y.to(out_dtype)


def check_device(quantization: str, device: torch.device, checkpoint: str = "") -> None:
    """FP8 weights on a GPU need FP8 support (sm_89 / sm_90 on); the CPU runs the reference path.
    checkpoint: an FP8 checkpoint's layout (Fp8Layout.description), "" for --quantization fp8."""
    if quantization != "fp8" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        what = f"an FP8 checkpoint ({checkpoint})" if checkpoint else "--quantization fp8"
        fix = "a 16/32-bit copy of the model, or the CPU" if checkpoint else "--quantization none"
        raise ConfigError(f"{what} needs a GPU with FP8 support (compute capability >= "
                          f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}: Ada or Hopper); {device} ({name}) has "
                          f"{capability[0]}.{capability[1]}: serve it with {fix}")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16- or 32-bit) -> (E4M3 [M, K], fp32 scales [M, 1]) with x ~ data * scale, each row scaled by its
    amax / 448 (the dynamic per-token activation scale of W8A8). Three passes over x: its amax (computed in fp32),
    the division (in fp32) and the cast; x / scale never exceeds 448 in magnitude, so the cast needs no clamp. A zero
    row gets a tiny scale and zeros."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True, dtype=torch.float32)
    # times fp32(1 / 448), not / 448: torch's CUDA division by a scalar multiplies by its reciprocal and the CPU's
    # divides, so this is the one form both devices (and kernels_cu/fp8_quant.cu) compute alike
    scale = amax.clamp_min(1e-12) * (1.0 / FP8_MAX)
    return (x / scale).to(FP8_DTYPE), scale


def fp8_kv(x: torch.Tensor) -> torch.Tensor:
    """K or V rows as an FP8 KV cache holds them: E4M3 with a scale of 1 (as vLLM's uncalibrated FP8 cache),
    saturated at +-448 (a plain cast would make NaN of larger values). Keys and values of the models served
    stay far inside that range (SmolLM2-135M: |k| <= 19, |v| <= 13); their relative rounding is 2^-4, and
    values below 2^-6 lose precision as E4M3's subnormals (tests/e2e/test_fp8_accuracy.py measures the effect).
    Reading is a plain upcast."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
