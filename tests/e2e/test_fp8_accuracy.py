"""FP8 accuracy on the real default model (SmolLM2-135M-Instruct) on CPU: teacher-forced top-1 agreement with
transformers in fp32 (loaded from the same converted checkpoint) and perplexity over seven English passages
(tests/teacher_forcing.py, 1,987 scored rows), for the engine unquantized (fp32 and bf16), with --quantization fp8
(per-channel scales), with --quantize-lm-head too, with block scales (--fp8-weight-block 1x64 and 1x32), with an
FP8 KV cache, as a bf16 FP8 worker computes its prompts (W8A8), and as a bf16 weight-only FP8 worker does
(--fp8-activation-scheme none: W8A16), both also with decoder layers kept in bf16 (--fp8-skip-layers). Engine.score gives the log-probs of every position; `pytest -s` prints the
figures, each setting scored the first time a test reads it.

Issue 43's floors: FP8 agreement >= 0.90, and within 0.05 of the unquantized worker's own agreement; FP8
perplexity within 3% of the unquantized worker's. Measured on the dev box (agreement / perplexity over all
rows; dev box 2026-12-06, torch 2.13: bf16 0.9683 / 20.692, fp32 1.000 / 20.702; the bf16 rows read 0.9718 / 20.715
for bf16, 0.9064 for W8A8 and 0.9275 for W8A16 on 2026-12-05):

| engine | agreement | perplexity | KL, 1e-3 nats |
|---|---|---|---|
| fp8 (per channel, fp32 activations) | 0.9361 | 20.932 | 11.4 |
| fp8 + LM head | 0.8948 | 21.387 | 22.5 |
| fp8 w8a8 (bf16, activations per token to E4M3) | 0.9094 | 21.212 | 22.6 |
| fp8 w8a16 (bf16, weight-only: --fp8-activation-scheme none) | 0.9341 | 20.927 | 12.5 |
| fp8 w8a16, layers 0 and 29 in bf16 (--fp8-skip-layers 0,-1) | 0.9376 | 20.930 | 10.0 |
| fp8 w8a8, layers 0, 1, 28 and 29 in bf16 (--fp8-skip-layers 0,1,-2,-1) | 0.9205 | 21.012 | 15.9 |
| fp8 1x64 / 1x32 | 0.9416 / 0.9361 | 21.082 / 21.066 | 11.5 / 10.2 |
| fp8 kv | 0.9527 | 20.798 | 5.5 |
| fp8 1x64 + fp8 kv | 0.9195 | 21.159 | 17.6 |

A row is 0.0005 of agreement. Over the first passage alone (330 rows, what this test scored until 2026-12-05)
the per-passage figures range over +-0.03 (w8a8 0.886-0.912, fp8 0.910-0.958 across the seven), so one passage
ranked quantizations of similar error by chance; the regression bounds sit ten or more rows outside the pooled
figures. What holds against the bf16 worker: per-channel FP8 weights (-0.036, +1.0%), 1x64 and 1x32 blocks, and
the FP8 KV cache meet all three floors. Against the fp32 worker's 1.000 the weights' 0.05 is missed (an xfail(strict)
each). Quantizing the tied LM head (49152 x 576) too costs as much again as all the projections and falls below
the absolute floor and the perplexity floor.

W8A8 ("fp8 w8a8", the arithmetic of a bf16 FP8 worker's prompts and decode batches over 8 rows, on the GPU's
tensor cores and here in torch alike, engine.quant.takes_w8a8) drops 0.059 of agreement against the bf16 worker,
past the 0.05 floor (an xfail(strict)); its perplexity is within 3% (+2.5%), and its agreement sits near the
absolute floor (1,807 of 1,987 rows; 1,789 needed), which is asserted only as a regression bound. Rounding the
activations to E4M3 costs about as much as rounding the weights; finer activation scales do not recover it
(bench/RESULTS.md, FP8 accuracy).

Weight-only ("fp8 w8a16": the W8A8 row's setting with the activations never quantized, W8A16 at every batch) meets
all three floors against the bf16 worker: -0.034 of agreement, +1.1% perplexity. With the first two and last two
layers' projections kept in bf16 (--fp8-skip-layers 0,1,-2,-1: 4 of 30 layers' bytes back) W8A8 meets them too
(-0.048, +1.5%)."""
from __future__ import annotations

