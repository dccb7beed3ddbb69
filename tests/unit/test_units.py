"""CPU unit tests of the small classes: block allocator, slot table, leases, the weighted histogram,
configs, CLI flags."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import TINY_CONFIGS  # noqa: F401

from engine.checkpoint import make_config
from engine.config import EngineConfig, ModelConfig
from engine.errors import ConfigError, ResourceExhausted
from engine.sampling import SamplingParams, StoppingCriteria
from engine.sequence import FinishReason, Sequence, SlotTable
from engine.warm_up import warm_up_prefill
from worker.config import WorkerConfig, config_from_args, serve_parser
from worker.leases import Leases
from worker.metrics import LATENCY_BUCKETS, WeightedHistogram


def test_slot_table_is_a_free_list():
    table = SlotTable(3)
    slots = [table.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and not table.can_allocate()
    with pytest.raises(ResourceExhausted):
        table.allocate()
    table.free(1)
    assert table.allocate() == 1


def test_sequence_finish_reasons():
    def seq(**stop):
        s = Sequence(1, 0, capacity=8, blocks=None, sampling=SamplingParams(), stopping=StoppingCriteria(**stop),
                     token_ids=[5, 6], prompt_len=2, num_cached=2)
        return s
    assert seq().append(2, frozenset({2})) == FinishReason.EOS
    assert seq(ignore_eos=True).append(2, frozenset({2})) == FinishReason.NONE
    assert seq(stop_token_ids=frozenset({7})).append(7, frozenset()) == FinishReason.STOP_TOKEN
    s = seq(max_new_tokens=2)
    assert s.append(9, frozenset()) == FinishReason.NONE and s.append(9, frozenset()) == FinishReason.LENGTH
    s = seq()
    reasons = [s.append(9, frozenset()) for _ in range(6)]
    assert reasons[-1] == FinishReason.LENGTH and s.seq_len == 8 and reasons[:-1] == [FinishReason.NONE] * 5


def test_leases_limit_per_client_and_expire_idle():
    now = [0.0]
    leases = Leases(max_per_client=2, idle_timeout_s=10, clock=lambda: now[0])
    leases.add(1, "a")
    leases.add(2, "a")
    leases.add(3, "b")
    with pytest.raises(ResourceExhausted, match="'a'"):
        leases.check_can_add("a")
    leases.check_can_add("b")
    now[0] = 5
    leases.touch([1])
    now[0] = 12
    assert sorted(leases.expired()) == [2, 3]
    leases.remove([2])
    leases.check_can_add("a")
    assert len(leases) == 2 and Leases().expired() == []


def test_weighted_histogram_exposes_what_n_single_observations_would():
    from prometheus_client import CollectorRegistry, Histogram
    from prometheus_client.exposition import generate_latest

    weighted, single = CollectorRegistry(), CollectorRegistry()
    w = WeightedHistogram("gap_seconds", "doc", LATENCY_BUCKETS, weighted)
    h = Histogram("gap_seconds", "doc", buckets=LATENCY_BUCKETS, registry=single)
    for value, n in ((0.0002, 3), (0.0031, 5), (0.5, 1), (99.0, 2)):  # a bound itself, inside, far above
        w.observe(value, n)
        for _ in range(n):
            h.observe(value)

    def samples(registry):
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]
    assert samples(weighted) == samples(single)


def test_model_config_reads_both_rope_layouts():
    legacy = make_config("llama", "tiny", rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    modern = dict(legacy)
    del modern["rope_theta"], modern["rope_scaling"]
    modern["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64, "rope_theta": 5e5}
    assert ModelConfig.from_dict(legacy).rope == ModelConfig.from_dict(modern).rope
    assert ModelConfig.from_dict(legacy).rope.theta == 5e5
    old_style = make_config("llama", "tiny", rope_scaling={"type": "linear", "factor": 2.0})
    assert ModelConfig.from_dict(old_style).rope.rope_type == "linear"


@pytest.mark.parametrize("change,match", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "unsupported architecture"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type"),
    (dict(num_key_value_heads=3), "multiple"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_model_config_rejects_what_it_cannot_run(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(make_config("llama", "tiny", **change))


def test_model_config_missing_key_is_a_clear_error():
    raw = make_config("qwen2", "tiny")
    del raw["intermediate_size"]
    with pytest.raises(ConfigError, match="intermediate_size"):
        ModelConfig.from_dict(raw)


def test_checkpoint_missing_tensor_fails_at_load(tmp_path):
    import safetensors.torch

    from engine.checkpoint import write_checkpoint
    from engine.engine import Engine
    path = write_checkpoint(tmp_path / "m", arch="qwen3", shape="tiny")
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    safetensors.torch.save_file(tensors, path / "model.safetensors")
    with pytest.raises(ConfigError, match="model.layers.1.self_attn.k_norm.weight"):
        Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=8))


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    import torch

    from engine.checkpoint import write_checkpoint
    from engine.engine import Engine
    one = write_checkpoint(tmp_path / "one", arch="qwen2", shape="tiny", seed=4)
    many = write_checkpoint(tmp_path / "many", arch="qwen2", shape="tiny", seed=4, max_shard_bytes=60_000)
    assert len(list(many.glob("*.safetensors"))) > 2 and (many / "model.safetensors.index.json").exists()
    a = Engine(EngineConfig(model=str(one), device="cpu", num_kv_blocks=8)).runtime.weights
    b = Engine(EngineConfig(model=str(many), device="cpu", num_kv_blocks=8)).runtime.weights
    assert torch.equal(a.layers[1].qkv_bias, b.layers[1].qkv_bias) and torch.equal(a.lm_head, b.lm_head)


def test_a_temporary_checkpoint_is_gone_when_its_process_exits():
    """The benchmarks' written models (write_temporary_checkpoint) do not outlive the process that wrote them."""
    import pathlib
    import subprocess
    import sys
    code = ("from engine.checkpoint import write_temporary_checkpoint as w; p = w('tiny'); "
            "print(p, (p / 'config.json').exists())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).resolve().parents[2]).stdout.split()
    path, existed = pathlib.Path(out[0]), out[1] == "True"
    assert existed and not path.exists() and not path.parent.exists()


@pytest.mark.parametrize("cls,change", [
    (EngineConfig, dict(max_slots=0)), (EngineConfig, dict(block_size=12)), (EngineConfig, dict(device="tpu")),
    (EngineConfig, dict(warm_up_widths=-2)), (EngineConfig, dict(max_steps_in_flight=5)),
    (WorkerConfig, dict(port=70000)), (WorkerConfig, dict(tls_cert_file="c.pem")),
    (WorkerConfig, dict(tls_client_ca_file="ca.pem")), (WorkerConfig, dict(grace_period_s=-1)),
    (WorkerConfig, dict(gil_switch_interval_us=-1)),
    (WorkerConfig, dict(stream_interval=0)),
])
def test_config_validation(cls, change):
    with pytest.raises(ConfigError):
        cls(**change)


def test_configuration_errors_name_the_flag_the_user_typed():
    """The command line shows a configuration error that opens with a field's name with its flag instead."""
    from worker.config import name_the_flag

    for cls, change in ((WorkerConfig, dict(port=70000)), (EngineConfig, dict(max_slots=0)),
                        (EngineConfig, dict(quantize_lm_head=True))):
        with pytest.raises(ConfigError) as e:
            cls(**change)
        field = next(iter(change))
        assert str(e.value).startswith(field + " ")
        assert name_the_flag(str(e.value)) == "--" + field.replace("_", "-") + str(e.value)[len(field):]
    assert name_the_flag("fp8_skip_layers: layer 40 is outside") == "--fp8-skip-layers: layer 40 is outside"
    assert name_the_flag("the weights do not fit") == "the weights do not fit"
    assert name_the_flag("portable: no") == "portable: no"


def test_every_config_field_is_a_flag_with_the_dataclass_default():
    parser = serve_parser()
    defaults = parser.parse_args([])
    assert config_from_args(WorkerConfig, defaults) == WorkerConfig()
    assert config_from_args(EngineConfig, defaults) == EngineConfig()
    args = parser.parse_args(["--max-slots", "7", "--no-reflection", "--model", "/m", "--grace-period-s", "2.5",
                              "--dtype", "bfloat16"])
    assert config_from_args(EngineConfig, args) == EngineConfig(max_slots=7, model="/m", dtype="bfloat16")
    assert config_from_args(WorkerConfig, args) == WorkerConfig(reflection=False, grace_period_s=2.5)
    flags = {a.dest for a in parser._actions}
    for cls in (WorkerConfig, EngineConfig):
        assert {f.name for f in dataclasses.fields(cls)} <= flags



def test_vllm_flag_names_set_the_same_fields():
    """vLLM's names for the flags a vLLM user brings: --max-model-len, --max-num-seqs, --max-num-batched-tokens,
    --[no-]enable-prefix-caching, --enforce-eager, -tp and --served-model-name."""
    parser = serve_parser()
    args = parser.parse_args(["--max-model-len", "100", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                              "--no-enable-prefix-caching", "--enforce-eager", "-tp", "2",
                              "--served-model-name", "org/chat-model"])
    assert config_from_args(EngineConfig, args) == EngineConfig(
        max_seq_len=100, max_slots=8, max_prefill_tokens=512, prefix_caching=False, cuda_graphs=False,
        tensor_parallel_size=2, served_model_name="org/chat-model")
    assert config_from_args(EngineConfig, parser.parse_args(["--enable-prefix-caching"])).prefix_caching
    assert config_from_args(EngineConfig, parser.parse_args([])).cuda_graphs  # --enforce-eager sets no default
    for name in (" padded", "trailing ", "two\nlines"):
        with pytest.raises(ConfigError, match="served_model_name"):
            EngineConfig(served_model_name=name)

def _varlen_causal_attention(q, k, v, cu_q, cu_k, scale):
    """FlashAttention's varlen contract written out in torch (the test's oracle of what the call computes):
    sequence b's queries cu_q[b]..cu_q[b+1] attend to its keys cu_k[b]..cu_k[b+1], causal with the mask aligned
    to the last key; K/V heads shared by groups of query heads."""
    import torch
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        kb = k[k0:k1].repeat_interleave(group, dim=1)
        vb = v[k0:k1].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], kb) * scale
        q_pos = torch.arange(k1 - k0 - (q1 - q0), k1 - k0)[:, None]
        scores = scores.masked_fill(torch.arange(k1 - k0)[None, :] > q_pos, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vb)
    return out


