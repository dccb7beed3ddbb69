"""The benchmarks must not rot: bench/load.py runs on CPU with the tiny model, and a 60 s soak shows
no growth in memory or used KV blocks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def run_load(tmp_path, *args) -> dict:
    out = subprocess.run([sys.executable, "bench/load.py", "--shape", "tiny", "--prompt-len", "24", "--output-len",
                          "12", "--out", str(tmp_path), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    files = sorted(tmp_path.glob("load-*.json"))
    assert files, out.stdout
    return json.loads(files[-1].read_text())


def test_load_benchmark_runs_and_reports(tmp_path):
    res = run_load(tmp_path, "--concurrency", "1", "8", "--requests", "16", "--spec", "0", "--pipeline", "1", "3",
                   "--step-log")
    assert [(r["concurrency"], r["pipeline"]) for r in res["grpc"]] == [(1, 1), (1, 3), (8, 1), (8, 3)]
    refs = {r["concurrency"]: r for r in res["in_process"]}
    for grpc_level in res["grpc"]:
        ref = refs[grpc_level["concurrency"]]
        # The same requests, the same token count, whether one or two Decode calls are in flight.
        assert grpc_level["output_tokens"] == ref["output_tokens"] > 0
        if grpc_level["pipeline"] == 1:  # one call at a time: its wall time exceeds the worker's forward time
            assert grpc_level["rpc_overhead_p50_us"] > 0
        assert grpc_level["tokens_per_s"] > 0 and grpc_level["ttft_p50_ms"] > 0 and grpc_level["itl_p99_ms"] > 0
        assert grpc_level["out_of_order"] >= 0 and grpc_level["steps"] > 0
        # --step-log: the worker's and the router's stamps of each step follow one another on one clock.
        times = grpc_level["step_times"]
        assert times["counted"] > 0
        assert all(v is not None and v >= 0 for v in times["median_us"].values()), times
    for raw in res["raw_grpc"]:
        assert raw["steps"] and all(len(step) == 14 for step in raw["steps"])
    for png in res["plots"]:
        assert (tmp_path / png.split("/")[-1]).stat().st_size > 1000


def test_load_benchmark_decode_stream(tmp_path):
    """--decode call stream: each level runs once per transport; over a DecodeStream the router gets
    every token the in-process run makes, its steps answered in order."""
    res = run_load(tmp_path, "--concurrency", "4", "--requests", "12", "--pipeline", "1", "3", "--decode", "call",
                   "stream", "--no-plots", "--step-log")
    assert [(r["pipeline"], r["decode"]) for r in res["grpc"]] == [(1, "call"), (1, "stream"), (3, "call"),
                                                                   (3, "stream")]
    for level in res["grpc"]:
        assert level["output_tokens"] == res["in_process"][0]["output_tokens"] > 0 and level["steps"] > 0
        if level["decode"] == "stream":
            assert level["out_of_order"] == 0
        # --step-log: the worker's stamps come with each answer on a stream as with each call.
        times = level["step_times"]
        assert times["counted"] > 0 and all(v is not None and v >= 0 for v in times["median_us"].values()), times


def test_load_benchmark_with_speculative_verify(tmp_path):
    res = run_load(tmp_path, "--concurrency", "4", "--requests", "8", "--spec", "3", "--no-plots")
    assert res["grpc"][0]["draft_acceptance"] is not None
    assert res["grpc"][0]["output_tokens"] == res["in_process"][0]["output_tokens"]


def test_load_prefix_workloads_with_the_cache_on_and_off(tmp_path):
    """--prefix: both workloads on a worker with prefix caching and on one without, in one run. Every turn of a
    conversation resends its history (prompt token counts follow from the lengths alone); the cache's hits show
    in the worker's counters and in the Prefill replies alike, and only with caching on."""
    system, message, answer, turns, users, n = 32, 8, 8, 3, 2, 6
    res = run_load(tmp_path, "--prefix", "multiturn", "sysprompt", "--concurrency", str(users), "--turns", str(turns),
                   "--system-len", str(system), "--message-len", str(message), "--output-len", str(answer),
                   "--requests", str(n))
    settings = res["meta"]["prefix_caching"]
    assert settings["on"]["enabled"] is True and settings["off"]["enabled"] is False
    rows = {row["workload"]: row for row in res["prefix"]}
    assert [(r["workload"], r["concurrency"]) for r in res["prefix"]] == [("multiturn", users), ("sysprompt", users)]
    # Turn t's prompt: the system prompt, t messages and t - 1 answers.
    history = users * sum(system + t * message + (t - 1) * answer for t in range(1, turns + 1))
    expected = {"multiturn": (users * turns, history), "sysprompt": (n, n * (system + message))}
    for name, row in rows.items():
        on, off = row["on"], row["off"]
        requests, prompt_tokens = expected[name]
        for level in (on, off):
            assert level["requests"] == requests and level["output_tokens"] == requests * answer
            assert level["prompt_tokens"] == level["query_tokens"] == prompt_tokens
            assert level["tokens_per_s"] > 0 and 0 < level["ttft_p50_ms"] <= level["ttft_p99_ms"]
        assert on["hit_rate"] > 0 and on["hit_tokens"] == on["cached_prompt_tokens"] > 0
        assert off["hit_rate"] == 0 and off["hit_tokens"] == off["cached_prompt_tokens"] == 0
        assert row["ttft_p50_on_over_off"] == round(on["ttft_p50_ms"] / off["ttft_p50_ms"], 3)
    # Requests after the first Prefill call find the shared system prompt (two full 16-token blocks) cached.
    assert rows["sysprompt"]["on"]["hit_tokens"] >= (n - users) * system
    assert len(rows["multiturn"]["on"]["ttft_p50_ms_by_turn"]) == turns


