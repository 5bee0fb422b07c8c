#!/usr/bin/env bash
# GPU checks in one call: the gpu-marked tests, the engine demo on CUDA, then the benchmarks. Run from
# the repo root on a CUDA machine. Results are written under $OUT/results (default ./out/results) and
# packed into $OUT/results.tgz: device.txt, gpu_tests.log, model_gpu.txt, engine_gpu.txt, the engine
# demo log, and each benchmark's log, table (.md) and plot (.png).
# Arguments: "tests" or "bench" to run one half only; "e2e" runs `kdtree-engine bench e2e` alone (about
# 4 minutes: it does not fit beside the rest in one 600 s device call); "sglang" runs the SGLang drop-in's
# GPU tests against the port at .peers/sglang, then `kdtree-engine bench sglang` (its tree path);
# "sglang-verify" runs the attention kernel's GPU tests and those against SGLang's Triton extend kernel, then `kdtree-engine bench
# sglang` with both sections (the tree path at the verify-attention section's batches and budgets t - 1).
# "kimi" runs the GPU tests of the MoE kernels, of the row-invariant mode (GEMM, attention, model; issue 32)
# and of `bench kimi`, the row-invariant GEMM against cuBLAS (scripts/bench_linear.py, issue 32), then `kdtree-engine bench kimi` with its layer,
# drafter and tree sections (issue 34); "kimi-port" adds the port section (the SGLang port's tree
# path and verify attention; needs .peers/sglang) to the kimi_bench.json of an earlier "kimi" call, carried
# as out/kimi_bench.json (KIMI_JSON overrides). "flashmla" installs the FlashMLA wheel carried in .whl/ and runs
# bench attention against it on 64-row pages (issue 29). "tune-attention" runs the GPU tests of the kernels whose launches
# changed after the sm_90 compile audit (docs/notes/kernels.md), then scripts/tune_triton_attention.py.
# "invariant" runs kimi-nano's grid with the row-invariant mode and without it (issue 32; greedy outputs
# against AR and against each prompt decoded alone); "invariant-small" the mode's GPU tests, then the 2.5B
# shape's grid with the mode and without it.
# "small-forward" profiles the 2.5B shape's decode and verify forwards, times the router matmul's launch
# shapes and our projection GEMM against cuBLAS, then bench e2e on that shape at batch 1 (issue 27).
# "pdl" runs the GPU tests of the kernels launched with programmatic dependent launch, the model's and the
# engine's, then scripts/probe_pdl.py and the 2.5B forward's profiles with PDL and without (issue 27).
# "pdl-rest" runs the GPU tests of the kernels given PDL after the "pdl" call (drafter, tree, row-invariant,
# SGLang metadata), then the 2.5B bench at batch 1.
# "goals" runs the GPU suite and the engine demo ("tests"), then issue 27's rows: bench e2e at batch 1 on the
# 2.5B shape (budgets 32 and 64) and on kimi-nano (16 and 32), in one call (about 8 minutes).
# "ncu-verify" profiles the Hopper attention kernel alone with ncu at an h = 8 and an h = 64 point of the
# SGLang verify (pages of 1; scripts/probe_verify_misses.py --kernel-runs): tensor-pipe use, warp
# stalls, memory (issues 29 and 31).
# "ncu-flashmla" profiles our attention and FlashMLA with ncu at the same causal point (64-row pages; h = 8
# decode and h = 64, t = 9 at 32k, batch 16; NCU_POINTS "b,t,h,s ..."), then the Hopper kernel at issue 31's
# h = 8, t = 17 miss (NCU_MISS= empty skips it); carry .whl.
# "hopper-ab" runs the attention tests, then bench attention on the Hopper kernel's code against out/base/src
# (an earlier copy) on the same machine (issues 29 and 31); "probe-ab" the SGLang verify step's parts
# (scripts/probe_verify_misses.py) on both codes, with programmatic dependent launch and without (issue 31).
# "tree-bound" runs the attention kernels' GPU tests and the SGLang backend's against SGLang's extend kernel,
# then both targets' bench at batch 1, budget 32 (with out/base/src, an earlier copy, first: the baseline).
# "engine" runs the cache compaction's kernel tests and the engine's GPU tests, then the auto budget's kimi-nano grid (one call); "auto-overhead" the
# round report's kernel test and the engine's GPU tests, then scripts/auto_overhead.py (auto made to pick a
# fixed bucket against that budget: what auto's machinery costs apart from its choices).
# "traces" records kimi-nano's bf16 acceptance on the GPU for the policy simulator, then the nano grid (issue 28).
# "grid-host" the host's time per round inside the grid (scripts/probe_grid_host.py, issue 28); "grid-host-ab" the
# same on out/base/src (an earlier copy) and on this code, alternating.
# "auto" runs the auto budget's grid on kimi-nano (issue 28), auto call by call (scripts/auto_calls.py) and the host's steps per round with the timed call's timeline; "auto-same-text" its greedy grid in the row-invariant mode (every row on AR's text); "auto-small" the
# same grid on the 2.5B scaled-down Kimi shape (AUTO_BATCH and AUTO_TEMPS pick the batches and temperatures).
# A checkout of liranringel/ddtree at .peers/ddtree (git-ignored) adds the official builder to the tree
# benchmark, and an SGLang checkout (or just its python/sglang/srt/speculative/ddtree_utils.py) at
# .peers/sglang adds SGLang's builder.
set -uo pipefail
OUT=${OUT:-out}
R="$OUT/results"
mkdir -p "$R"
export OUT="$R" PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
what=${1:-all}
status=0
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  >"$R/device.txt" 2>&1
cat "$R/device.txt"
# Each step has a time limit (seconds, overridable); the defaults add up to 580 s, inside one 600 s device
# call (the CUDA demo's warm-up compiles the drafter and tree kernels first).
T_TESTS=${T_TESTS:-280} T_DEMO=${T_DEMO:-60} T_TREE=${T_TREE:-70} T_ATTN=${T_ATTN:-130} T_TOPK=${T_TOPK:-40}
# pytest-xdist, where installed, spreads the Triton compiles of the GPU sweep over the CPU cores.
xdist=()
python3 -c 'import xdist' 2>/dev/null && xdist=(-n 12)
# bench e2e on the 2.5B shape at batch 1, budgets 32 and 64 (issue 27's row; "small-forward", "pdl-rest")
bench_small_b1() {
  timeout "${T_E2E:-150}" python3 -m kdtree_engine bench e2e --target small --batch 1 --temperatures 0 \
    --budgets 32 64 --out "$R/small_b1" 2>&1 | tee "$R/bench_small_b1.log" | tail -30 || status=1
}
# FlashMLA, where its wheel is carried in .whl/: installed into /tmp/site, put on the path
flashmla_if_carried() {
  if ls .whl/sgl_flash_mla-*.whl >/dev/null 2>&1; then
    pip install -q --no-deps --target /tmp/site .whl/sgl_flash_mla-*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
}
if [ "$what" = sglang ]; then
  KDTREE_SGLANG_DDTREE=.peers/sglang timeout "${T_SGT:-200}" python3 -m pytest -q tests/integrations \
    -p no:cacheprovider "${xdist[@]}" -rs --durations=8 2>&1 | tee "$R/sglang_tests.log" | tail -30 || status=1
  timeout "${T_SGLANG:-330}" python3 -m kdtree_engine bench sglang --sections tree --batch 64 32 16 8 1 --iters 20 \
    --out "$R/sglang" 2>&1 | tee "$R/bench_sglang.log" | tail -40 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = sglang-verify ]; then
  # FlashMLA, where its wheel is carried in .whl/ (carry [".peers", ".whl"]): the cascade column on 64-slot pages
  flashmla_if_carried
  # the attention kernel's GPU tests first: the Hopper kernel now gathers SGLang's pages of one row
  timeout "${T_KT:-160}" python3 -m pytest -q tests/kernels/test_mla_attention.py tests/kernels/test_sglang_attention_metadata.py -p no:cacheprovider \
    "${xdist[@]}" -rs 2>&1 | tee "$R/attention_tests.log" | tail -20 || status=1
  KDTREE_SGLANG_DDTREE=.peers/sglang timeout "${T_SGT:-150}" python3 -m pytest -q -m gpu \
    tests/integrations/test_sglang_extend.py -p no:cacheprovider -rs 2>&1 | tee "$R/sglang_verify_tests.log" \
    | tail -30 || status=1
  # VERIFY_PAGES="1 64" adds SGLang's 64-slot pages (FlashMLA's) to the token pool: twice the points
  # shellcheck disable=SC2086
  timeout "${T_SGLANG:-420}" python3 -m kdtree_engine bench sglang --sections tree verify-attention \
    --verify-page-sizes ${VERIFY_PAGES:-1} --batch 1 16 64 --budgets 8 16 32 --out "$R/sglang_verify" 2>&1 | tee "$R/bench_sglang_verify.log" \
    | tail -60 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = kimi ]; then
  timeout "${T_KT:-120}" python3 -m pytest -q -m gpu tests/kernels/test_moe.py tests/kernels/test_linear.py \
    tests/kernels/test_mla_attention_invariant.py tests/model/test_row_invariance.py tests/bench/test_kimi.py \
    -p no:cacheprovider -rs 2>&1 | tee "$R/kimi_tests.log" | tail -20 || status=1
  timeout "${T_LIN:-60}" python3 scripts/bench_linear.py --rep-ms 30 2>&1 | tee "$R/bench_linear.log" | tail -60 \
    || status=1
  timeout "${T_KIMI:-400}" python3 -m kdtree_engine bench kimi --sections layer drafter tree --out "$R/kimi" 2>&1 \
    | tee "$R/bench_kimi.log" | tail -80 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = hopper-ab ]; then
  # a change to the Hopper attention kernel against the code before it (out/base/src: `git archive <base> src
  # | tar x -C out/base`, assets removed; carry out/base and .whl): the attention tests on the new code, then
  # bench attention on both, the issue 29 points on 64-row pages (with FlashMLA where its wheel is carried)
  # and issue 31's h = 8 points on pages of one row
  flashmla_if_carried
  timeout "${T_KT:-200}" python3 -m pytest -q tests/kernels/test_mla_attention.py -p no:cacheprovider "${xdist[@]}" \
    -rs 2>&1 | tee "$R/attention_tests.log" | tail -8 || status=1
  for side in base new; do
    src=src; [ "$side" = base ] && src=out/base/src
    PYTHONPATH=$src:/tmp/site timeout "${T_AB:-100}" python3 -m kdtree_engine bench attention --no-naive --rep 30 \
      --page-size 64 --heads ${AB_HEADS:-8 64} --tokens ${AB_TOKENS:-1 9 17 33} --seqlens ${AB_SEQ:-4096 32768} \
      --batch 16 --out "$R/ab64_$side" 2>&1 | tail -30 > "$R/ab64_$side.log" || status=1
    PYTHONPATH=$src timeout "${T_AB:-100}" python3 -m kdtree_engine bench attention --no-naive --no-flashmla --rep 30 \
      --page-size 1 --heads 8 --tokens 9 17 33 --seqlens 1024 4096 8192 --batch 16 --out "$R/ab1_$side" 2>&1 \
      | tail -30 > "$R/ab1_$side.log" || status=1
  done
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = probe-ab ]; then
  # issue 31's verify step, taken apart (scripts/probe_verify_misses.py) on an earlier copy of the code
  # (out/base/src: `git archive <base> src | tar x -C out/base`, assets removed) and on this one, each with
  # programmatic dependent launch and without (KDTREE_ENGINE_PDL=0); carry out/base and .peers. Its
  # merge_alone column against run - kernel tells a kernel's handoff to its merge from the merge itself.
  for pdl in 1 0; do
    for side in base new; do
      src=src; [ "$side" = base ] && src=out/base/src
      KDTREE_ENGINE_PDL=$pdl PYTHONPATH=$src KDTREE_SGLANG_DDTREE=.peers/sglang timeout "${T_PROBE:-90}" \
        python3 scripts/probe_verify_misses.py "$R/probe_${side}_pdl$pdl" \
        --points ${PROBE_POINTS:-8,9,1024,16 8,9,4096,16 64,33,1024,1} > "$R/probe_${side}_pdl$pdl.log" 2>&1 \
        || status=1
    done
  done
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = tune-attention ]; then
  # the GPU tests of the kernels whose launches changed with docs/notes/kernels.md (attention and its merge,
  # the drafter's attention, the row-invariant projection), then the Triton attention's launch shapes side
  # by side at decode (scripts/tune_triton_attention.py; issue 29)
  timeout "${T_KT:-150}" python3 -m pytest -q -m gpu tests/kernels/test_mla_attention.py \
    tests/kernels/test_mla_attention_merge.py tests/kernels/test_drafter_attention.py tests/kernels/test_linear.py \
    tests/drafter/test_kernel_path.py -p no:cacheprovider -rs 2>&1 | tee "$R/tune_tests.log" | tail -20 || status=1
  timeout "${T_TUNE:-240}" python3 scripts/tune_triton_attention.py 2>&1 | tee "$R/tune_triton_attention.log" \
    | tail -70 || status=1
  # the 64-row launch on SGLang's pages of 1 (tree verify), where the Hopper kernel cannot serve
  timeout "${T_TUNE_V:-160}" python3 scripts/tune_triton_attention.py --heads 8 64 --tokens 9 17 33 \
    --seqlens 4096 --batch 16 64 --page-sizes 1 --configs 64,32,8,5 32,64,8,5 --table tune_verify.md 2>&1 \
    | tee "$R/tune_triton_attention_verify.log" | tail -40 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = flashmla ]; then
  # issue 29: ours against FlashMLA (causal, and the cascade of FlashMLA over the prefix + our tree pass) on
  # paged caches of 64-row pages, the only pages FlashMLA reads; its wheel carried in .whl/ (carry [".whl"])
  pip install -q --no-deps --target /tmp/site .whl/sgl_flash_mla-*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
  python3 -c "import flash_mla; print('flash_mla', flash_mla.__version__)" || status=1
  timeout "${T_FMT:-90}" python3 -m pytest -q -m gpu tests/bench/test_flashmla_peer.py -p no:cacheprovider -rs 2>&1 \
    | tee "$R/flashmla_tests.log" | tail -8 || status=1
  timeout "${T_FMB:-480}" python3 -m kdtree_engine bench attention --heads 64 8 --tokens 1 9 33 \
    --seqlens 1024 8192 32768 --batch 1 16 --page-size 64 --no-naive --rep 30 --out "$R/attention_flashmla" 2>&1 \
    | tee "$R/bench_attention_flashmla.log" | tail -40 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = kimi-port ]; then
  timeout "${T_KIMI:-560}" python3 -m kdtree_engine bench kimi --sections port --into "${KIMI_JSON:-out/kimi_bench.json}" \
    --out "$R/kimi" 2>&1 | tee "$R/bench_kimi_port.log" | tail -80 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = invariant ]; then
  # issue 32 on kimi-nano: every greedy output of the grid (batch 1-64, DFlash, every budget, auto) against
  # autoregressive decoding at its batch and against its prompt decoded alone, with the row-invariant mode,
  # then the same grid without it in the same call (the mode's cost)
  for mode in --row-invariant ""; do
    name=nano${mode:+_invariant}
    timeout "${T_INV:-280}" python3 -m kdtree_engine bench e2e --target nano --batch 1 4 16 64 --temperatures 0 \
      --budgets 8 16 32 64 --prompts 8 --auto $mode --out "$R/$name" 2>&1 | tee "$R/bench_$name.log" | tail -30 \
      || status=1
  done
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = invariant-small ]; then
  # issue 32: the GPU tests of the mode (a request's tokens alone = in a batch of 64, eager = captured, on
  # kimi-nano and on the 2.5B shape without its successor margin; the model's tree nodes = their decoded
  # paths), then the 2.5B grid with the mode and without it (INV_BATCH, INV_TOKENS)
  timeout "${T_INV_TESTS:-200}" python3 -m pytest -q -m gpu tests/engine/test_gpu_row_invariance.py \
    tests/model/test_row_invariance.py -p no:cacheprovider -rs --durations=8 2>&1 | tee "$R/invariance_tests.log" \
    | tail -20 || status=1
  for mode in --row-invariant ""; do
    name=small${mode:+_invariant}
    # shellcheck disable=SC2086
    timeout "${T_INV_SMALL:-180}" python3 -m kdtree_engine bench e2e --target small --batch ${INV_BATCH:-1 4 16 64} \
      --temperatures 0 --budgets 8 16 32 64 --auto --new-tokens "${INV_TOKENS:-64}" $mode --out "$R/$name" 2>&1 \
      | tee "$R/bench_$name.log" | tail -30 || status=1
  done
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = auto ]; then
  # issue 28: the auto budget against AR, DFlash and every fixed budget on kimi-nano, batch 1-64,
  # temperature 0 and 1 (the static call's test, the 4-round drafter context, the batched commit), then
  # the host's steps per round inside real runs and the timed call's timeline (HOST_BATCH, HOST_BUDGETS, HOST_TEMP;
  # T_HOST=0 leaves that out); AUTO_PROMPTS held-out prompts (8; up to 32, so that each row's luck with its
  # bf16 texts averages over more of them), AUTO_TEMPS the temperatures (0 1)
  # shellcheck disable=SC2086
  timeout "${T_AUTO:-470}" python3 -m kdtree_engine bench e2e --target nano --batch 1 4 16 64 --temperatures ${AUTO_TEMPS:-0 1} \
    --budgets 8 16 32 64 --prompts "${AUTO_PROMPTS:-8}" --auto --out "$R/nano_auto" 2>&1 | tee "$R/bench_nano_auto.log" \
    | tail -40 || status=1
  python3 scripts/auto_calls.py "$R/nano_auto/e2e_nano.json" >"$R/auto_calls.log" 2>&1 || status=1
  [ "${T_HOST:-100}" = 0 ] || timeout "${T_HOST:-100}" python3 scripts/round_host_time.py --batch ${HOST_BATCH:-4 16} --budgets ${HOST_BUDGETS:-64 auto} \
    --temperature ${HOST_TEMP:-0} --timeline 2>&1 \
    | tee "$R/round_host_time.log" || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = grid-host ]; then
  # issue 28: the host's time per round inside bench e2e's grid itself (scripts/probe_grid_host.py), greedy,
  # batch 1 and 4 (GRID_BATCH), rows AR, DFlash, budget 32 and auto: is auto's round bound by the host?
  for b in ${GRID_BATCH:-1 4}; do
    timeout "${T_GRID:-100}" python3 scripts/probe_grid_host.py --batch "$b" --budgets 32 2>&1 \
      | tee -a "$R/grid_host.log" | tail -9 || status=1
  done
  exit $status
