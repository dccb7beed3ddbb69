"""Every environment variable the project reads, read once, here. Prefix: METRALE_ (and the
standard CUDA_HOME / CUDA_PATH). A value outside a variable's documented set does not raise at import: the default
stands in and PROBLEMS names it, and check() raises it as a ConfigError: the command line calls it before anything
else (one line, exit 2) and Runtime.create before it loads a model, so a typo is never silently a different
configuration."""
import os
import pathlib

# One line per variable set to a value it does not take (check()).
PROBLEMS: list[str] = []


def _choice(name: str, default: str, choices: tuple[str, ...], normalise=str) -> str:
    value = normalise(os.environ.get(name, default))
    if value not in choices:
        PROBLEMS.append(f"{name}={os.environ[name]!r} is not one of {', '.join(choices)}")
        return default
    return value


def _switch(name: str, default: str) -> bool:
    """A switch: "1" on, "0" off."""
    return _choice(name, default, ("0", "1")) != "0"


def _count(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        PROBLEMS.append(f"{name}={raw!r} is not a whole number of 0 or more")
        return default
    return value


def check() -> None:
    """Raises ConfigError naming every variable set to a value it does not take."""
    if PROBLEMS:
        from engine.errors import ConfigError

        raise ConfigError("; ".join(PROBLEMS) + " (README.md lists the METRALE_ variables and their values)")


# Where the built-in default model and compiled kernels are cached.
CACHE_DIR = pathlib.Path(os.environ.get("METRALE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "metrale-worker")
# Python logging level name for the worker (DEBUG, INFO, WARNING, ...).
LOG_LEVEL = _choice("METRALE_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), str.upper)
# CUDA toolkit roots searched for nvcc when it is not on PATH (the standard CUDA variables).
CUDA_ROOTS = tuple(r for r in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if r)
# What `python -m engine.cuda.build` puts in each fatbin: machine code for each listed architecture ("90": sm_90) and
# PTX for each "compute_NN" (which newer GPUs compile at load). "90" alone makes an H100/H200-only build of a third
# of the size (what a device call can carry beside its wheels).
CUDA_ARCHS = tuple(a.strip() for a in os.environ.get("METRALE_CUDA_ARCHS", "80,90,compute_90").split(",") if a.strip())
# Programmatic dependent launch of the decode kernels on sm_90+ ("0" turns it off; engine/cuda/library.py).
PDL = _switch("METRALE_PDL", "1")
# Decode attention grids of more than one wave at head_dim < 128 on the 2-deep _s2 entries
# (engine/cuda/wrappers/decode_attention.py shallow_entry); "0": the default entries always (the A/B's switch).
DECODE_SHALLOW = _switch("METRALE_DECODE_SHALLOW", "1")
# Decode attention launches of one split whose grid needs more than one wave (head_dim 128, 16-bit cache) on the warp
# entries (one warp an item, persistent: engine/cuda/wrappers/decode_attention.py warp_entry); "0": never.
DECODE_WARP = _switch("METRALE_DECODE_WARP", "1")
# How the worker's event loop learns that a step's device work ended (worker/runner.py): "poll" (the loop itself
# queries the step's event between its other callbacks: a core busy while steps run, ~50 us sooner than a thread's
# wake-up, and the loop never waits on another thread for it) or "thread" (a helper thread waits on the event and
# wakes the loop: no busy core). Poll is the default: through a gateway, where the loop also writes every stream's
# tokens, it kept the device busier (bench/RESULTS.md, "Direct gRPC vs through Shepherd Model Gateway").
STEP_WAIT = _choice("METRALE_STEP_WAIT", "poll", ("poll", "thread"))
# W8A8 projections of at most this many rows (FP8 weights, bf16 x: decode batches of 9-32, short prompts) on the
# skinny W8A8 kernel instead of torch._scaled_mm (engine/cuda/fp8_linear.py); "0": always _scaled_mm (the A/B).
W8A8_SKINNY_ROWS = _count("METRALE_W8A8_SKINNY_ROWS", 32)
# Attention of eager prefill forwards of >= 2048 prompt tokens (engine/cuda/prefill_fused.py): "cudnn" (cuDNN's fused
# attention where a sequence has 4096+ keys, FlashAttention below; engine/cuda/prefill_cudnn.py: 1.20x / 1.23x Flash's
# 1 x 32k prefill at 1B / 8B, bench/RESULTS.md) or "flash" (torch's FlashAttention 2 varlen entry for all,
# engine/cuda/prefill_flash.py: no cuDNN planning, ~45 ms a new shape, at all).
PREFILL_ATTENTION = _choice("METRALE_PREFILL_ATTENTION", "cudnn", ("cudnn", "flash"))
# Prefill forwards of at most this many padded tokens replay CUDA graphs (engine/prefill.py; larger ones run eager);
# 0 (unset): sized from the model (prefill.prefill_graph_tokens: 4096 at 1B, 1024 at 8B).
PREFILL_GRAPH_TOKENS = _count("METRALE_PREFILL_GRAPH_TOKENS", 0)
# Attention of graphed prefill forwards of fresh prompts whose longest has >= 2048 tokens (engine/cuda/prefill_varlen.py):
# "flash" (FlashAttention's variable-length entry on the forward's own rows) or "paged" (kernels_cu/prefill_attention.cu,
# as every other graphed forward).
PREFILL_GRAPH_ATTENTION = _choice("METRALE_PREFILL_GRAPH_ATTENTION", "flash", ("paged", "flash"))
# With "cudnn": the keys a forward's longest sequence must have for cuDNN to take it (FlashAttention below).
CUDNN_MIN_KEYS = _count("METRALE_CUDNN_MIN_KEYS", 4096)
# The GEMMs of forwards of 9-256 rows (decode, verify, short prompts): "cublas" (torch's, with the split-K bmm and the
# separate epilogue kernels of engine/cuda/ops.py), "sm90" (kernels_cu/gemm_sm90.cu on the warpgroup MMA, epilogues
# fused, for the projections and row counts where it measured faster than cuBLAS: engine/cuda/hopper_gemm.py ROUTES)
# or "sm90-all" (every projection it takes: for A/B runs). sm_90 devices only, cuBLAS elsewhere. The default, "sm90",
# measured 0.7-5.6% faster steps at batch 16-32 and the same at 64-256 on an H100 (bench/RESULTS.md), and the GPU
# suite passes with it.
GEMM = _choice("METRALE_GEMM", "sm90", ("sm90", "cublas", "sm90-all"))
# Under "sm90": the most rows of a gate_up projection (bf16 weights, SiLU-and-mul fused) the Hopper GEMM takes
# (engine/cuda/hopper_gemm.py ROUTES; cuBLAS and the separate SiLU kernel past it). For A/B runs of the route.
GEMM_SILU_ROWS = _count("METRALE_GEMM_SILU_ROWS", 32)