def test_load_gateway_direct_and_through_smg(tmp_path):
    """--gateway: the same requests straight over gRPC and through the real smg in front of the same worker
    (a word tokenizer written into the benchmark's checkpoint); both paths generate as many tokens."""
    res = run_load(tmp_path, "--gateway", "--concurrency", "3", "--requests", "9", "--gateway-rounds", "3")
    assert res["meta"]["smg"]["version"] == "1.13.0"
    [row] = res["gateway"]
    # three rounds, direct and gateway alternating: the row is the round of median ratio
    assert len(row["round_ratios"]) == 3 and all(r > 0 for r in row["round_ratios"])
    assert row["median_ratio"] == sorted(row["round_ratios"])[1] == row["gateway_over_direct"]["tokens_per_s"]
    direct, gateway = row["direct"], row["gateway"]
    assert direct["requests"] == gateway["requests"] == row["requests"] == 9
    assert direct["output_tokens"] == gateway["output_tokens"] > 9
    assert direct["prompt_tokens"] == gateway["prompt_tokens"] > 0 and gateway["prompt_token_mismatches"] == 0
    # one SSE event per word, or per several where the worker's handler fell behind (gateway_stream._with_queued)
    assert gateway["requests"] <= gateway["token_events"] <= gateway["output_tokens"]
    for level in (direct, gateway):
        assert level["tokens_per_s"] > 0 and level["ttft_p50_ms"] > 0 and level["itl_p50_ms"] > 0
        assert level["itl_p50_ms"] <= level["itl_p99_ms"] and 0 < level["tpot_p50_ms"] <= level["tpot_p99_ms"]
    assert row["gateway_over_direct"]["tokens_per_s"] == round(gateway["tokens_per_s"] / direct["tokens_per_s"], 3)