def test_flash_plan_attends_fresh_prompts_and_chunks_after_a_cached_prefix_like_the_reference():
    """The varlen FlashAttention plan (engine/cuda/prefill_flash.py; index math only, so it runs on CPU): with
    its gathered keys and cu_seqlens, FlashAttention's contract (written out above) gives TorchOps' prefill
    attention for a fresh prompt, chunks after cached prefixes and a one-token chunk; the forward's pad rows
    form one more sequence, so the call covers every row of q."""
    import torch

    from engine.cuda.prefill_flash import plan as flash_plan
    from engine.ops.torch_ops import TorchOps
    torch.manual_seed(0)
    bs, H, Hkv, D = 16, 8, 2, 32
    cached, new, pad = [0, 37, 64, 200], [50, 20, 16, 1], 9
    lens = [c + n for c, n in zip(cached, new)]
    tables = (torch.randperm(4 * 17) + 1).to(torch.int32).view(4, 17)  # scattered blocks, 264 keys at most
    k_cache, v_cache = torch.randn(4 * 17 + 1, bs, Hkv, D), torch.randn(4 * 17 + 1, bs, Hkv, D)
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1] + pad, H, D)
    plan = flash_plan(tuple(qsl), tuple(lens), q.shape[0], tables, bs)
    assert plan.cu_q.tolist() == qsl + [qsl[-1] + pad]
    assert plan.cu_k.tolist()[:5] == [0, 50, 107, 187, 388] and plan.cu_k.tolist()[5] == 388 + pad
    assert (plan.max_q, plan.max_k) == (50, 201)
    assert plan.cu_q.dtype == plan.cu_k.dtype == torch.int32
    k = k_cache.view(-1, Hkv, D)[plan.kv_index]
    v = v_cache.view(-1, Hkv, D)[plan.kv_index]
    out = _varlen_causal_attention(q, k, v, plan.cu_q, plan.cu_k, D ** -0.5)
    assert out.shape == q.shape and torch.isfinite(out).all()
    ref = TorchOps().prefill_attention(q[:qsl[-1]], k_cache, v_cache, tables, qsl, lens, D ** -0.5)
    torch.testing.assert_close(out[:qsl[-1]], ref, rtol=1e-5, atol=1e-5)
    # no pad rows: no extra sequence
    whole = flash_plan((0, 512, 1024), (512, 512), 1024, torch.arange(64, dtype=torch.int32).view(2, 32), bs)
    assert whole.cu_q.tolist() == [0, 512, 1024] and whole.cu_k.tolist() == [0, 512, 1024]


def _first_key_aligned_attention(q, k, v, causal, with_lse, scale):
    """cuDNN's contract written out in torch ([B, H, Lq, D] queries over [B, Hkv, Lk, D] keys and values, each KV head
    serving H / Hkv query heads; its causal mask aligned to the first key)."""
    import torch
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, dim=-1), v.float()).to(q.dtype), lse


@pytest.mark.parametrize("cached,new,pad,groups", [
    ([0, 0, 0], [300, 256, 37], 0, 2),  # fresh prompts: sides 512, 256 and 256 (one call for the two)
    ([1500, 2048, 0, 1030], [700, 256, 512, 1], 40, 4),  # after cached prefixes: (side, cut) 1280 / 1024, 256 / 2048,
                                                         # 512 / 0, 256 / 1024
    ([4096], [1024], 0, 1)])  # a long prompt's chunk: q's rows as they are