import pytest
import torch

from conftest import engine_config
from engine.engine import Engine
from engine.tokenizer import Tokenizer
from tests.teacher_forcing import PASSAGES, pooled_figures
from tests.oracle import hf_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

AGREEMENT_FLOOR = 0.90
AGREEMENT_MAX_DROP = 0.05
PERPLEXITY_MAX_RISE = 0.03

SETTINGS = (("fp32", {}), ("bf16", {"dtype": "bfloat16"}), ("fp8", {"quantization": "fp8"}),
            ("fp8 + lm head", {"quantization": "fp8", "quantize_lm_head": True}),
            ("fp8 w8a8", {"quantization": "fp8", "dtype": "bfloat16"}),
            ("fp8 w8a16", {"quantization": "fp8", "dtype": "bfloat16", "fp8_activation_scheme": "none"}),
            ("fp8 w8a16, first and last layers bf16", {"quantization": "fp8", "dtype": "bfloat16",
                                                       "fp8_activation_scheme": "none", "fp8_skip_layers": "0,-1"}),
            ("fp8 w8a8, two first and two last layers bf16", {"quantization": "fp8", "dtype": "bfloat16",
                                                             "fp8_skip_layers": "0,1,-2,-1"}),
            ("fp8 1x64", {"quantization": "fp8", "fp8_weight_block": "1x64"}),
            ("fp8 1x32", {"quantization": "fp8", "fp8_weight_block": "1x32"}),
            ("fp8 kv", {"kv_cache_dtype": "fp8"}),
            ("fp8 1x64 + fp8 kv", {"quantization": "fp8", "fp8_weight_block": "1x64", "kv_cache_dtype": "fp8"}))


@pytest.fixture(scope="module")
def passages(default_model) -> list[list[int]]:
    tokenizer = Tokenizer.from_dir(default_model)
    out = [tokenizer.encode(text) for text in PASSAGES.values()]
    assert all(200 <= len(ids) <= 500 for ids in out), [len(ids) for ids in out]
    return out


@pytest.fixture(scope="module")
def reference(default_model, passages) -> list[torch.Tensor]:
    """transformers fp32 log-softmax rows of each passage."""
    model = hf_model(default_model)
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1) for ids in passages]


def engine_scores(model, passages: list[list[int]], **changes) -> list[torch.Tensor]:
    engine = Engine(engine_config(model, **changes))
    try:
        info = engine.info()
        assert info.quantization == changes.get("quantization", "none")
        block = changes.get("fp8_weight_block", "channel")
        assert info.fp8_weight_block == ("" if info.quantization == "none" else block)
        scheme = changes.get("fp8_activation_scheme", "dynamic")
        assert info.fp8_activation_scheme == ("" if info.quantization == "none" else scheme)
        skip = [int(i) % 30 for i in changes["fp8_skip_layers"].split(",")] if "fp8_skip_layers" in changes else []
        assert info.fp8_skipped_layers == sorted(skip)  # the default model has 30 layers
        assert info.kv_cache_dtype == ("float8_e4m3fn" if changes.get("kv_cache_dtype") == "fp8" else info.dtype)
        return [engine.score(ids).float() for ids in passages]
    finally:
        engine.close()