fi
if [ "$what" = grid-host-ab ]; then
  # issue 28: grid-host on an earlier copy of the code (out/base/src: `git archive <base> src | tar x -C
  # out/base`; its kimi-nano weights are copied in from src here, so they need not travel twice; carry
  # out/base) and on this one, alternating, batch 1 then 4 (GRID_BATCH): what a change to the policy's host
  # work per round does inside the grid
  for d in kimi-nano kimi-nano-dflash; do
    cp src/kdtree_engine/assets/$d/*.safetensors out/base/src/kdtree_engine/assets/$d/ || status=1
  done
  for b in ${GRID_BATCH:-1 4}; do
    for side in base new; do
      src=src; [ "$side" = base ] && src=out/base/src
      echo "== batch $b, $side" >>"$R/grid_host_ab.log"
      PYTHONPATH=$src timeout "${T_GRID:-95}" python3 scripts/probe_grid_host.py --batch "$b" --budgets 32 \
        >>"$R/grid_host_ab.log" 2>&1 || status=1
    done
  done
  tail -80 "$R/grid_host_ab.log"
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = auto-same-text ]; then
  # issue 28 on equal terms: the greedy grid with the row-invariant mode, where every row decodes
  # autoregressive decoding's text (in bf16 the default mode's rows part on different texts, which
  # accept differently), then auto call by call
  timeout "${T_SAME:-300}" python3 -m kdtree_engine bench e2e --target nano --batch 1 4 16 64 --temperatures 0 \
    --budgets 8 16 32 64 --prompts 8 --auto --row-invariant --out "$R/nano_same_text" 2>&1 \
    | tee "$R/bench_nano_same_text.log" | tail -40 || status=1
  python3 scripts/auto_calls.py "$R/nano_same_text/e2e_nano.json" >"$R/auto_calls_same_text.log" 2>&1 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = auto-overhead ]; then
  # issue 28: the round report's kernel against its reference, the engine's GPU tests, then auto made to
  # pick a fixed bucket against that budget (scripts/auto_overhead.py: the machinery's cost apart from
  # the choices) and auto itself, on kimi-nano at OVERHEAD_BATCH (default 1 4 16 64)
  timeout "${T_KT:-40}" python3 -m pytest -q tests/kernels/test_round_report.py -p no:cacheprovider 2>&1 \
    | tee "$R/round_report_tests.log" | tail -3 || status=1
  timeout "${T_ENG:-170}" python3 -m pytest -q -m gpu tests/engine -p no:cacheprovider -rs --durations=5 2>&1 \
    | tee "$R/engine_tests.log" | tail -20 || status=1
  # shellcheck disable=SC2086
  timeout "${T_OVER:-330}" python3 scripts/auto_overhead.py --batch ${OVERHEAD_BATCH:-1 4 16 64} --budgets 16 32 \
    --calls 5 2>&1 | tee "$R/auto_overhead.log" | tail -40 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = small-forward ]; then
  # issue 27: where the 2.5B forward's time goes and the launches left to try (the router's matmul, our
  # projection GEMM against cuBLAS at the 2.5B shapes), then the 2.5B shape's bench at batch 1
  for n in 1 33; do
    timeout "${T_PROF:-60}" python3 scripts/profile_decode.py --batch 1 --nodes "$n" --graph --rows 24 \
      >"$R/profile_b1_n$n.log" 2>&1 || status=1
  done
  timeout "${T_ROUTER:-60}" python3 scripts/probe_router_launch.py --tokens 1 33 2>&1 | tee "$R/router.log" \
    | tail -20 || status=1
  timeout "${T_LIN:-60}" python3 scripts/bench_linear.py --rows 1 33 --rep-ms 30 2>&1 | tee "$R/bench_linear.log" \
    | tail -30 || status=1
  bench_small_b1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = pdl ]; then
  # issue 27: programmatic dependent launch (kernels/_pdl.py). The GPU tests of every kernel it touches, the
  # model's and the engine's (PDL on, as by default), then the chain probe and the 2.5B forward's profiles
  # with PDL and without it (KDTREE_ENGINE_PDL=0)
  timeout "${T_KT:-200}" python3 -m pytest -q -m gpu tests/kernels/test_rmsnorm_rope.py tests/kernels/test_moe.py \
    tests/kernels/test_moe_router.py tests/kernels/test_mla_layer_latent.py tests/kernels/test_mla_attention_merge.py \
    tests/kernels/test_mla_attention_schedule.py tests/kernels/test_moe_shared.py tests/kernels/test_moe_tile_map.py \
    tests/kernels/test_mla_attention.py tests/model -p no:cacheprovider "${xdist[@]}" -rs 2>&1 \
    | tee "$R/pdl_kernel_tests.log" | tail -8 || status=1
  timeout "${T_ENG:-150}" python3 -m pytest -q -m gpu tests/engine --ignore tests/engine/test_gpu_row_invariance.py \
    -p no:cacheprovider -rs 2>&1 | tee "$R/pdl_engine_tests.log" | tail -5 || status=1
  timeout "${T_PDL:-60}" python3 scripts/probe_pdl.py 2>&1 | tee "$R/probe_pdl.log" | tail -12 || status=1
  for n in 1 33; do
    timeout "${T_PROF:-60}" python3 scripts/profile_decode.py --batch 1 --nodes "$n" --graph --rows 16 \
      >"$R/profile_pdl_n$n.log" 2>&1 || status=1
    KDTREE_ENGINE_PDL=0 timeout "${T_PROF:-60}" python3 scripts/profile_decode.py --batch 1 --nodes "$n" --graph --rows 16 \
      >"$R/profile_plain_n$n.log" 2>&1 || status=1
  done
  grep -H "graph replay" "$R"/profile_*.log
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = pdl-rest ]; then
  # issue 27: the GPU tests that have not yet run with programmatic dependent launch on every kernel (the
  # drafter's, the tree kernels', the row-invariant GEMM's and mode's, the SGLang integration's kernels),
  # then the 2.5B shape's bench at batch 1
  timeout "${T_KT:-240}" python3 -m pytest -q -m gpu tests/kernels/test_drafter_attention.py \
    tests/kernels/test_drafter_mlp.py tests/kernels/test_drafter_qkv.py tests/kernels/test_tree_build.py \
    tests/kernels/test_tree_compile_accept.py tests/kernels/test_tree_sampling.py \
    tests/kernels/test_tree_sampling_seeded.py tests/kernels/test_tree_topk_gpu.py tests/kernels/test_cache_compact.py \
    tests/kernels/test_round_report.py tests/kernels/test_linear.py tests/kernels/test_mla_attention_invariant.py \
    tests/kernels/test_sglang_attention_metadata.py tests/kernels/test_round_commit.py tests/model/test_gemm_mode.py \
    tests/drafter tests/model/test_row_invariance.py \
    -p no:cacheprovider "${xdist[@]}" -rs 2>&1 | tee "$R/pdl_rest_tests.log" | tail -8 || status=1
  bench_small_b1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = goals ]; then
  OUT="${R%/results}" T_TESTS="${T_TESTS:-300}" T_DEMO="${T_DEMO:-40}" bash "$0" tests || status=1
  bench_small_b1
  timeout "${T_E2E:-150}" python3 -m kdtree_engine bench e2e --target nano --batch 1 --temperatures 0 \
    --budgets 16 32 --prompts 8 --out "$R/nano_b1" 2>&1 | tee "$R/bench_nano_b1.log" | tail -30 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = ncu-verify ]; then
  for point in 8,17,4096,16 64,9,4096,16; do
    timeout "${T_NCU:-150}" ncu --clock-control none -k regex:_attention_kernel -s 1 -c 1 --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section Occupancy --section LaunchStats python3 scripts/probe_verify_misses.py "$R/ncu" --points $point \
      --kernel-runs 2 > "$R/ncu_${point//,/_}.log" 2>&1 || status=1
    tail -60 "$R/ncu_${point//,/_}.log"
  done
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = ncu-flashmla ]; then
  # issue 29: ncu on our attention and on FlashMLA at the same causal point of 64-row pages
  # (scripts/probe_attention_ncu.py: the profiled call inside an NVTX range), h = 8 decode and h = 64, t = 9;
  # then the Hopper kernel at issue 31's h = 8, t = 17 miss (pages of 1). FlashMLA's wheel carried in .whl/
  pip install -q --no-deps --target /tmp/site .whl/sgl_flash_mla-*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
  sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
            --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats)
  for point in ${NCU_POINTS:-16,1,8,32768 16,9,64,32768}; do
    for side in ours flashmla; do
      log="$R/ncu_${side}_${point//,/_}.log"
      timeout "${T_NCU:-100}" ncu --clock-control none --nvtx --nvtx-include "profile/" -c 4 "${sections[@]}" \
        python3 scripts/probe_attention_ncu.py --point $point --side $side > "$log" 2>&1 || status=1
      grep -E "point b=|^  [a-z_].*\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|No Eligible|Issued Warp" "$log" | head -40
    done
  done
  point=8,17,4096,16
  if [ -n "${NCU_MISS-1}" ]; then
    timeout "${T_NCU:-100}" ncu --clock-control none -k regex:_attention_kernel -s 1 -c 1 "${sections[@]}" \
      python3 scripts/probe_verify_misses.py "$R/ncu" --points $point --kernel-runs 2 > "$R/ncu_${point//,/_}.log" \
      2>&1 || status=1
  fi
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = tree-bound ]; then
  # the tile bound for trees (a row block stops at its last node's slot, commit 02ab9b3): the attention
  # kernels' GPU tests, the SGLang backend's against SGLang's Triton extend kernel (carry .peers), then
  # both targets' bench at batch 1, budget 32; with a copy of an earlier src at out/base/src (carry
  # out/base) the same bench runs on it first: the baseline of the same call
  timeout "${T_KT:-130}" python3 -m pytest -q -m gpu tests/kernels/test_mla_attention.py -p no:cacheprovider \
    "${xdist[@]}" -rs 2>&1 | tee "$R/attention_tests.log" | tail -8 || status=1
  KDTREE_SGLANG_DDTREE=.peers/sglang timeout "${T_SGT:-60}" python3 -m pytest -q -m gpu \
    tests/integrations/test_sglang_extend.py -p no:cacheprovider -rs 2>&1 | tee "$R/sglang_extend_tests.log" \
    | tail -5 || status=1
  versions=(new)
  if [ -d out/base/src ]; then
    ln -sfn "$PWD/src/kdtree_engine/assets" out/base/src/kdtree_engine/assets
    versions=(base new)
  fi
  for v in "${versions[@]}"; do
    path=src; [ "$v" = base ] && path=out/base/src
    for target in small nano; do
      PYTHONPATH=$path timeout "${T_E2E:-60}" python3 -m kdtree_engine bench e2e --target $target --batch 1 \
        --temperatures 0 --budgets 32 --prompts 8 --out "$R/${target}_$v" 2>&1 \
        | tee "$R/bench_${target}_$v.log" | grep -E '^\| 1 \| (0|decode|verify|draft) ' || status=1
    done
  done
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = engine ]; then
  # the cache compaction's kernel against its reference on CUDA (its tests take the device when there is
  # one), the engine's GPU tests (captured rounds, prefill and first-draft graphs, the auto budget's
  # buckets with the chain), then the auto budget's kimi-nano grid (issues 27 and 28) in one device call
  timeout "${T_CMP:-60}" python3 -m pytest -q tests/kernels/test_cache_compact.py -p no:cacheprovider 2>&1 \
    | tee "$R/compact_tests.log" | tail -5 || status=1
  timeout "${T_ENG:-150}" python3 -m pytest -q -m gpu tests/engine --ignore tests/engine/test_gpu_row_invariance.py \
    -p no:cacheprovider -rs --durations=5 2>&1 \
    | tee "$R/engine_tests.log" | tail -20 || status=1
  timeout "${T_AUTO:-380}" python3 -m kdtree_engine bench e2e --target nano --batch 1 4 16 64 --temperatures 0 1 \
    --budgets 8 16 32 64 --prompts 8 --auto --out "$R/nano_auto" 2>&1 | tee "$R/bench_nano_auto.log" | tail -40 \
    || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = traces ]; then
  # issue 28: kimi-nano's acceptance on this GPU in bf16 for the policy simulator (rounds eager; the CPU's
  # float32 traces do not show the GPU's greedy losses), then the grid whose costs the simulator replays
  timeout "${T_TRACE:-200}" python3 scripts/record_acceptance_traces.py --device cuda --dtype bfloat16 --prompts 32 \
    --out "$R/traces_gpu.json" 2>&1 | tee "$R/traces_gpu.log" || status=1
  # shellcheck disable=SC2086
  timeout "${T_AUTO:-360}" python3 -m kdtree_engine bench e2e --target nano --batch ${AUTO_BATCH:-1 4 16 64} \
    --temperatures 0 1 --budgets 8 16 32 64 --prompts 8 --auto --out "$R/nano_auto" 2>&1 | tee "$R/bench_nano_auto.log" \
    | tail -40 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = auto-small ]; then
  # issue 28's second target: the 2.5B scaled-down Kimi shape with its stand-in drafter, AR, DFlash, every
  # fixed budget and auto, temperature 0 and 1; AUTO_BATCH and AUTO_TEMPS split the grid over calls if it
  # does not fit in one
  # shellcheck disable=SC2086
  timeout "${T_AUTO:-560}" python3 -m kdtree_engine bench e2e --target small --batch ${AUTO_BATCH:-1 4 16 64} \
    --temperatures ${AUTO_TEMPS:-0 1} --budgets 8 16 32 64 --auto --out "$R/small_auto" 2>&1 | tee "$R/bench_small_auto.log" | tail -40 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = sharded ]; then
  # issue 33, on a machine of 2 or more GPUs (carry .peers): the NCCL multi-process tests, then the 8-rank
  # bench (--ranks follows the GPUs present); NCCL's variables are left as the machine sets them
  gpus=$(nvidia-smi -L | wc -l)
  KDTREE_SGLANG_DDTREE=.peers/sglang timeout "${T_SHT:-200}" python3 -m pytest -q -m gpu \
    tests/integrations/test_sharded_topk_processes.py tests/bench/test_sharded_topk_bench.py -p no:cacheprovider -rs \
    2>&1 | tee "$R/sharded_tests.log" | tail -20 || status=1
  timeout "${T_SHB:-360}" python3 -m kdtree_engine bench sharded-topk --backend nccl --ranks "$gpus" --port .peers/sglang \
    --out "$R/sharded_topk" 2>&1 | tee "$R/bench_sharded_topk.log" | tail -40 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" = e2e ]; then
  timeout "${T_E2E:-400}" python3 -m kdtree_engine bench e2e --out "$R/e2e" 2>&1 | tee "$R/bench_e2e.log" \
    | tail -40 || status=1
  tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
  exit $status
fi
if [ "$what" != bench ]; then
  # gpu-marked tests, plus the golden replays (unmarked: on a GPU they run the kernels on CUDA)
  # --durations names the slowest tests; faulthandler dumps the stack of any test still running after 150 s
  timeout "$T_TESTS" python3 -m pytest -q -m "gpu or golden" tests -p no:cacheprovider "${xdist[@]}" \
    --durations=12 -o faulthandler_timeout=150 2>&1 \
    | tee "$R/gpu_tests.log" | tail -40 || status=1
  timeout "$T_DEMO" python3 -m kdtree_engine generate --demo --compare --device cuda 2>&1 \
    | tee "$R/engine_demo_cuda.log" | tail -12 || status=1
fi
if [ "$what" != tests ]; then
  peer=()
  [ -d .peers/ddtree ] && peer=(--peer official=.peers/ddtree)
  [ -d .peers/sglang ] && peer+=(--peer sglang=.peers/sglang --peer sglang-triton=.peers/sglang)
  timeout "$T_TREE" python3 -m kdtree_engine bench tree --out "$R/tree" --host-iters 3 --rep-ms 50 \
    "${peer[@]}" 2>&1 | tee "$R/bench_tree.log" || status=1
  # the issue's shapes that the goals name (the full default grid takes longer than one device call)
  timeout "$T_ATTN" python3 -m kdtree_engine bench attention --out "$R/attention" --heads 64 8 \
    --tokens 1 9 33 --seqlens 4096 32768 --batch 16 --rep 30 2>&1 | tee "$R/bench_attention.log" \
    || status=1
  # per-launch times of the vocabulary top-k (partials / select) and of a read-only pass, exactness checked
  sweep=()
  [ "${PROBE_SWEEP:-0}" = 1 ] && sweep=(--sweep)
  timeout "$T_TOPK" python3 scripts/probe_topk.py --out "$R/topk" --budget-s $((T_TOPK - 20)) "${sweep[@]}" 2>&1 \
    | tail -40 | tee "$R/probe_topk.log" || status=1
fi
tar czf "${R%/results}/results.tgz" -C "$(dirname "$R")" results
exit $status
