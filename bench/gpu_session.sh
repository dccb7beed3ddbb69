#!/usr/bin/env bash
# One call on the GPU machine (the device tool): build the kernels, then run the named stages.
#   bash bench/gpu_session.sh tests bench1b load1b bench8b
# Stages write logs and result JSON under $OUT (bench/results/ here when OUT is unset). Needs the
# generated stubs (metrale/, carried) and grpcio-reflection/health-checking wheels in .whl/ (carried) of the
# device's grpcio version (1.84: `pip download --no-deps grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0
# -d .whl`; newer ones refuse to import under it, and the worker with them).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/bench/results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  python3 -c "import grpc_health.v1.health_pb2_grpc, grpc_reflection.v1alpha.reflection" \
    || echo "gpu_session: the wheels in .whl/ do not import under this grpcio (the worker will not start)"
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, transformers, grpc, google.protobuf as p; print('torch', torch.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', p.__version__)"
t0=$(date +%s)
python3 -m engine.cuda.build 2>&1 | tail -3
echo "build: $(( $(date +%s) - t0 ))s"

stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-30}" "$OUT/$name.log"
  echo "== $name rc=$rc in $(( $(date +%s) - s ))s"
}

base_tree() {  # base_tree [DIR] (default build/ab-base) ready to run: this tree's stubs, and this tree's
  # fatbins where it has none, so that only the kernels whose sources differ are rebuilt there (build.py's stamps)
  local dir=${1:-build/ab-base}
  ln -sfn "$PWD/metrale" "$dir/metrale"
  mkdir -p "$dir/kernels_cu/build" && cp -rn kernels_cu/build/. "$dir/kernels_cu/build/"
  (cd "$dir" && python3 -m engine.cuda.build 2>&1 | tail -1)
}