def test_load_refuses_what_its_modes_cannot_do(tmp_path):
    """One line and exit status 2, before any worker starts."""
    from engine.checkpoint import write_checkpoint

    bare = write_checkpoint(tmp_path / "no-tokenizer", arch="llama", shape="tiny")
    cases = {("--prefix", "multiturn", "--target", "127.0.0.1:1"): "cannot use --target",
             ("--prefix", "sysprompt", "--engine-flags=--max-slots 8 --no-prefix-caching"):
                 "leave --no-prefix-caching out",
             ("--gateway", "--model", str(bare)): "has no tokenizer.json",
             ("--gateway", "--gateway-rounds", "0"): "--gateway-rounds must be >= 1"}
    for args, words in cases.items():
        out = subprocess.run([sys.executable, "bench/load.py", *args, "--out", str(tmp_path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr[-2000:])
        assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_soak_60s_no_growth(tmp_path):
    res = run_load(tmp_path, "--soak", "60", "--no-in-process")["soak"]
    start, end = res["start"], res["end"]
    assert end["free_blocks"] == start["free_blocks"] and end["live_sequences"] == 0
    assert res["level"]["output_tokens"] > 1000
    # Memory: the worker's RSS after the soak within 5% (+16 MB allocator slack) of its RSS after warm-up.
    assert end["rss_mb"] <= start["rss_mb"] * 1.05 + 16, res["rss_samples"]


def test_pipeline_floor_runs(tmp_path):
    """bench/pipeline_floor.py (the stand-in worker with no engine) over a real socket: one line per GIL load."""
    out = subprocess.run([sys.executable, "bench/pipeline_floor.py", "--steps", "60", "--gil-us", "0", "200",
                          "--step-us", "800", "--decode", "call", "stream"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["gil_us"], r["decode"]) for r in lines] == [(0, "call"), (0, "stream"), (200, "call"), (200, "stream")]
    for r in lines:
        assert r["steps"] == 60 and r["overhead_p50_us"] <= r["overhead_p90_us"] <= r["overhead_p99_us"]


def test_engine_benchmark_quick_runs(tmp_path):
    """bench/engine_bench.py --quick on CPU: every mode runs and reports (the GPU figures come from the same
    code), including Verify measured between decode steps of its own sequence."""
    out = subprocess.run([sys.executable, "bench/engine_bench.py", "--shape", "tiny", "--quick", "--no-hf",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    files = sorted(tmp_path.glob("engine-tiny-*.json"))
    assert files, out.stdout
    ours = json.loads(files[-1].read_text())["engine"]
    for key in ("prefill_1x64", "decode_b1", "decode_queued_b1", "decode_steady_b4", "decode_churn_b4", "verify4_b1"):
        assert "error" not in ours[key], (key, ours[key])
    v = ours["verify4_b1"]
    assert v["step_ms"] > 0 and v["decode_step_ms"] > 0
    assert v["ratio"] == pytest.approx(v["step_ms"] / v["decode_step_ms"])
    assert ours["decode_b1"]["step_ms"] > 0 and 0.0 <= ours["decode_churn_b4"]["graph_hit_rate"] <= 1.0
    assert "verify 4 drafts b1" in out.stdout
    q = ours["decode_queued_b1"]  # where a queued step's interval goes: waiting for the device, or launching
    assert q["interval_ms_median"] > 0 and 0 <= q["finish_ms_median"] and 0 < q["launch_ms_median"]


@pytest.mark.parametrize("scheme", ["dynamic", "none"])
def test_scale_benchmark_passes_the_fp8_activation_scheme(tmp_path, scheme):
    """--quantization fp8 --fp8-activation-scheme reaches the engine: the JSON's shape meta says which ran."""
    out = subprocess.run([sys.executable, "bench/scale_bench.py", "--quick", "--quantization", "fp8",
                          "--fp8-activation-scheme", scheme, "--batches", "1", "--contexts", "64", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    [path] = tmp_path.glob("scale-tiny-*.json")
    meta = json.loads(path.read_text())["shapes"]["tiny"]["meta"]
    assert (meta["quantization"], meta["fp8_activation_scheme"]) == ("fp8", scheme)


def test_scale_benchmark_quick_runs(tmp_path):
    """bench/scale_bench.py --quick on CPU: every point that fits has a step time, a floor and a share; one whose
    KV cannot fit in the (forced small) KV cache is reported skipped; the prefills have their FLOPs floor; the
    point of lowest share is profiled; the plot is written."""
    out = subprocess.run([sys.executable, "bench/scale_bench.py", "--quick", "--kv-memory-gib", "0.0005", "--profile",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    files = sorted(tmp_path.glob("scale-tiny-*.json"))
    assert files, out.stdout
    res = json.loads(files[-1].read_text())
    tiny = res["shapes"]["tiny"]
    points = {(p["batch"], p["context"]): p for p in tiny["points"]}
    assert set(points) == {(1, 64), (4, 64), (1, 256), (4, 256)}
    # 0.0005 GiB of fp32 KV is 64 blocks of 16 tokens (8 KiB each): four sequences of 256 tokens need 64 and more.
    skipped = points.pop((4, 256))
    assert "step_ms" not in skipped and skipped["kv_gib"] > skipped["free_gib"] > 0
    assert f"skipped ({skipped['skipped']})" in out.stdout and "GiB free" in skipped["skipped"]
    for p in points.values():
        assert "error" not in p and "skipped" not in p, p
        assert p["step_ms"] > 0 and p["floor_ms"] > 0 and p["share"] > 0
        assert p["share"] == pytest.approx(p["floor_ms"] / p["step_ms"])
    # The floor's bytes: the KV read grows with the batch and the context; of the untied embedding table (512 x 64
    # fp32) a step reads only its batch's rows.
    assert points[(4, 64)]["kv_gb"] == pytest.approx(4 * points[(1, 64)]["kv_gb"])
    assert points[(1, 256)]["kv_gb"] > 3 * points[(1, 64)]["kv_gb"]
    assert (points[(4, 64)]["weight_gb"] - points[(1, 64)]["weight_gb"]) * 1e9 == pytest.approx(3 * 64 * 4)
    assert tiny["meta"]["weight_bytes"] - points[(1, 64)]["weight_gb"] * 1e9 == pytest.approx(511 * 64 * 4)
    # Prefill FLOPs of the tiny shape (hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 128, vocab 512): per
    # layer and token the linear layers' 2 x (64 x 128 + 64 x 64 + 3 x 64 x 128); per layer and prompt causal
    # attention's 4 x 64 x n(n + 1)/2; the LM head's 2 x 64 x 512 once a prompt.
    linear = 64 * 128 + 64 * 64 + 3 * 64 * 128
    for p in tiny["prefill"]:
        b, n = p["batch"], p["length"]
        flops = b * (2 * (2 * linear * n + 4 * 64 * n * (n + 1) / 2) + 2 * 64 * 512)
        assert p["tflop"] * 1e12 == pytest.approx(flops)
        assert p["tokens_per_s"] > 0 and p["floor_tokens_per_s"] > 0 and p["share"] > 0
    [prof] = tiny["profiles"]
    worst = min(points.values(), key=lambda p: p["share"])
    assert (prof["batch"], prof["context"]) == (worst["batch"], worst["context"])
    assert prof["kernels"] and prof["device_us_per_step"] > 0
    assert (tmp_path / res["plot"]).stat().st_size > 1000


def test_queued_layout_benchmark_runs():
    """bench/queued_layout.py on CPU: the five layouts, each where the script puts it (slots and KV blocks)."""
    out = subprocess.run([sys.executable, "bench/queued_layout.py", "--shape", "tiny", "--batch", "4", "--steps", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["phase"] for r in rows] == ["first slots, first blocks", "high slots, low blocks", "low slots, high blocks",
                                          "high slots, high blocks", "first slots again"]
    assert rows[0]["layout"]["slots"] == [0, 3] and rows[1]["layout"]["slots"][0] >= 96
    assert rows[2]["layout"]["blocks"][0] > 2560 and rows[3]["layout"]["slots"][0] >= 96
    assert all(r["queued_ms"] > 0 and r["device_ms"] > 0 for r in rows)


def test_trace_step_cuts_records_into_launches_and_steps():
    """bench/trace_step.py's analysis on synthetic records: blocks of one launch are consecutive in the order their
    waits returned; launches are cut by grid size (or a full grid), a step by the repeating launch pattern."""
    sys.path.insert(0, str(ROOT / "bench"))
    import numpy as np
    import trace_step as ts

    pattern = [(8, 256), (3, 128), (4, 512), (4, 512), (2, 32)]  # two launches of one size back to back: cut by count
    recs, t = [], 0
    for _ in range(5):
        for grid, threads in pattern:
            for b in range(grid):
                recs.append((t + 100, t + 1000 + b, t + 1800 + b, 0, 0, 0, grid, threads, 0, b, (0, 0, 0, 0)))
            t += 2000
    rec = np.array(recs, dtype=ts.RECORD)
    launches = ts.launches(rec)
    assert [x["sig"] for x in launches[:5]] == pattern and len(launches) == 25
    assert all(x["blocks"] == x["sig"][0] for x in launches)
    assert launches[2]["release"] == 5000 and launches[2]["last_release"] == 5003 and launches[2]["end"] == 5803
    assert ts.find_period(launches) == len(pattern)
    steps = ts.steps_of(launches, len(pattern))
    text = ts.describe(steps)
    assert "median 10.0 us over 4 steps; 5 launches a step" in text  # 5 launches of 2 us each


def test_issue_floors_quick_runs(tmp_path):
    """bench/issue_floors.py --quick on CPU: every floor row gets its figure from the engines it names (the tiny
    shape standing in, so no row claims a floor met), ratios are the quotients of their two figures, --issues
    keeps only those rows, and a checkpoint directory without config.json is refused in one line, exit 2."""
    out = subprocess.run([sys.executable, "bench/issue_floors.py", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [path] = tmp_path.glob("floors-*.json")
    res = json.loads(path.read_text())
    rows, values = res["rows"], res["measurements"]
    assert {r["issue"] for r in rows} == {40, 42, 43} and len(rows) == 21
    assert not res["meta"]["errors"], res["meta"]["errors"]
    engines = res["meta"]["engines"]  # the engine each setup names, as it loaded
    assert engines["1b FP8 FP8-head"]["quantized_lm_head"] and not engines["1b FP8"]["quantized_lm_head"]
    assert engines["8b FP8 FP8-KV"]["quantization"] == "fp8" and engines["8b"]["quantization"] == "none"
    for r in rows:
        assert r["value"] is not None and r["value"] > 0 and r["met"] is None, r
        if r["measurement"].startswith("ratio ("):
            a, b = r["measurement"][len("ratio ("):-1].split(") / (")
            assert r["value"] == pytest.approx(values[a] / values[b])
        else:
            assert r["value"] == values[r["measurement"]]
    assert "step 8b FP8 FP8-KV b2 c128" in values and "ttft 1b" in values and "prefill 1b 2x32" in values
    assert "no floor applies" in out.stdout

    only = subprocess.run([sys.executable, "bench/issue_floors.py", "--quick", "--issues", "40", "--out",
                           str(tmp_path / "only")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert only.returncode == 0, only.stderr[-3000:]
    [path] = (tmp_path / "only").glob("floors-*.json")
    assert [r["issue"] for r in json.loads(path.read_text())["rows"]] == [40, 40]

    bad = subprocess.run([sys.executable, "bench/issue_floors.py", "--model-1b", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no config.json there" in bad.stderr and "Traceback" not in bad.stderr


def test_warm_up_cost_reports_the_setting_it_ran_under(tmp_path):
    """bench/warm_up_cost.py on CPU (no graphs there): the setting of METRALE_PREFILL_GRAPH_TOKENS it ran under, the
    warm-up's figures and each prefill shape's row; a directory without config.json is refused in one line, exit 2."""
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "worker", "make-model", str(model), "--shape", "tiny", "--device", "cpu"],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    env = {**os.environ, "METRALE_PREFILL_GRAPH_TOKENS": "2048"}
    out = subprocess.run([sys.executable, "bench/warm_up_cost.py", "--model", str(model), "--max-seq-len", "512",
                          "--prefill", "2x64", "1x96", "--repeats", "1", "--out", str(tmp_path / "out")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["prefill_graph_tokens"] == 2048 and res["device"] == "cpu" and res["graphs_held"] == 0
    assert [(r["batch"], r["length"]) for r in res["prefill"]] == [(2, 64), (1, 96)]
    assert all(r["tokens_per_s"] > 0 for r in res["prefill"]) and res["warm_up_s"] >= 0
    assert len(list((tmp_path / "out").glob("warm-up-cost-2048-*.json"))) == 1
    bad = subprocess.run([sys.executable, "bench/warm_up_cost.py", "--model", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [f"warm_up_cost: no config.json in {tmp_path}"]


def test_commit_host_cost_times_the_registration_of_the_blocks_decode_filled(tmp_path):
    """bench/commit_host_cost.py on CPU: 8 sequences of 8-token prompts and 40 decode steps hold final KV at positions
    0-47, three full 16-token blocks each (the prompt filled none), all registered by the cache; a directory without
    config.json is refused in one line, exit 2."""
    out = subprocess.run([sys.executable, "bench/commit_host_cost.py", "--batch", "8", "--steps", "40"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert (res["batch"], res["steps"], res["block_size"], res["blocks_filled"]) == (8, 40, 16, 24)
    assert res["blocks_registered"] == 24  # the cache's own count
    assert res["register_ms_max"] >= res["register_ms_median"] > 0 and res["register_us_per_block"] > 0
    assert res["commit_ms_max"] >= res["commit_ms_median"] > 0
    bad = subprocess.run([sys.executable, "bench/commit_host_cost.py", "--model", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"commit_host_cost: no config.json in {tmp_path}"]