def test_cudnn_plan_cuts_prefixes_into_bucketed_blocks_and_matches_the_reference(cached, new, pad, groups):
    """The cuDNN route's plan (engine/cuda/prefill_cudnn.py; index math and the merge, on CPU with torch math in
    cuDNN's place): each sequence's attention as a square causal block of a bucketed side, the prefix's last keys
    brought in by dummy queries, plus the unmasked bucketed prefix, merged by log-sum-exps, gives TorchOps' prefill
    attention; shapes come from the buckets only."""
    import torch

    from engine.cuda.prefill_cudnn import PREFIX_BUCKET, SQUARE_BUCKET, attend
    from engine.cuda.prefill_cudnn import plan as cudnn_plan
    from engine.ops.torch_ops import TorchOps
    torch.manual_seed(0)
    bs, H, Hkv, D = 16, 4, 2, 16
    lens = [c + n for c, n in zip(cached, new)]
    width = max(-(-n // bs) for n in lens)
    tables = (torch.randperm(len(lens) * width) + 1).to(torch.int32).view(len(lens), width)
    k_cache, v_cache = (torch.randn(len(lens) * width + 1, bs, Hkv, D, dtype=torch.float64) for _ in range(2))
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1] + pad, H, D, dtype=torch.float64)
    plan = cudnn_plan(tuple(qsl), tuple(lens), q.shape[0], tables, bs)
    for g in plan:
        assert g.side % SQUARE_BUCKET == 0
        assert g.pre_index is None or g.pre_index.shape[0] % (g.num_seqs * PREFIX_BUCKET) == 0
    assert len(plan) == groups and sum(g.num_seqs for g in plan) == len(lens)
    if len(new) == 1:  # a chunk of whole buckets after a bucketed prefix: q's own rows, nothing gathered
        assert plan[0].q_index is None and plan[0].pre_index.shape[0] == 4096
    out = attend(plan, q, k_cache, v_cache, D ** -0.5, attention=_first_key_aligned_attention)
    ref = TorchOps().prefill_attention(q[:qsl[-1]], k_cache, v_cache, tables, qsl, lens, D ** -0.5)
    torch.testing.assert_close(out[:qsl[-1]], ref, rtol=1e-4, atol=1e-5)  # both in fp32; a wrong mask: ~1e-1


def test_fused_prefill_routes_long_forwards_to_cudnn_and_falls_back_to_flash_for_good(monkeypatch):
    """FusedPrefill (engine/cuda/prefill_fused.py; the two routes replaced by recorders, so it runs on CPU): with
    cuDNN chosen, forwards whose longest sequence reaches cudnn_min_keys go to cuDNN and shorter ones to
    FlashAttention; a RuntimeError from cuDNN (a shape it refuses) reruns the forward on FlashAttention and keeps
    it there, as a failed warm-up does; FlashAttention's own errors are not swallowed."""
    import torch

    from engine.cuda import prefill_cudnn, prefill_flash
    from engine.cuda.prefill_fused import CUDNN_MIN_KEYS, FusedPrefill
    calls = []

    def route(name, fail=False):
        def attend(plan, q, k_cache, v_cache, scale):
            calls.append((name, plan))
            if fail:
                raise RuntimeError("cuDNN Frontend error: no valid engine configs\nmore")
            return q
        return attend
    monkeypatch.setattr(prefill_flash, "plan", lambda *a: ("flash plan", a[1]))
    monkeypatch.setattr(prefill_cudnn, "plan", lambda *a: ("cudnn plan", a[1]))
    monkeypatch.setattr(prefill_flash, "attend", route("flash"))
    monkeypatch.setattr(prefill_cudnn, "attend", route("cudnn"))
    q, cache, tables = torch.zeros(4, 2, 8), torch.zeros(3, 16, 1, 8), torch.zeros(1, 1, dtype=torch.int32)
    fused = FusedPrefill("cudnn")
    fused(q, cache, cache, tables, [0, 4], [CUDNN_MIN_KEYS - 1], 1.0)
    fused.forget()
    fused(q, cache, cache, tables, [0, 4], [CUDNN_MIN_KEYS], 1.0)
    fused(q, cache, cache, tables, [0, 4], [CUDNN_MIN_KEYS], 1.0)  # the next layer: the same plan
    assert [c[0] for c in calls] == ["flash", "cudnn", "cudnn"]
    assert calls[1][1] == ("cudnn plan", (CUDNN_MIN_KEYS,))
    calls.clear()
    monkeypatch.setattr(prefill_cudnn, "attend", route("cudnn", fail=True))
    fused.forget()
    assert fused(q, cache, cache, tables, [0, 4], [CUDNN_MIN_KEYS + 4], 1.0) is q
    fused.forget()
    fused(q, cache, cache, tables, [0, 4], [CUDNN_MIN_KEYS + 8], 1.0)
    assert [c[0] for c in calls] == ["cudnn", "flash", "flash"] and fused.route is prefill_flash
    assert FusedPrefill("flash").warm_up(2, 1, 8, torch.float32, torch.device("cpu"), 8192, 32768) == 0
    warmed = FusedPrefill("cudnn")
    monkeypatch.setattr(prefill_cudnn, "warm_up", lambda *a: (_ for _ in ()).throw(RuntimeError("refused")))
    assert warmed.warm_up(2, 1, 8, torch.float32, torch.device("cpu"), 8192, 32768) == 0
    assert warmed.route is prefill_flash
    monkeypatch.setattr(prefill_flash, "attend", route("flash", fail=True))
    with pytest.raises(RuntimeError):
        warmed(q, cache, cache, tables, [0, 4], [CUDNN_MIN_KEYS], 1.0)