ab_rounds() {  # ab_rounds "TREES" "BATCHES": engine_bench 1B (--no-hf) in each tree and then this one, REPS (3)
  # rounds; a tree's JSONs go to $OUT/<its folder name>, this tree's to $OUT (bench/ab_summary.py reads both).
  # AB_VARIANTS="NAME:FLAGS;NAME:FLAGS" adds runs of this tree with engine_bench FLAGS to each round, their JSONs
  # under $OUT/NAME (e.g. AB_VARIANTS="off:--skinny-wide-tiles 0": a switch measured in the same rounds)
  local trees=$1 batches=$2 dir rep variant
  local -a variants=()
  [ -n "${AB_VARIANTS:-}" ] && IFS=';' read -ra variants <<< "$AB_VARIANTS"
  for dir in $trees; do base_tree "$dir"; mkdir -p "$OUT/$(basename "$dir")"; done
  for variant in "${variants[@]}"; do mkdir -p "$OUT/${variant%%:*}"; done
  for rep in $(seq 1 ${REPS:-3}); do
    for dir in $trees; do
      (cd "$dir" && PYTHONPATH=/tmp/site:$PWD stage engine-bench-1b-$(basename "$dir")-rep$rep 240 python3 bench/engine_bench.py --shape 1b --no-hf --batches $batches --out "$OUT/$(basename "$dir")")
    done
    stage engine-bench-1b-new-rep$rep 240 python3 bench/engine_bench.py --shape 1b --no-hf --batches $batches --out "$OUT"
    for variant in "${variants[@]}"; do
      stage engine-bench-1b-${variant%%:*}-rep$rep 240 python3 bench/engine_bench.py --shape 1b --no-hf --batches $batches ${variant#*:} --out "$OUT/${variant%%:*}"
    done
  done
}

for what in "$@"; do
  case "$what" in
    tests)   stage gpu-tests 240 python3 -m pytest tests/gpu -m gpu -q -rA -p no:cacheprovider --confcutdir=tests/gpu -n 4 --durations=8 ;;
    kernels) stage gpu-kernel-tests 240 python3 -m pytest tests/gpu/test_kernels.py -m gpu -q -p no:cacheprovider ;;
    kskinny) stage gpu-skinny-tests 300 python3 -m pytest tests/gpu/test_skinny_linear.py -m gpu -q -x -p no:cacheprovider ;;
    kverify) stage gpu-kernel-verify-tests 120 python3 -m pytest tests/gpu/test_kernels.py -m gpu -q -x -p no:cacheprovider -k "verify or decode_prepare or decode_commit or decode_step" ;;
    ksampling) stage gpu-kernel-sampling-tests 120 python3 -m pytest tests/gpu/test_kernels.py -m gpu -q -x -p no:cacheprovider -k "sample or spec_accept or embedding or decode_prepare or decode_commit or verify" ;;
    # The sampling kernels alone at decode batches; with build/ab-base also the base tree's, in the same process
    bsample) stage bench-sample 120 python3 tests/gpu/bench_kernels.py --sample $( [ -d build/ab-base ] && echo --variant build/ab-base/kernels_cu build/ab-base/kernels_cu/build ) ;;
    kdecode) stage gpu-kernel-decode-tests 120 python3 -m pytest tests/gpu/test_kernels.py -m gpu -q -x -p no:cacheprovider -k "decode or fused or replay" ;;
    graphtests) stage gpu-graph-tests 240 python3 -m pytest tests/gpu/test_engine_gpu.py -m gpu -q -rA -s -p no:cacheprovider -k "invalidated or churn or capture or pool or warm or cycling" ;;
    engine)  stage gpu-engine-tests 240 python3 -m pytest tests/gpu/test_engine_gpu.py -m gpu -q -x -s -p no:cacheprovider ;;
    bench1b) stage engine-bench-1b 420 python3 bench/engine_bench.py --shape 1b --out "$OUT" ;;
    bench8b) stage engine-bench-8b 420 python3 bench/engine_bench.py --shape 8b --batches 1 8 32 --steps 100 --no-hf-compile --out "$OUT" ;;
    load1b)  stage load-1b 540 python3 bench/load.py --shape 1b --concurrency 1 4 16 32 64 128 --pipeline 1 2 3 --prompt-len 128 --output-len 128 --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT" ;;
    # Batch 1 as a router sees it: C = 1 over gRPC, one to three Decodes in flight, calls and DecodeStream
    loadc1)  stage load-1b-c1 300 python3 bench/load.py --shape 1b --concurrency 1 --pipeline 1 2 3 --decode call stream --prompt-len 128 --output-len 128 --no-plots --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT" ;;
    load32)  stage load-1b-c32 420 python3 bench/load.py --shape 1b --concurrency 32 128 --pipeline 2 3 --prompt-len 128 --output-len 128 --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT" ;;
    load32p3) stage load-1b-c32-p3 300 python3 bench/load.py --shape 1b --concurrency 32 --pipeline 3 --prompt-len 128 --output-len 128 --no-plots --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT" ;;
    # Where each step's time goes (the worker's x-step-times trailer and the router's stamps), C = 32
    loadtimes) stage load-1b-step-times 300 python3 bench/load.py --shape 1b --concurrency 32 --pipeline 2 3 --prompt-len 128 --output-len 128 --no-plots --step-log --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT" ;;
    # What Python gRPC alone costs in the same pattern: a stand-in worker with no engine (bench/pipeline_floor.py)
    floor)   stage pipeline-floor 200 python3 bench/pipeline_floor.py --gil-us 0 150 300 --pipeline 3 --server aio sync ;;
    # A/B of the worker's queue depth: --max-steps-in-flight 2 (default) vs 3, router three and four in flight
    loaddepth) for d in 2 3; do stage load-1b-depth$d 300 python3 bench/load.py --shape 1b --concurrency 32 128 --pipeline 3 4 --prompt-len 128 --output-len 128 --no-plots --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048 --max-steps-in-flight $d" --out "$OUT"; done ;;
    loaddepthab) for rep in 1 2; do for d in 2 3; do stage load-1b-c32-depth$d-rep$rep 120 python3 bench/load.py --shape 1b --concurrency 32 --pipeline 3 --prompt-len 128 --output-len 128 --no-plots --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048 --max-steps-in-flight $d" --out "$OUT"; done; done ;;
    warmtest) stage gpu-warm-up-test 120 python3 -m pytest tests/gpu/test_engine_gpu.py -m gpu -q -p no:cacheprovider -k "warm" ;;
    load32128) stage load-1b-c32-c128-p3 240 python3 bench/load.py --shape 1b --concurrency 32 128 --pipeline 3 --prompt-len 128 --output-len 128 --no-plots --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT" ;;
    # A/B of the graph policy: slot-vector graphs only, captured at the second sighting (the default until 2026-12-01)
    loadold) stage load-1b-slot-graphs 420 python3 bench/load.py --shape 1b --concurrency 32 128 --pipeline 2 --prompt-len 128 --output-len 128 --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048 --no-fallback-graphs --capture-after 2" --out "$OUT" ;;
    # How far ahead the router keeps Decodes, and what the slow steps coincide with
    loaddeep) stage load-1b-deep 300 python3 bench/load.py --shape 1b --concurrency 32 --pipeline 3 4 --prompt-len 128 --output-len 128 --no-plots --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT" ;;
    # A/B of step overlap: each decode step waited for before the next is launched (the default until 2026-12-01)
    loadsync) stage load-1b-one-in-flight 420 python3 bench/load.py --shape 1b --concurrency 32 128 --pipeline 2 3 --prompt-len 128 --output-len 128 --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048 --max-steps-in-flight 1" --out "$OUT" ;;
    # A/B against another tree (build/ab-base: `git archive <commit> | tar -x -C build/ab-base`, carried), same call:
    # engine_bench 1B at batch 1 and 32 twice, alternating, then 8B batch 1 once each
    # (the base tree builds its own kernels: their launch contracts may differ)
    abengine) if [ -d build/ab-base ]; then mkdir -p "$OUT/base"
        base_tree
        for rep in 1 2; do
          (cd build/ab-base && PYTHONPATH=/tmp/site:$PWD stage engine-bench-1b-base-rep$rep 240 python3 bench/engine_bench.py --shape 1b --no-hf --batches 1 32 --out "$OUT/base")
          stage engine-bench-1b-new-rep$rep 240 python3 bench/engine_bench.py --shape 1b --no-hf --batches 1 32 --out "$OUT"
        done
        (cd build/ab-base && PYTHONPATH=/tmp/site:$PWD stage engine-bench-8b-base 300 python3 bench/engine_bench.py --shape 8b --no-hf --batches 1 --out "$OUT/base")
        stage engine-bench-8b-new 300 python3 bench/engine_bench.py --shape 8b --no-hf --batches 1 --out "$OUT"
      else echo "abengine: no build/ab-base"; fi ;;
    # Several trees against this one (AB_TREES, e.g. "build/ab-base build/ab-v1": each made like build/ab-base),
    # 1B at the batches in AB_BATCHES (default 1 8), REPS (3) rounds of every tree in turn, this tree last
    abtrees) ab_rounds "${AB_TREES:-build/ab-base}" "${AB_BATCHES:-1 8}" ;;
    # The same against build/ab-base alone, at the batches in AB_BATCHES (default 1 32)
    abengine1b) if [ -d build/ab-base ]; then ab_rounds build/ab-base "${AB_BATCHES:-1 32}"
      else echo "abengine1b: no build/ab-base"; fi ;;
    # A/B of programmatic dependent launch in one tree (METRALE_PDL=0 / 1), alternating, off first: 1B at
    # the batches in AB_BATCHES (default 1 8 32) REPS (3) times, then (PDL8B=1) 8B batch 1 once each
    abpdl) for rep in $(seq 1 ${REPS:-3}); do for pdl in 0 1; do
          METRALE_PDL=$pdl stage engine-bench-1b-pdl$pdl-rep$rep 240 python3 bench/engine_bench.py --shape 1b --no-hf --batches ${AB_BATCHES:-1 8 32} --out "$OUT"
        done; done
        if [ "${PDL8B:-0}" = 1 ]; then for pdl in 0 1; do
          METRALE_PDL=$pdl stage engine-bench-8b-pdl$pdl 300 python3 bench/engine_bench.py --shape 8b --no-hf --batches 1 --out "$OUT"
        done; fi ;;
    # A/B of 16-warp skinny blocks for grids of <= SM-count tiles (1B o and down) vs 8-warp blocks everywhere
    # (with PDL, 8-warp blocks leave room on the SM for the next kernel's blocks): 1B batch 1, REPS (2) pairs
    abwide) for rep in $(seq 1 ${REPS:-2}); do for w in default 0; do
          stage engine-bench-1b-wide$w-rep$rep 120 python3 bench/engine_bench.py --shape 1b --no-hf --batches 1 --steps 200 $( [ $w = 0 ] && echo --skinny-wide-tiles 0 ) --out "$OUT"
        done; done ;;
    # The same against the worker: C = 32, the router three in flight, twice alternating
    abload) if [ -d build/ab-base ]; then mkdir -p "$OUT/base"
        base_tree
        for rep in 1 2; do
          (cd build/ab-base && PYTHONPATH=/tmp/site:$PWD stage load-1b-c32-base-rep$rep 150 python3 bench/load.py --shape 1b --concurrency 32 --pipeline 3 --prompt-len 128 --output-len 128 --no-plots --step-log --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT/base")
          stage load-1b-c32-new-rep$rep 150 python3 bench/load.py --shape 1b --concurrency 32 --pipeline 3 --prompt-len 128 --output-len 128 --no-plots --step-log --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT"
        done
      else echo "abload: no build/ab-base"; fi ;;
    # A/B of the worker's GIL switch interval (--gil-switch-interval-us; 0: Python's 5000 us), C = 32, three in flight
    abgil) for rep in 1 2; do for us in 0 200 1000; do
          stage load-1b-c32-gil$us-rep$rep 150 python3 bench/load.py --shape 1b --concurrency 32 --pipeline 3 --prompt-len 128 --output-len 128 --no-plots --step-log --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048 --gil-switch-interval-us $us" --out "$OUT"
        done; done ;;
    rpc) stage rpc-rtt 120 python3 bench/rpc_rtt.py ;;
    # Decode calls vs one DecodeStream, alternating in each level: 1B, C = 32, one and three in flight
    loadstream) stage load-1b-c32-stream 300 python3 bench/load.py --shape 1b --concurrency 32 --pipeline 1 3 --decode call stream --prompt-len 128 --output-len 128 --no-plots --step-log --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT" ;;
    # The same at C = 32 with three in flight, twice more (alternating call / stream inside each run)
    loadstreamab) for rep in 1 2; do stage load-1b-c32-stream-rep$rep 150 python3 bench/load.py --shape 1b --concurrency 32 --pipeline 3 --decode call stream --prompt-len 128 --output-len 128 --no-plots --step-log --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT"; done ;;
    # DecodeStream with the GIL switch interval at Python's default and at 200 us, twice alternating (C = 32, three in flight)
    abgilstream) for rep in 1 2; do for us in 0 200; do
          stage load-1b-c32-stream-gil$us-rep$rep 150 python3 bench/load.py --shape 1b --concurrency 32 --pipeline 3 --decode stream --prompt-len 128 --output-len 128 --no-plots --no-in-process --step-log --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048 --gil-switch-interval-us $us" --out "$OUT"
        done; done ;;
    # Decode calls and DecodeStream side by side over the concurrency sweep, three in flight (the README's second table)
    loadstreamsweep) stage load-1b-stream-sweep 540 python3 bench/load.py --shape 1b --concurrency 1 4 16 32 64 128 --pipeline 3 --decode call stream --prompt-len 128 --output-len 128 --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT" ;;
    # Calls vs stream at C = 64 and 128, three in flight, twice (the sweep's C = 128 went the other way)
    loadstreamhigh) for rep in 1 2; do stage load-1b-stream-high-rep$rep 200 python3 bench/load.py --shape 1b --concurrency 64 128 --pipeline 3 --decode call stream --prompt-len 128 --output-len 128 --no-plots --step-log --engine-flags "--num-kv-blocks 20000 --max-seq-len 2048" --out "$OUT"; done ;;
    floorstream) stage pipeline-floor-stream 200 python3 bench/pipeline_floor.py --gil-us 0 150 --pipeline 1 --decode call stream && stage pipeline-floor-stream-p3 200 python3 bench/pipeline_floor.py --gil-us 0 150 --pipeline 3 --decode call stream ;;
    # Launch-by-launch timeline of replayed queued decode steps from the kernels' own clocks (bench/trace_step.py;
    # carry kernels_cu/build-trace, built here by `python bench/trace_step.py --build-only`)
    trace)   TAIL=${TAIL:-80} stage trace-1b${TRACE_NAME:-} 240 python3 bench/trace_step.py --shape 1b --batch ${TRACE_BATCHES:-1 32} ${TRACE_ARGS:-} --json "$OUT/trace-1b${TRACE_NAME:-}.json" ;;
    trace512) TAIL=${TAIL:-80} stage trace-1b-max512 240 python3 bench/trace_step.py --shape 1b --batch 1 --max-seq-len 512 --json "$OUT/trace-1b-max512.json" ;;
    # Decode attention's split grid: the engine's context limit at engine_bench's 2576 (32 splits at batch 1) and
    # at 512 (8 splits), 1B batch 1, REPS (2) pairs alternating
    absplits) for rep in $(seq 1 ${REPS:-2}); do for m in 2576 512; do
          stage engine-bench-1b-max$m-rep$rep 120 python3 bench/engine_bench.py --shape 1b --no-hf --batches 1 --max-seq-len $m --out "$OUT"
        done; done ;;
    # Decode attention's key splits capped (engine_bench --decode-splits; default: up to 32 at 1B batch 1, clusters
    # of 8), 1B batch 1, REPS (2) rounds of: default, 4, 1
    absplitcap) for rep in $(seq 1 ${REPS:-2}); do for cap in default 4 1; do
          stage engine-bench-1b-splits$cap-rep$rep 120 python3 bench/engine_bench.py --shape 1b --no-hf --batches 1 $( [ $cap != default ] && echo --decode-splits $cap ) --out "$OUT"
        done; done ;;
    knorm)   stage gpu-kernel-norm-tests 120 python3 -m pytest tests/gpu/test_kernels.py -m gpu -q -x -p no:cacheprovider -k "norm or fused or rms" ;;
    profile) stage profile-1b 240 python3 bench/profile_step.py --shape 1b ;;
    profile8b) stage profile-8b 300 python3 bench/profile_step.py --shape 8b ;;
    ttft)    stage profile-ttft-1b 200 python3 bench/profile_step.py --shape 1b --only ttft ;;
    profdecode) stage profile-decode-1b 200 python3 bench/profile_step.py --shape 1b --only decode ;;
    replay)  stage profile-replay-1b 200 python3 bench/profile_step.py --shape 1b --only replay ;;
    replay8b) stage profile-replay-8b 300 python3 bench/profile_step.py --shape 8b --only replay ;;
    prefill8b) stage profile-prefill-8b 300 python3 bench/profile_step.py --shape 8b --only prefill ;;
    fused)   stage gpu-fused-tests 300 python3 -m pytest tests/gpu/test_skinny_linear.py tests/gpu/test_kernels.py -m gpu -q -x -p no:cacheprovider --confcutdir=tests/gpu -n 4 -k "skinny or fused or decode or replay" ;;
    kbench)  stage bench-kernels 200 python3 tests/gpu/bench_kernels.py ;;
    topk)    stage bench-topk 120 python3 tests/gpu/bench_kernels.py --topk ;;
    norm)    stage bench-norm 120 python3 tests/gpu/bench_kernels.py --norm ;;
    skinny)  stage bench-skinny 200 python3 tests/gpu/bench_kernels.py --skinny ;;
    # Nsight Compute on sample_stats (batch 32) and decode attention (1B batch 32, fused RoPE), keys from DRAM
    ncu)     stage ncu-sample-attention 200 ncu --clock-control none --target-processes all --kernel-name regex:"sample_stats|decode_attention" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats python3 tests/gpu/bench_kernels.py --ncu ;;
    attn)    stage bench-attention-splits 200 python3 tests/gpu/bench_kernels.py --attention ;;
    skinnytests) stage gpu-skinny-tests 240 python3 -m pytest tests/gpu/test_skinny_linear.py -m gpu -q -p no:cacheprovider --confcutdir=tests/gpu -n 4 ;;
    quick8b) stage engine-bench-8b-quick 300 python3 bench/engine_bench.py --shape 8b --no-hf --batches 1 --out "$OUT" ;;
    quick1b) stage engine-bench-1b-quick 300 python3 bench/engine_bench.py --shape 1b --no-hf --batches 1 8 32 --out "$OUT" ;;
    # racecheck leaves out cuDNN's kernels (torch's fused attention): it reports hazards inside them that are
    # not ours to fix; memcheck checks every kernel.
    sanitize) PYTORCH_NO_CUDA_MEMORY_CACHING=1 stage sanitize-memcheck 200 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py
              stage sanitize-racecheck 200 compute-sanitizer --tool racecheck --kernel-name-exclude kns=cudnn --report-api-errors no --error-exitcode 9 python3 tests/gpu/sanitize_kernels.py ;;
    *) echo "unknown stage $what" ;;
  esac
done
# The device tool brings back at most 8 files: PACK=1 leaves one tarball of everything instead.
if [ "${PACK:-0}" = 1 ]; then
  tar czf /tmp/session.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/session.tgz "$OUT/session.tgz"
fi
ls -la "$OUT"