class Figures:
    """(agreement, perplexity) of each engine setting of SETTINGS, scored the first time a test reads it (a `-k` run
    scores only the settings its tests read); the unquantized fp32 engine is checked to be transformers."""

    def __init__(self, model, passages: list[list[int]], reference: list[torch.Tensor]):
        self.model, self.passages, self.reference = model, passages, reference
        self.scored: dict[str, tuple[float, float]] = {}
        _, ref_ppl, _ = pooled_figures(reference, reference, passages)
        print(f"\nSmolLM2-135M-Instruct, {sum(map(len, passages)) - len(passages)} rows of {len(passages)} passages, "
              f"teacher-forced against transformers fp32 (perplexity {ref_ppl:.4f}):")

    def __getitem__(self, name: str) -> tuple[float, float]:
        if name not in self.scored:
            logps = engine_scores(self.model, self.passages, **{"dtype": "float32", **dict(SETTINGS)[name]})
            if name == "fp32":  # the unquantized engine is transformers, up to fp32 rounding
                assert max((lp - ref).abs().max().item() for lp, ref in zip(logps, self.reference)) < 1e-3
            agree, ppl, kl = pooled_figures(logps, self.reference, self.passages)
            print(f"  {name:45s} top-1 agreement {agree:.4f}  perplexity {ppl:.4f}  KL {kl * 1e3:.2f}e-3 nats")
            self.scored[name] = agree, ppl
        return self.scored[name]


@pytest.fixture(scope="module")
def figures(default_model, passages, reference) -> Figures:
    return Figures(default_model, passages, reference)


# (largest agreement drop, largest perplexity rise) against the bf16 worker: ten or more rows outside the measured
# figures (module docstring), the absolute floor where it is met
REGRESSION_BOUNDS = {"fp8": (0.045, 0.02), "fp8 1x64": (0.04, 0.025), "fp8 1x32": (0.045, 0.025)}


@pytest.mark.parametrize("name", REGRESSION_BOUNDS)
def test_fp8_agreement_floor_and_regression_bounds(figures, name):
    agree, ppl = figures[name]
    assert agree >= AGREEMENT_FLOOR, (name, agree)
    base_agree, base_ppl = figures["bf16"]
    max_drop, max_rise = REGRESSION_BOUNDS[name]
    assert agree >= base_agree - max_drop, (name, agree, base_agree)
    assert ppl <= base_ppl * (1 + max_rise), (name, ppl, base_ppl)


RELATIVE_FLOORS = [("fp8", "bf16"), ("fp8 1x64", "bf16"), ("fp8 1x32", "bf16")] + [
    pytest.param(name, "fp32", marks=pytest.mark.xfail(
        strict=True, reason=f"{name} agreement {agree} vs the fp32 worker's 1.000 (module docstring)"))
    for name, agree in (("fp8", 0.936), ("fp8 1x64", 0.942), ("fp8 1x32", 0.936))]


@pytest.mark.parametrize("name, base", RELATIVE_FLOORS)
def test_fp8_weights_meet_the_relative_floors_of_issue_43(figures, name, base):
    base_agree, base_ppl = figures[base]
    agree, ppl = figures[name]
    assert agree >= base_agree - AGREEMENT_MAX_DROP, (agree, base_agree)
    assert abs(ppl / base_ppl - 1) <= PERPLEXITY_MAX_RISE, (ppl, base_ppl)


def test_a_quantized_lm_head_stays_within_its_regression_bounds(figures):
    """--quantize-lm-head: 0.8948 / +3.2% against bf16, below the absolute and perplexity floors (module docstring):
    held to where it is, ten rows and 0.8% outside."""
    agree, ppl = figures["fp8 + lm head"]
    base_agree, base_ppl = figures["bf16"]
    assert agree >= base_agree - 0.082 and ppl <= base_ppl * 1.04, (agree, ppl, base_agree, base_ppl)


def test_w8a8_meets_the_perplexity_floor_and_its_regression_bound(figures):
    agree, ppl = figures["fp8 w8a8"]
    base_agree, base_ppl = figures["bf16"]
    assert abs(ppl / base_ppl - 1) <= PERPLEXITY_MAX_RISE, (ppl, base_ppl)
    assert agree >= base_agree - 0.077, (agree, base_agree)


