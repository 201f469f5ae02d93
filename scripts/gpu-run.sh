#!/bin/bash
# Runs on a GPU machine from the repo root, after `cargo xtask bundle` built .device/ here and
# it was copied there: the GPU tests, compute-sanitizer memcheck, racecheck and synccheck, and
# (with `bench`) the benches; with `serve`, only the serving benchmark (serve_bench against serve
# at Nano size, random weights made in memory; SERVE_BENCH_ARGS adds to serve_bench's). Logs go
# to $OUT (default: .device/out). To fit a time limit, choose: TESTS (suites, default all),
# SANITIZE (suites under the three tools, default all kernel suites; empty: none),
# SANITIZE_FILTER (test-name filter for them, default `gpu`), BENCHES (with `bench`).
# With `ab BASE NAME [FILTER]`: a bench of another tree beside this one's on the same machine,
# BASE (that tree's bench executable, e.g. built with `cargo bench --no-run --bench NAME` there)
# and .device/benches/NAME alternating ROUNDS times (default 3), each run with FILTER.
# With `anchors`: torch's attention, grouped GEMM and FP8 GEMM (cuBLASLt) beside which the attn,
# moe and gemv benches are read (scripts/anchors/: each checked against its float32 reference first, then timed);
# with MAMBA_SRC (a checkout of state-spaces/mamba) also mamba's Triton state update and gated
# norm, beside which the ssm and norm benches are read.
OUT=${OUT:-.device/out}; mkdir -p "$OUT"
set -o pipefail
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
if [ "$1" = ab ]; then
  for r in $(seq ${ROUNDS:-3}); do
    for exe in "$2" ".device/benches/$3"; do
      echo "=== round $r: $exe $4"
      "$exe" --bench ${4:+"$4"} 2>&1 | tee -a "$OUT/ab-$3.log"
    done
  done
  exit
fi
if [ "$1" = anchors ]; then
  for a in attn grouped fp8_gemm; do
    echo "=== anchor $a"
    python3 scripts/anchors/$a.py --check && python3 scripts/anchors/$a.py 2>&1 | tee $OUT/anchor-$a.log
  done
  if [ -n "$MAMBA_SRC" ]; then
    echo "=== anchor mamba"
    python3 scripts/anchors/mamba.py --mamba "$MAMBA_SRC" --check &&
      python3 scripts/anchors/mamba.py --mamba "$MAMBA_SRC" 2>&1 | tee $OUT/anchor-mamba.log
  fi
  exit
fi
if [ "$1" = serve ]; then
  PORT=${PORT:-8123}
  .device/bin/serve --synthetic model/assets/nano-30b-a3b.json --backend cuda --slots 64 --port $PORT 2> $OUT/serve.log &
  SERVE=$!
  for _ in $(seq 900); do grep -q "ready on" $OUT/serve.log && break; kill -0 $SERVE 2>/dev/null || break; sleep 1; done
  tail -3 $OUT/serve.log
  .device/bin/serve_bench --url http://127.0.0.1:$PORT $SERVE_BENCH_ARGS 2>&1 | tee $OUT/serve-bench.log
  status=$?
  kill $SERVE; wait $SERVE
  exit $status
fi
which ptxas compute-sanitizer; ptxas --version | tail -1
for t in ${TESTS-ptx gpu mma norm quant conv1d ssm ssd mamba sample sample_gpu gemm gemv grouped router moe act attn cuda fp8}; do
  echo "=== tests/$t"; .device/tests/$t --include-ignored --test-threads=1 --nocapture 2>&1 | tee $OUT/test-$t.log | grep -E "compared|test result|panicked|FAILED|GPU:|ptxas|max relative"
done
# The sanitizers run every kernel suite's GPU tests except the long sequential ones (100
# decode steps, the token-by-token scan), which add time but no kernel the others do not run.
# racecheck also reports hazards inside cuBLASLt's own kernels (nvjet_*; tests/moe runs the
# cuBLASLt expert path): read its log for kernels of ours (names in kernels-gpu/src/kernel.rs).
for tool in memcheck racecheck synccheck; do
  for t in ${SANITIZE-mma norm quant conv1d ssm ssd mamba sample_gpu gemv grouped router moe act attn}; do
    echo "=== compute-sanitizer $tool tests/$t"
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 .device/tests/$t --include-ignored --test-threads=1 \
      --skip 100_steps --skip token_by_token ${SANITIZE_FILTER:-gpu} 2>&1 | tee $OUT/$tool-$t.log | tail -4
  done
done
if [ "$1" = bench ]; then
  for b in ${BENCHES:-norm quant conv1d ssm ssd attn moe gemv sample nano}; do echo "=== bench $b"; .device/benches/$b --bench 2>&1 | tee $OUT/bench-$b.log | grep -E "GPU|us \[|time:|thrpt:"; done
fi