@pytest.mark.parametrize("cluster", [1, 8])
def test_decode_attention_grid_rules(cluster):
    """Decode attention's grid (engine/cuda/wrappers/decode_attention.py; arithmetic on device properties
    only, so it runs on CPU with an H200's numbers): splits keep every block resident at once, are a multiple
    of the cluster size when they exceed it, and the launch's cluster divides them; fits_one_wave says
    whether the whole grid is resident."""
    from engine.cuda.library import KernelLibrary
    from engine.cuda.wrappers import decode_attention
    lib = KernelLibrary.__new__(KernelLibrary)  # no device: only the grid rules are under test
    lib.num_sms, lib.decode_blocks_per_sm, lib.decode_cluster = 132, {64: 3, 128: 2}, cluster
    for batch in (1, 2, 3, 8, 17, 32, 49, 50, 64, 128, 256):
        for heads, kv_heads, head_dim in ((32, 8, 64), (32, 8, 128), (32, 1, 128), (8, 8, 64)):
            for max_len in (64, 300, 2048, 131072):
                splits = decode_attention.key_splits(lib, batch, heads, kv_heads, head_dim, max_len)
                blocks = batch * kv_heads * -(-(heads // kv_heads) // 16)
                assert 1 <= splits <= max(1, -(-max_len // 64))
                if splits > 1:
                    assert blocks * splits <= lib.decode_blocks_per_sm[head_dim] * lib.num_sms
                c = decode_attention.cluster_size(lib, splits)
                assert 1 <= c <= cluster and splits % c == 0
                assert (splits <= cluster) or splits % cluster == 0
                assert decode_attention.fits_one_wave(lib, batch, heads, kv_heads, head_dim, max_len) == (
                    blocks * splits <= lib.decode_blocks_per_sm[head_dim] * lib.num_sms)
    assert decode_attention.key_splits(lib, 1, 32, 8, 64, 2048) == 32  # 1B at batch 1: four clusters of eight
    lib.decode_max_splits = 4  # the experiments' cap (engine_bench --decode-splits): one cluster of four
    assert decode_attention.key_splits(lib, 1, 32, 8, 64, 2048) == 4
    assert decode_attention.cluster_size(lib, 4) == min(4, cluster)
    assert decode_attention.fits_one_wave(lib, 49, 32, 8, 64, 2048)
    assert not decode_attention.fits_one_wave(lib, 50, 32, 8, 64, 2048)


def test_decode_attention_warp_entry_and_grid():
    """The warp entries take one-split decode attention grids of more than one wave of the default entry at head_dim
    128 with 16-bit caches and no fused RoPE; their persistent grid gives each warp the same number of items
    (give or take one) and never more blocks than the SMs hold; every warp's ring fits an SM twice."""
    from engine.cuda.library import MODULES, KernelLibrary
    from engine.cuda.wrappers import decode_attention as da
    lib = KernelLibrary.__new__(KernelLibrary)
    lib.num_sms, lib.decode_blocks_per_sm, lib.decode_warp = 132, {64: 3, 128: 3}, True
    lib.decode_warp_blocks_per_sm = {128: 2}
    assert da.warp_entry(lib, 128 * 8, 1, 128, rope=False, fp8_kv=False)  # 8B at batch 128
    assert da.warp_entry(lib, 64 * 8, 1, 128, rope=False, fp8_kv=False)  # 8B at batch 64: 1.3 waves
    assert not da.warp_entry(lib, 3 * 132, 1, 128, rope=False, fp8_kv=False)  # one wave
    assert not da.warp_entry(lib, 4096, 2, 128, rope=False, fp8_kv=False)  # split
    assert not da.warp_entry(lib, 256 * 8, 1, 64, rope=False, fp8_kv=False)  # 1B heads: the _s2 entries
    assert not da.warp_entry(lib, 4096, 1, 128, rope=True, fp8_kv=False)
    assert not da.warp_entry(lib, 4096, 1, 128, rope=False, fp8_kv=True)
    lib.decode_warp_blocks_per_sm = {128: 0}  # a device whose shared memory holds no block of it
    assert not da.warp_entry(lib, 4096, 1, 128, rope=False, fp8_kv=False)
    lib.decode_warp_blocks_per_sm = {128: 2}
    lib.decode_warp = False
    assert not da.warp_entry(lib, 4096, 1, 128, rope=False, fp8_kv=False)
    resident = 2 * 132 * 4  # warps
    # 2048 items over 1056 resident warps: two each, 1024 warps in 256 blocks
    assert da.warp_grid(lib, 2048, 128) == 256
    assert da.warp_grid(lib, 1000, 128) == 250 and da.warp_grid(lib, 5, 128) == 2
    for items in (397, 1056, 1057, 2048, 5000, 20000):
        blocks = da.warp_grid(lib, items, 128)
        per_warp = -(-items // (4 * blocks))
        assert blocks <= 2 * 132 and per_warp == -(-items // resident)
    # 4 warps x 3 stages x (16 K + 16 V rows) x (128 + 8) x 2 bytes: two blocks within an SM's 228 KB
    assert da.warp_smem_bytes(128) == 4 * 3 * 32 * 136 * 2 and 2 * (da.warp_smem_bytes(128) + 1024) <= 228 * 1024
    names = {spec.name for spec in MODULES["decode_attention"]}
    assert {"decode_attention_bf16_d128_w", "decode_attention_fp16_d128_w"} <= names
    assert "decode_attention_bf16_d64_w" not in names


def test_decode_attention_shallow_entry():
    """The 2-deep _s2 entries take decode attention grids of more than one wave of the default entry at head_dim
    < 128, 16-bit caches without the fused RoPE only, and nothing when the library's switch is off; their shared
    memory is the q tile and two K and V tiles."""
    from engine.cuda.library import MODULES, KernelLibrary
    from engine.cuda.wrappers import decode_attention
    lib = KernelLibrary.__new__(KernelLibrary)
    lib.num_sms, lib.decode_blocks_per_sm, lib.decode_shallow = 132, {64: 3, 128: 2}, True
    one_wave = 3 * 132
    assert not decode_attention.shallow_entry(lib, one_wave, 64, rope=False, fp8_kv=False)
    assert decode_attention.shallow_entry(lib, one_wave + 1, 64, rope=False, fp8_kv=False)
    assert decode_attention.shallow_entry(lib, 256 * 8, 64, rope=False, fp8_kv=False)  # 1B at batch 256
    assert not decode_attention.shallow_entry(lib, 32 * 8, 64, rope=False, fp8_kv=False)  # 1B at batch 32
    assert not decode_attention.shallow_entry(lib, 10_000, 128, rope=False, fp8_kv=False)  # 2-deep already
    assert not decode_attention.shallow_entry(lib, 10_000, 64, rope=True, fp8_kv=False)
    assert not decode_attention.shallow_entry(lib, 10_000, 64, rope=False, fp8_kv=True)
    lib.decode_shallow = False
    assert not decode_attention.shallow_entry(lib, 10_000, 64, rope=False, fp8_kv=False)
    # (16 + 2 stages x 64 rows) x (64 + 8) x 2 bytes, against 3 stages by default
    assert decode_attention.smem_bytes(64, shallow=True) == 272 * 72 * 2 < decode_attention.smem_bytes(64)
    assert decode_attention.smem_bytes(128, shallow=True) == decode_attention.smem_bytes(128)
    names = {spec.name for spec in MODULES["decode_attention"]}
    assert {"decode_attention_bf16_d64_s2", "decode_attention_fp16_d96_s2"} <= names
    assert "decode_attention_bf16_d128_s2" not in names


def test_prefill_work_items_hold_128_rows_up_to_head_dim_64_else_64():
    """The paged prefill attention's work list (engine.batch.prefill_work): an item per 128 query rows of a sequence
    up to head_dim 64 (kernels_cu/prefill_attention.cu: two m16 tiles a warp), per 64 above; each item (sequence,
    first query token, rows, position of the first row), a sequence's queries the last of its keys."""
    from engine.batch import prefill_rows, prefill_work, prefill_work_rows
    assert [prefill_rows(d) for d in (16, 32, 64, 80, 96, 128)] == [128, 128, 128, 64, 64, 64]
    # 300 fresh tokens; 1 token after 499 cached; 129 tokens after 71 cached
    qsl, seq_lens = [0, 300, 301, 430], [300, 500, 200]
    assert prefill_work(qsl, seq_lens, 64) == [(0, 0, 128, 0), (0, 128, 128, 128), (0, 256, 44, 256),
                                               (1, 300, 1, 499),
                                               (2, 301, 128, 71), (2, 429, 1, 199)]
    assert prefill_work(qsl, seq_lens, 128) == [(0, 0, 64, 0), (0, 64, 64, 64), (0, 128, 64, 128), (0, 192, 64, 192),
                                                (0, 256, 44, 256),
                                                (1, 300, 1, 499),
                                                (2, 301, 64, 71), (2, 365, 64, 135), (2, 429, 1, 199)]
    assert prefill_work(qsl, seq_lens, 32) == prefill_work(qsl, seq_lens, 64)
    assert prefill_work(qsl, seq_lens, 96) == prefill_work(qsl, seq_lens, 128)
    # a staged list's length: ceil(430 / rows) items over the tokens, one more per sequence
    assert prefill_work_rows(430, 3, 64) == 4 + 3 and prefill_work_rows(430, 3, 128) == 7 + 3


@pytest.mark.parametrize("head_dim", [64, 128])
def test_staged_prefill_work_list_has_the_models_items(head_dim):
    """A graphed prefill forward's staged work list (build_staged_prefill_batch): the items of the staging's head_dim,
    then empty rows up to prefill_work_rows of the padded shape."""
    import torch
    from engine.batch import PrefillStaging, build_staged_prefill_batch

    staging = PrefillStaging(256, 4, head_dim, torch.device("cpu"))
    assert staging.work.shape == ((2 if head_dim == 64 else 4) + 4, 4)
    table = torch.zeros((4, 16), dtype=torch.int32)
    # 150 fresh tokens and 5 tokens after 16 cached, padded to 256 tokens over 4 sequence rows
    _, _, make = build_staged_prefill_batch(staging, table, [list(range(1, 11)), [11, 12]], [0, 1], [0, 16],
                                            [list(range(150)), list(range(5))], [[149], [4]], 16, 256, 4, 256)
    if head_dim == 64:
        items = [[0, 0, 128, 0], [0, 128, 22, 128], [1, 150, 5, 16]] + [[0, 0, 0, 0]] * 3
    else:
        items = [[0, 0, 64, 0], [0, 64, 64, 64], [0, 128, 22, 128], [1, 150, 5, 16]] + [[0, 0, 0, 0]] * 4
    assert make().prefill_work.tolist() == items


def test_prefill_attention_shared_memory_holds_a_work_items_q_rows():
    """engine/cuda/wrappers/prefill_attention.py smem_bytes: a q tile of prefill_rows(head_dim) rows and two stages
    of 64-row K and V tiles, rows padded by 8 elements of 2 bytes (E4M3: one 16-bit K and V tile, two stages of
    E4M3 ones), as kernels_cu/prefill_attention.cu's launch contract states."""
    from engine.cuda.wrappers import prefill_attention as pa
    assert pa.smem_bytes(64) == (128 + 256) * 72 * 2 == 55296
    assert pa.smem_bytes(64, fp8_kv=True) == (128 + 128) * 72 * 2 + 4 * 64 * 64 == 53248
    assert pa.smem_bytes(16) == 18432 and pa.smem_bytes(32, fp8_kv=True) == 28672
    assert pa.smem_bytes(128) == (64 + 256) * 136 * 2 == 87040
    assert pa.smem_bytes(128, fp8_kv=True) == (64 + 128) * 136 * 2 + 4 * 64 * 128 == 84992


def test_prefill_key_split_rule():
    """Prefill attention's key splits (engine/cuda/wrappers/prefill_attention.py) on an H200's numbers: as many
    as one wave of blocks holds, at least MIN_SPLIT_TILES key tiles a split; none for short keys or a full grid."""
    from engine.cuda.library import KernelLibrary
    from engine.cuda.wrappers import prefill_attention as pa
    lib = KernelLibrary.__new__(KernelLibrary)  # no device: only the rule is under test
    lib.num_sms, lib.prefill_blocks_per_sm = 132, {(64, False): 4, (128, False): 2, (128, True): 1}
    # 128 new tokens (2 work items) over a 4k prefix, 32 heads: 64 blocks a split
    assert pa.key_splits(lib, 2, 32, 4096, 128) == 4  # 264 resident: 4 splits, one wave of 16-tile chains
    assert pa.key_splits(lib, 2, 32, 4096, 64) == 8   # 528 resident: 8 splits, one wave of 8-tile chains
    assert pa.key_splits(lib, 2, 32, 4096, 128, fp8_kv=True) == 2  # its own occupancy
    for work in (1, 2, 3, 8, 40, 600):
        for d, fp8 in lib.prefill_blocks_per_sm:
            resident = lib.prefill_blocks_per_sm[(d, fp8)] * lib.num_sms
            for kv in (64, 255, 1024, 4096, 32768, 1 << 20):
                s = pa.key_splits(lib, work, 32, kv, d, fp8)
                tiles = -(-kv // 64)
                assert 1 <= s <= pa.MAX_SPLITS and (s == 1 or tiles // s >= pa.MIN_SPLIT_TILES)
                assert s == 1 or work * 32 * s <= resident  # never a second wave
                if s < pa.MAX_SPLITS and tiles // (s + 1) >= pa.MIN_SPLIT_TILES:
                    assert work * 32 * (s + 1) > resident  # one more would not fit the wave
    assert pa.key_splits(lib, 600, 32, 32768, 64) == 1  # the grid fills the GPU already
    # a graphed forward's rounded-up key count splits as the eager one does once the keys are long
    assert pa.key_splits(lib, 2, 32, 4100, 64) == pa.key_splits(lib, 2, 32, 8192, 64)


def test_prefill_buckets_are_few_and_tight():
    from engine.cuda.ops import PREFILL_BUCKET, PREFILL_BUCKET_UNTIL, prefill_bucket
    sizes = [prefill_bucket(n) for n in range(1, 8193)]
    assert all(b >= n for n, b in zip(range(1, 8193), sizes))
    assert all(b - n < PREFILL_BUCKET for n, b in zip(range(1, PREFILL_BUCKET_UNTIL + 1), sizes))
    assert all(b - n < 4 * PREFILL_BUCKET for n, b in zip(range(1, 8193), sizes))
    assert len(set(sizes)) <= PREFILL_BUCKET_UNTIL // PREFILL_BUCKET + (8192 - PREFILL_BUCKET_UNTIL) // (4 * PREFILL_BUCKET)


def test_prefill_graph_reach_follows_the_model_size():
    """Prefill graphs reach 4096 tokens at 1B (a forward's linear layers: 2 x 0.97e9 parameters x 4096 = 8.0 TFLOP),
    2048 at Llama-3.2-3B (2 x 2.82e9 x 2048 = 11.5 TFLOP; 4096 would be 23), 1024 (the least) at 8B; a setting of
    METRALE_PREFILL_GRAPH_TOKENS wins."""
    from types import SimpleNamespace
    from engine.prefill import prefill_graph_tokens

    def llama(hidden, layers, heads, kv_heads, head_dim, inter):
        return SimpleNamespace(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                               head_dim=head_dim, intermediate_size=inter)
    one_b, three_b = llama(2048, 16, 32, 8, 64, 8192), llama(3072, 28, 24, 8, 128, 8192)
    eight_b, smollm = llama(4096, 32, 32, 8, 128, 14336), llama(576, 30, 9, 3, 64, 1536)
    assert [prefill_graph_tokens(mc, 0) for mc in (smollm, one_b, three_b, eight_b)] == [4096, 4096, 2048, 1024]
    assert prefill_graph_tokens(eight_b, 4096) == 4096 and prefill_graph_tokens(one_b, 512) == 512


def test_padded_prefill_forward_equals_the_unpadded_one(tiny_model):
    """Pad tokens (what CudaOps adds to reach a bucketed token count) change nothing: the same first
    tokens and log-probs, the same KV cache, the same tokens marked seen, the same decode after."""
    import torch

    from conftest import engine_config, random_prompts
    from engine.api import PrefillItem
    from engine.engine import Engine

    prompts = random_prompts([5, 17, 9], 512, seed=3)
    runs = []
    for pad in (0, 37):
        engine = Engine(engine_config(tiny_model))
        engine.runtime.ops.prefill_tokens = lambda n, pad=pad: n + pad
        greedy, stop = SamplingParams(), StoppingCriteria(max_new_tokens=6, ignore_eos=True)
        ids = [engine.alloc_sequence(40, greedy, stop).seq_id for _ in prompts]
        engine.prefill([PrefillItem(ids[0], prompts[0][:3], partial=True)])  # a chunk, then the rest
        first = engine.prefill([PrefillItem(ids[0], prompts[0][3:])] +
                               [PrefillItem(i, p) for i, p in zip(ids[1:], prompts[1:])]).tokens
        steps = [engine.decode(ids).tokens for _ in range(3)]
        runs.append(([(t.token_id, t.logprob) for t in first], [[t.token_id for t in s] for s in steps],
                     engine.runtime.kv.k[0].clone(), engine.runtime.kv.v[-1].clone(), engine.runtime.state.seen.clone()))
    (first0, steps0, k0, v0, seen0), (first1, steps1, k1, v1, seen1) = runs
    assert [t for t, _ in first0] == [t for t, _ in first1] and steps0 == steps1
    assert [lp for _, lp in first0] == pytest.approx([lp for _, lp in first1], abs=1e-4)
    assert torch.allclose(k0, k1, atol=1e-5) and torch.allclose(v0, v1, atol=1e-5)
    assert torch.equal(seen0, seen1)


def test_warm_up_prefill_runs_each_bucket_once_and_leaves_nothing_allocated(tiny_model):
    from conftest import engine_config
    from engine.engine import Engine

    engine = Engine(engine_config(tiny_model, max_seq_len=300, num_kv_blocks=64))
    assert warm_up_prefill(engine) == 0  # TorchOps: no per-shape costs, nothing to warm
    bucket = 64
    seen = []
    engine.runtime.ops.prefill_tokens = lambda n: -(-n // bucket) * bucket
    engine.runtime.ops.prefill_buckets = lambda limit: list(range(bucket, limit + bucket, bucket))
    forward = engine.runtime.model.forward
    engine.runtime.model.forward = lambda batch: (seen.append(batch.num_tokens), forward(batch))[1]
    free = engine.info().free_blocks
    assert warm_up_prefill(engine) == 5  # 64 .. 320 (the last one padded past max_seq_len - 1 = 299)
    assert seen == [64, 128, 192, 256, 320]
    info = engine.info()
    assert info.live_sequences == 0 and info.free_blocks == free
    small = Engine(engine_config(tiny_model, max_seq_len=300, num_kv_blocks=10))  # 160 tokens of KV
    small.runtime.ops.prefill_buckets = engine.runtime.ops.prefill_buckets
    assert warm_up_prefill(small) == 2  # 64 and 128 fit; 192 does not: it stops there


def test_warm_up_prefill_captures_every_prefill_graph_shape(tiny_model):
    """With CUDA graphs, warm-up also runs each padded size that replays graphs at 1, 2, 4 .. 16 sequence
    rows, so every prefill graph is captured before the first request, which then replays one."""
    from conftest import engine_config
    from engine.api import PrefillItem
    from engine.cuda.graphs import GraphCache
    from engine.engine import Engine
    from conftest import ExecBackend

    engine = Engine(engine_config(tiny_model, max_seq_len=300, num_kv_blocks=256))
    engine.runtime.dispatch.graphs = GraphCache(ExecBackend(), max_graphs=64, capture_after=2)
    engine.runtime.ops.prefill_tokens = lambda n: -(-n // 64) * 64
    engine.runtime.ops.prefill_buckets = lambda limit: list(range(64, limit + 64, 64))
    free = engine.info().free_blocks
    assert warm_up_prefill(engine) == 5 * 5  # sizes 64 .. 320, each at 1, 2, 4, 8 and 16 sequences
    s = engine.info().graph_cache
    assert s.captures == s.graphs_held == 25 and engine.info().free_blocks == free
    ids = [engine.alloc_sequence(80, SamplingParams(), StoppingCriteria(max_new_tokens=2)).seq_id for _ in range(3)]
    engine.prefill([PrefillItem(i, [5] * 40) for i in ids])  # 120 tokens, 3 sequences: shape (128, 4)
    assert engine.info().graph_cache.hits == s.hits + 1 and engine.info().graph_cache.captures == 25


def test_staged_prefill_batch_carries_fresh_prompts_starts():
    """A graphed forward of fresh prompts may attend on its own rows (engine/cuda/prefill_varlen.py): its batch then
    carries the sequence starts, padded sequence rows empty; other forwards carry none, and a chunk that continues
    a sequence cannot ask for them."""
    import torch
    from engine.batch import PrefillStaging, build_staged_prefill_batch

    staging = PrefillStaging(256, 8, 64, torch.device("cpu"))
    table = torch.zeros((4, 16), dtype=torch.int32)

    def batch(starts, lengths, varlen):
        tokens = [list(range(n)) for n in lengths]
        _, _, make = build_staged_prefill_batch(staging, table, [[1, 2], [3, 4]], [0, 1], starts, tokens,
                                                [[n - 1] for n in lengths], 16, 64, 4, 64, varlen)
        return make()

    assert batch([0, 0], [20, 5], True).cu_seqlens.tolist() == [0, 20, 25, 25, 25]
    assert batch([0, 0], [20, 5], False).cu_seqlens is None
    with pytest.raises(ValueError, match="fresh prompts only"):
        batch([0, 16], [20, 5], True)


def test_the_varlen_route_takes_forwards_by_their_longest_prompt(monkeypatch):
    """engine/cuda/prefill_varlen.py's rule (no GPU needed): a graphed fresh forward attends through FlashAttention's
    varlen entry when its longest prompt has MIN_SEQ_TOKENS (2048) or more, unless a sliding window could cut its keys,
    the head_dim is one the entry does not take, METRALE_PREFILL_GRAPH_ATTENTION is "paged", or the entry has refused."""
    from engine import env
    from engine.cuda import prefill_varlen

    assert env.PREFILL_GRAPH_ATTENTION == "flash"  # the default
    takes = prefill_varlen.takes
    assert takes(2048, 0, 64) and takes(4096, 0, 128) and not takes(2047, 0, 64)
    assert takes(3000, 4096, 64) and not takes(3000, 2048, 64)  # a window shorter than the prompt cuts keys
    assert takes(2048, 0, 72) and not takes(2048, 0, 68) and not takes(2048, 0, 264)
    route = prefill_varlen.VarlenPrefill()
    assert route.takes(2048, 0, 64)
    route.refused = True
    assert not route.takes(4096, 0, 64)
    monkeypatch.setattr(env, "PREFILL_GRAPH_ATTENTION", "paged")
    assert not takes(4096, 0, 64)


def test_graphed_prefill_keys_say_whether_the_forward_attends_on_its_own_rows(tiny_model):
    """The backend's varlen_prefill decides per graphed forward of fresh prompts; chunks after a cached prefix or an
    earlier chunk never take it; the choice is part of the graph's key (a graph captures one attention route)."""
    from conftest import ExecBackend, engine_config
    from engine.api import PrefillItem
    from engine.cuda.graphs import GraphCache
    from engine.engine import Engine

    engine = Engine(engine_config(tiny_model, max_seq_len=300, num_kv_blocks=256))
    engine.runtime.dispatch.graphs = GraphCache(ExecBackend(), max_graphs=64, capture_after=2)
    engine.runtime.ops.prefill_tokens = lambda n: -(-n // 64) * 64
    engine.runtime.ops.varlen_prefill = lambda longest, window, head_dim: longest >= 100
    stop = StoppingCriteria(max_new_tokens=2)
    for r in range(2):  # a padded shape's graph is captured the second time it runs (other tokens: no cache hits)
        a, b, c = (engine.alloc_sequence(250, SamplingParams(), stop).seq_id for _ in range(3))
        engine.prefill([PrefillItem(a, [5 + r] * 100), PrefillItem(b, [7 + r] * 30, partial=True)])  # 192, fresh
        engine.prefill([PrefillItem(b, [9 + r] * 90)])  # a chunk after 30 tokens: 128, not fresh
        engine.prefill([PrefillItem(c, [11 + r] * 20)])  # 64 tokens: under the backend's size
        engine.release([a, b, c])
    assert set(engine.runtime.dispatch.graphs.keys()) == {("prefill", 192, 2, 192, True),
                                                          ("prefill", 128, 1, 128, False),
                                                          ("prefill", 64, 1, 64, False)}


def _prepare_stand_in(lib, slots, num_cached, last_token, block_table, temperature, top_k, top_p, seed, penalty,
                      seen, block_size, input_ids, positions, slot_mapping, seq_lens, tables, row_temperature,
                      row_top_k, row_top_p, row_seed, row_penalty, row_position, row_seen, drafts=None):
    """Stands in for decode_step.prepare (engine/cuda/wrappers/decode_step.py) on CPU tensors (the kernel's
    contract, kernels_cu/decode_step.cu, written in torch), so CudaOps' wiring around it runs without a GPU.
    The kernel itself is tested against TorchOps on the GPU (tests/gpu/test_kernels.py)."""
    import torch
    k = 0 if drafts is None else drafts.shape[1]
    for b, s in enumerate(slots.tolist()):
        for i in range(k + 1):
            r, p = b * (k + 1) + i, int(num_cached[s]) + i
            input_ids[r] = last_token[s] if i == 0 else drafts[b, i - 1]
            positions[r], seq_lens[r], row_position[r] = p, p + 1, p + 1
            slot_mapping[r] = int(block_table[s, p // block_size]) * block_size + p % block_size
            tables[r] = block_table[s]
            row_temperature[r], row_top_k[r], row_top_p[r] = temperature[s], top_k[s], top_p[s]
            row_seed[r], row_penalty[r] = seed[s], penalty[s]
            if penalty[s] == 1:
                continue  # the kernel copies seen rows of penalised rows only
            row_seen[r] = seen[s]
            if i:
                row_seen[r, drafts[b, :i]] = True
    assert input_ids.dtype == torch.int64 and seq_lens.dtype == torch.int32


@pytest.mark.parametrize("k", [0, 3])
def test_kernel_slot_io_matches_the_reference_wiring(k, monkeypatch):
    """KernelSlotIO.decode_inputs / verify_inputs hand decode_prepare's outputs to the ForwardBatch and the
    sampling rows field for field as SlotIO (torch ops) builds them (on CPU, decode_prepare stood in for)."""
    import torch

    from engine.cuda.wrappers import decode_step
    from engine.slot_io import KernelSlotIO, SlotIO
    from engine.state import SlotState

    S, MB, V, bs = 6, 4, 50, 4
    g = torch.Generator().manual_seed(k)
    state = SlotState(S, MB, V, torch.device("cpu"))
    state.num_cached.copy_(torch.randint(0, (MB - 1) * bs, (S,), generator=g, dtype=torch.int32))
    state.last_token.copy_(torch.randint(0, V, (S,), generator=g))
    state.block_table.copy_(torch.randint(1, 100, (S, MB), generator=g, dtype=torch.int32))
    state.temperature.copy_(torch.rand(S, generator=g))
    state.top_k.copy_(torch.randint(0, 9, (S,), generator=g))
    state.seed.copy_(torch.randint(0, 1 << 40, (S,), generator=g))
    state.seen.copy_(torch.rand(S, V, generator=g) < 0.2)
    state.repetition_penalty.copy_(torch.tensor([1.0, 1.3, 1.0, 0.8, 1.0, 1.0]))
    slots = torch.tensor([4, 1, 3])
    monkeypatch.setattr(decode_step, "prepare", _prepare_stand_in)
    kernels, reference = KernelSlotIO(state, bs, None), SlotIO(state, bs)
    if k:
        drafts = torch.randint(0, V, (3, k), generator=g)
        got, want = kernels.verify_inputs(slots, drafts), reference.verify_inputs(slots, drafts)
    else:
        lens = (state.num_cached[slots] + 1).tolist()
        got, want = kernels.decode_inputs(slots, lens, False), reference.decode_inputs(slots, lens, False)
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "logits_indices"):
        assert torch.equal(getattr(got[0], name), getattr(want[0], name)), name
    for name in ("is_decode", "logits_all_rows", "seq_lens_host", "query_start_loc"):
        assert getattr(got[0], name) == getattr(want[0], name), name
    for name in ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "position"):
        assert torch.equal(getattr(got[1], name), getattr(want[1], name)), name
    penalised = want[1].repetition_penalty != 1  # seen rows are defined there only (slots 1 and 3)
    assert penalised.sum() == 2 * (k + 1)
    assert torch.equal(got[1].seen[penalised], want[1].seen[penalised])


def test_start_row_writes_the_whole_row_and_set_blocks_extends_it():
    """A slot's block-table row after start_row is its blocks, then the scratch block 0 to the end, whatever an
    earlier sequence left there (longer or not); set_blocks appends after it; other slots' rows are untouched."""
    import torch

    from engine.state import SlotState

    state = SlotState(3, 6, 10, torch.device("cpu"))
    state.block_table.fill_(-7)
    state.start_row(1, [5, 9, 2, 8, 4])
    assert state.block_table[1].tolist() == [5, 9, 2, 8, 4, 0]
    state.start_row(1, [3])  # a shorter row in the same slot: the old tail is cleared
    assert state.block_table[1].tolist() == [3, 0, 0, 0, 0, 0]
    state.set_blocks(1, 1, [6, 7])
    assert state.block_table[1].tolist() == [3, 6, 7, 0, 0, 0]
    state.start_row(2, [])
    assert state.block_table[2].tolist() == [0] * 6
    assert state.block_table[0].tolist() == [-7] * 6


@pytest.mark.parametrize("length", [3, 64, 65, 4096])
@pytest.mark.parametrize("bad", [-1, 1000, 2**32, 2**40, -2**40])
def test_check_tokens_names_an_id_outside_the_vocabulary_at_any_length(length, bad):
    """Short lists are checked by min and max, long ones as a packed array: either way an id outside [0, vocab)
    anywhere in the list is refused with its value, and a list of ids inside it (the edges included) passes."""
    from engine.errors import InvalidArgument
    from engine.sequence import PACKED_CHECK_MIN, SequenceTable

    assert 3 < PACKED_CHECK_MIN < 4096
    table = SequenceTable(1000, 4)
    good = [(7 * i) % 1000 for i in range(length)]
    good[0], good[-1] = 0, 999
    table.check_tokens(good, "token_ids")
    for where in (0, length // 2, length - 1):
        ids = list(good)
        ids[where] = bad
        with pytest.raises(InvalidArgument, match=rf"token_ids: token ids \[{bad}\] are outside the vocabulary"):
            table.check_tokens(ids, "token_ids")


def test_the_torch_and_cuda_op_backends_have_one_interface():
    """CudaOps implements TorchOps' ops under the same names and signatures (the model calls either), and adds
    no public op of its own that the reference lacks."""
    import inspect

    from engine.cuda.ops import CudaOps
    from engine.ops.torch_ops import TorchOps

    def public(cls) -> dict:
        return {n: f for n, f in vars(cls).items() if callable(f) and not n.startswith("_") and n != "create"}

    reference, cuda = public(TorchOps), public(CudaOps)
    assert set(cuda) <= set(reference), f"CudaOps ops the reference lacks: {sorted(set(cuda) - set(reference))}"
    assert {"qkv_attention", "norm_qkv_rope", "linear_add", "norm_gate_up", "norm_logits", "sample"} <= set(cuda)
    for name, fn in cuda.items():
        want = [p.name for p in inspect.signature(reference[name]).parameters.values()]
        got = [p.name for p in inspect.signature(fn).parameters.values()]
        assert got[:len(want)] == want, f"CudaOps.{name}{got} vs TorchOps.{name}{want}"
        extra = inspect.signature(fn).parameters
        assert all(extra[p].default is not inspect.Parameter.empty for p in got[len(want):]), \
            f"CudaOps.{name} adds required parameters {got[len(want):]}"


def test_resource_exhausted_says_whether_waiting_would_help(tiny_model):
    """AllocSequence's refusals: no slot, or no KV blocks now for a reservation an idle cache holds, are `busy` (a
    Generate waits for room); a reservation larger than the whole cache is not, even while every slot is taken."""
    from conftest import engine_config
    from engine.engine import Engine

    engine = Engine(engine_config(tiny_model, max_slots=2, num_kv_blocks=9))  # 8 usable blocks of 16 tokens
    try:
        def alloc(tokens: int) -> int:
            return engine.alloc_sequence(tokens, SamplingParams(), StoppingCriteria()).seq_id

        first = alloc(100)  # 7 blocks
        with pytest.raises(ResourceExhausted, match="KV blocks") as e:
            alloc(48)  # 3 blocks: 1 is free, 8 would be
        assert e.value.busy
        alloc(16)
        with pytest.raises(ResourceExhausted, match="slots") as e:
            alloc(16)
        assert e.value.busy
        with pytest.raises(ResourceExhausted, match="KV blocks") as e:
            alloc(200)  # 13 blocks: more than the cache holds
        assert not e.value.busy
        engine.release([first])
        alloc(48)
    finally:
        engine.close()


@pytest.mark.parametrize("seed", range(6))
def test_staged_prefill_batch_equals_the_eager_batch(seed):
    """build_staged_prefill_batch (graphed forwards: a sequence at a time, cache slots from each sequence's block ids
    on the host) stages the same ids, positions, cache slots, token slots and logits rows as build_extend_batch (eager
    forwards: vectorized over tokens, cache slots through the device block table), for random chunks after random
    cached prefixes, block sizes and paddings; pad tokens get id 0, position 0 and no cache slot."""
    import random

    import torch
    from engine.batch import PrefillStaging, build_extend_batch, build_staged_prefill_batch

    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16, 64])
    num_slots, width = 6, 40
    table = torch.zeros((num_slots, width), dtype=torch.int32)
    free = list(range(1, num_slots * width + 1))
    rng.shuffle(free)
    staging = PrefillStaging(512, 8, 64, torch.device("cpu"))
    for _ in range(4):
        count = rng.randint(1, 4)
        slots = rng.sample(range(num_slots), count)
        block_ids, starts, tokens, rows = [], [], [], []
        for slot in slots:
            start = rng.randint(0, (width - 2) * bs // 2)
            n = rng.randint(1, min(100, width * bs - start - 1))
            ids = free[slot * width:(slot + 1) * width]  # the slot's blocks, in no order
            table[slot] = torch.tensor(ids, dtype=torch.int32)
            block_ids.append(ids[:-(-(start + n) // bs)])
            starts.append(start)
            tokens.append([rng.randrange(50000) for _ in range(n)])
            rows.append(sorted(rng.sample(range(n), rng.randint(0, min(n, 2)))))
        total = sum(map(len, tokens))
        num_tokens = total + rng.choice([0, 1, 37])
        eager = build_extend_batch(table, slots, starts, tokens, rows, bs, torch.device("cpu"), False,
                                   num_padded=num_tokens)
        tslots, ids, make = build_staged_prefill_batch(staging, table, block_ids, slots, starts, tokens, rows, bs,
                                                       num_tokens, 8)
        staged = make()
        assert staged.input_ids.tolist() == eager.input_ids.tolist()
        assert staged.positions.tolist() == eager.positions.tolist()
        assert staged.slot_mapping.tolist() == eager.slot_mapping.tolist()
        assert tslots.tolist() == eager.token_slots.tolist() and ids.tolist() == eager.input_ids[:total].tolist()
        num_rows = sum(map(len, rows))
        assert staged.logits_indices[:num_rows].tolist() == eager.logits_indices.tolist()
        assert staged.block_tables[:count].tolist() == table[slots].tolist()