@pytest.mark.xfail(strict=True, reason="W8A8 agreement 0.909 vs the bf16 worker's 0.968: 0.059 drop, past 0.05 "
                                       "(module docstring)")
def test_w8a8_agreement_within_the_relative_floor(figures):
    assert figures["fp8 w8a8"][0] >= figures["bf16"][0] - AGREEMENT_MAX_DROP


def test_an_fp8_kv_cache_meets_the_floors_of_issue_43(figures):
    """--kv-cache-dtype fp8 (E4M3, scale 1) with the weights unquantized, against the bf16 worker as the issue
    states its floors: agreement >= 0.90 and within 0.05 of bf16's, perplexity within 3% (measured on the dev
    box: 0.953 / 20.80 against bf16's 0.968 / 20.69)."""
    base_agree, base_ppl = figures["bf16"]
    agree, ppl = figures["fp8 kv"]
    assert agree >= AGREEMENT_FLOOR and agree >= base_agree - AGREEMENT_MAX_DROP, (agree, base_agree)
    assert abs(ppl / base_ppl - 1) <= PERPLEXITY_MAX_RISE, (ppl, base_ppl)


def test_fp8_weights_and_kv_together_stay_above_the_absolute_floor(figures):
    agree, ppl = figures["fp8 1x64 + fp8 kv"]
    assert agree >= AGREEMENT_FLOOR, agree
    assert ppl <= figures["bf16"][1] * 1.05, (ppl, figures["bf16"][1])


def test_weight_only_fp8_in_bf16_meets_the_floors_of_issue_43(figures):
    """--fp8-activation-scheme none ("fp8 w8a16"): the W8A8 row's setting (a bf16 worker, per-channel FP8 weights)
    with the activations never quantized (W8A16 at every batch, engine.quant's module docstring) meets all three
    floors against the bf16 worker, which W8A8 misses."""
    base_agree, base_ppl = figures["bf16"]
    agree, ppl = figures["fp8 w8a16"]
    assert agree >= AGREEMENT_FLOOR and agree >= base_agree - AGREEMENT_MAX_DROP, (agree, base_agree)
    assert abs(ppl / base_ppl - 1) <= PERPLEXITY_MAX_RISE, (ppl, base_ppl)


def test_fp8_skip_layers_keeps_the_first_and_last_layers_in_bf16_for_accuracy(figures):
    """--fp8-skip-layers 0,-1 on the weight-only worker: the first and last of 30 layers keep bf16 projections (2 of
    30 layers' bytes back): the floors against bf16 held, and no row of agreement lost against all 30 in FP8 (dev
    box, 2026-12-06: 0.9376 against 0.9341, KL to fp32 9.98e-3 against 12.47e-3 nats)."""
    base_agree, base_ppl = figures["bf16"]
    agree, ppl = figures["fp8 w8a16, first and last layers bf16"]
    assert agree >= AGREEMENT_FLOOR and agree >= base_agree - AGREEMENT_MAX_DROP, (agree, base_agree)
    assert agree >= figures["fp8 w8a16"][0], (agree, figures["fp8 w8a16"][0])
    assert abs(ppl / base_ppl - 1) <= PERPLEXITY_MAX_RISE, (ppl, base_ppl)


def test_fp8_skip_layers_brings_w8a8_within_the_relative_floor(figures):
    """W8A8 misses the 0.05 against bf16 (an xfail above); with the two first and two last layers' projections in
    bf16 (4 of 30) it meets it."""
    base_agree, base_ppl = figures["bf16"]
    agree, ppl = figures["fp8 w8a8, two first and two last layers bf16"]
    assert agree >= AGREEMENT_FLOOR and agree >= base_agree - AGREEMENT_MAX_DROP, (agree, base_agree)
    assert abs(ppl / base_ppl - 1) <= PERPLEXITY_MAX_RISE, (ppl, base_ppl)
