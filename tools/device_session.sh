#!/usr/bin/env bash
# The device session's work, by parts, each step under its own timeout and all under one budget, so a
# call ends inside the device tool's 10 minutes. Run on the device after the kit's setup:
#   source .devkit/setup.sh; tools/device_session.sh PART [PART ...]
# Parts:
#   tests               every GPU test of the suite but the unverified kernels' (pytest -m gpu; the 2-GPU test skips; TEST_PATHS narrows it)
#   unverified          the GPU tests of kernels not yet run on a GPU, which the public op cannot reach
#   compare             python -m flashqla.bench --compare: kernel variants side by side (kept forward
#                       tensors, conv; COMPARE=name,... picks), ratios printed, JSON
#   bench               python -m flashqla.bench --fwd --bwd --breakdown, ours / FLA / FlashQLA, JSON
#                       (SHAPES=substr,... filters shapes; BENCH_BUDGET seconds, default: what is left;
#                       BASELINES=flashqla leaves out FLA, whose Triton autotuning takes ~25 s a shape uncached)
#   bench-warm          one `flashqla.bench --warm-only --baselines fla` process per head layout of SHAPES
#                       (default all 8), in parallel: FLA's Triton kernels compile into the shared cache, so a
#                       later bench spends no minutes per layout there. Autotune results are not kept
#                       (FLA_CACHE_RESULTS=0): the timed run autotunes alone on the GPU.
#   ncu                 Nsight Compute sections of one launch each of our main kernels (NCU_SHAPE=16/64:8192)
#   ncu-source          one launch of NCU_KERNELS (default fused_backward) with PC sampling: the report, its SASS page
#                       as CSV and the 40 instructions that stall most (tools/ncu_top_stalls.py), then the same by
#                       line of the generated CUDA (the report imports the source)
#   tests-model         the GPU tests of the conv kernel and of qwen_hybrid/ only
#   walk-timeline       tools/walk_timeline.py: the forward walk's cycles per role and segment of a chunk, on
#                       16/64 x 32768 (storing everything and nothing), 16/64 8192x4, 16/16 x 131072 and 2/8 x 32768
#                       (WALK_OPTION=name: a candidate's fused_forward switch; in fused-timeline:FORM, backward's)
#   compare-conv        python -m flashqla.bench --compare conv (the conv kernel against torch.compile; its backward's token blocks)
#   fused-bench:FORM    the fused reverse walk's forms side by side in one call (FORM: main, the tree's
#   fused-timeline:FORM flashqla/hopper/backward_fused.py, or NAME for .devkit/alt/backward_fused_NAME.py, put in its
#   fused-tests:FORM    place for the step): --compare backward_fused, tools/walk_timeline.py --backward plain and
#                       --model on 16/16 x 131072 (FUSED_TIMELINE="16/48 32768": another shape), its GPU tests (JSON in
#                       logs.tgz: compare-FORM, timeline-FORM[-model])
#   fused-spread:FORM   walk_timeline.py --backward --spread (times three runs, per-CTA spread of the periods) on the
#                       shapes where the fused walk's time is erratic: 2/8 x 32768 and 8/8 x 131072, plain and --model
#   attention           python -m benchmarks.attention_backends (SDPA's kernels and varlen_attn; ATTENTION_ARGS)
#   loss-curves         20 steps at 8192 tokens of this tree and of baseline/ (a git archive of an older commit), losses side by side
#   train-32k           launch/benchmark.sh 0.8B 32768 tilelang (train-32k-compare: tilelang,fla;
#                       train-32k-compare-recompute: the same with model.gdn_keep_for_backward=false;
#                       train-128k-compare: tilelang,fla at 131072)
#   keep-levels         32768 tokens, tilelang,fla, once for each model.gdn_keep_for_backward (true, products, false)
#   train-256k          launch/benchmark.sh 0.8B 262144 tilelang
#   train-512k          launch/benchmark.sh 0.8B 524288 tilelang, 4 steps: steps 1-2 recompute the attention (80.4 GiB,
#                       twenty-first session), then train.recompute_attention=auto keeps the attention layers that fit
#   train-384k          launch/benchmark.sh 0.8B 393216 tilelang, 4 steps: auto keeps some layers by its estimate after
#                       step 2 and, by what they were measured to cost, more after step 3
#   idle                32768 tokens: profiled, without DeepSpeed's overlap_comm, with ZeRO-1; 8192 profiled
#   step-time           8192 (profiled at step PROFILE_STEP=6) and 32768 tokens, tilelang, kernel timing off
#   grad-checks         8192 (profiled at step PROFILE_STEP=6) and 32768 tokens with deepspeed.one_pass_grad_checks on and off
#   zero1-nohooks       8192 and 32768 tokens on ZeRO-1 without contiguous gradients or overlap (no gradient hooks)
#   timing-cost         32768 tokens with kernel timing on and off
#   checkpoint-layers   131072 tokens with train.checkpoint_layers=16
#   model-bench         python -m flashqla.bench --model --fwd --bwd (ours / FLA / FlashQLA as the model calls the op;
#                       SHAPES=substr,... filters; BREAKDOWN=1 adds our stages; BASELINES= (empty): ours alone;
#                       KEEP=inverse|false: what our op keeps for the backward, true by default)
#   model-bench-ab      the same, ours alone with BREAKDOWN, this tree against baseline/ (git archive of another commit),
#                       alternating ROUNDS (default 2) times; SHAPES defaults to 16/16,8/8; JSON per run in logs.tgz
#   model-vs-hf         python -m benchmarks.model_vs_hf: ours, HF + FLA, HF + FlashQLA at 16384 tokens
#   train-8k            launch/benchmark.sh 0.8B 8192 tilelang,fla
#   train-128k-tilelang launch/benchmark.sh 0.8B 131072 tilelang
#   train-128k-attention  the same, kernel timing off, with model.attention_backend=sdpa and =auto (FA4 where unpacked)
#   train-128k-fla      launch/benchmark.sh 0.8B 131072 fla
#   train-2b            launch/benchmark.sh 2B 131072 tilelang (memory at 128k)
#   train               the four train parts above
#   tp2                 (2 GPUs) the tensor-parallel GPU tests (NCCL), then TP=2 SP=1 launch/benchmark.sh 0.8B
#                       131072 tilelang (TP2_OVERRIDES: extra Hydra overrides)
#   tp2-8k              (2 GPUs) TP=2 launch/benchmark.sh 0.8B 8192 tilelang
# On a 2-GPU machine two scripts can share a call, one GPU each (CUDA_VISIBLE_DEVICES, separate OUT):
#   CUDA_VISIBLE_DEVICES=1 OUT=$OUT/gpu1 tools/device_session.sh unverified compare bench & \
#   CUDA_VISIBLE_DEVICES=0 OUT=$OUT/gpu0 tools/device_session.sh tests train-8k; wait
# Writes under $OUT: summary.txt, logs.tgz (every step's log and metrics), bench.json (bench), compare.json (compare),
# tritoncache.tgz (Triton's cache, restored from .devkit/tritoncache.tgz next call); setup.sh adds
# tlcache.tgz. Prints the summary table last. BUDGET_S (default 560) bounds the whole script.
# The train parts take STEPS (launch/benchmark.sh's step count), TRAIN_TIMEOUT_S (per run, default 240)
# and TRAIN_OVERRIDES (extra Hydra overrides, e.g. benchmark.profile_step=5).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-560}
STARTED=$SECONDS
# Training runs log to metrics.jsonl only: the kit has no wandb and nothing may import it.
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TRITON_CACHE_DIR=/tmp/tritoncache RUNS=/tmp/runs
# every pytest failure as it happens (tests/conftest.py): a step killed at its limit keeps them
export PYTEST_FAILURES_LOG=$LOGS/failures.txt
mkdir -p "$TRITON_CACHE_DIR"
[ -f .devkit/tritoncache.tgz ] && tar -xzf .devkit/tritoncache.tgz -C /tmp
SUMMARY=()
# Test files of kernels not yet run on a GPU (reachable only through internal arguments); once they
# pass on the device, their file leaves this list and runs in `tests`.
UNVERIFIED_TESTS=()

left() { echo $((BUDGET_S - (SECONDS - STARTED))); }

# step NAME TIMEOUT_S MIN_S COMMAND...: run under min(TIMEOUT_S, budget left) unless less than MIN_S
# is left (then SKIPPED: a run cut short measures nothing); log to $LOGS/NAME.log; record rc,
# seconds and the log's last meaningful line.
step() {
    local name=$1 limit=$2 least=$3
    shift 3
    local budget
    budget=$(left)
    if [ "$budget" -lt "$least" ]; then
        SUMMARY+=("$(printf '%-22s %-9s %6s  %s' "$name" "SKIPPED" "-" "${budget}s left, needs ${least}s")")
        return 1
    fi
    [ "$limit" -gt "$budget" ] && limit=$budget
    echo "=== $name (limit ${limit}s) ==="
    local began=$SECONDS
    timeout -k 15 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    local took=$((SECONDS - began))
    local status=ok
    [ $rc -ne 0 ] && status="rc=$rc"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && status=KILLED  # timeout, or out of memory
    local last
    last=$(grep -E "passed|failed|error|run summary|skipped for|Error|Traceback" "$LOGS/$name.log" | tail -1 | cut -c1-150)
    [ -z "$last" ] && last=$(tail -1 "$LOGS/$name.log" | cut -c1-150)
    tail -3 "$LOGS/$name.log"
    SUMMARY+=("$(printf '%-22s %-9s %5ss  %s' "$name" "$status" "$took" "$last")")
    return $rc
}

train_run() {  # train_run NAME SIZE TOKENS BACKENDS [OVERRIDES...]: metrics land in $LOGS via benchmark.sh's $OUT
    # TRAIN_MIN_S (default 150): skip the run when less than this is left of the budget
    local name=$1
    shift
    step "$name" "${TRAIN_TIMEOUT_S:-240}" "${TRAIN_MIN_S:-150}" env OUT="$LOGS" TAG="${TAG:-}" \
        launch/benchmark.sh "$@" ${TRAIN_OVERRIDES:-}
}

run_part() {
    case $1 in
    tests)
        step env 30 10 bash -c 'nvidia-smi; '"$PYTHON"' -c "import torch, triton, tilelang; print(torch.__version__, triton.__version__, tilelang.__version__, torch.cuda.get_device_name())"'
        step pytest-gpu 540 120 "$PYTHON" -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout=300 \
            ${UNVERIFIED_TESTS[@]+"${UNVERIFIED_TESTS[@]/#/--ignore=}"} ${TEST_PATHS:-tests/}
        ;;
    unverified)
        if [ ${#UNVERIFIED_TESTS[@]} -eq 0 ]; then
            SUMMARY+=("$(printf '%-22s %-9s %6s  %s' pytest-unverified SKIPPED - "no unverified kernels")")
            return 0
        fi
        # the thread method ends the process if a kernel hangs
        step pytest-unverified 360 60 "$PYTHON" -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout=150 \
            --timeout-method=thread "${UNVERIFIED_TESTS[@]}"
        ;;
    compare)
        step compare 300 60 "$PYTHON" -m flashqla.bench --compare ${COMPARE:-} --json "$OUT/compare.json"
        ;;
    bench)
        local budget=${BENCH_BUDGET:-$(($(left) - 40))}
        step bench $((budget + 30)) 90 "$PYTHON" -m flashqla.bench --fwd --bwd --breakdown --json "$OUT/bench.json" \
            --baselines "${BASELINES-fla,flashqla}" --time-budget "$budget" ${SHAPES:+--shapes "$SHAPES"}
        ;;
    bench-warm)
        local layouts=${SHAPES:-16/64,16/48,16/32,8/32,8/24,4/16,2/8,16/16}
        step bench-warm 420 60 bash -c 'for layout in ${0//,/ }; do
                FLA_CACHE_RESULTS=0 '"$PYTHON"' -m flashqla.bench --warm-only --bwd --baselines fla \
                    --shapes "$layout " > "'"$LOGS"'/warm-${layout//\//_}.log" 2>&1 &
            done; wait; grep -h "first call" "'"$LOGS"'"/warm-*.log' "$layouts"
        ;;
    ncu)
        # Nsight Compute on our main kernels, one launch each (first forward + backward of NCU_SHAPE):
        # where their time goes (issue stalls, occupancy, memory). Needs the Firecracker machines.
        # NCU_KERNELS (a regex) and NCU_COUNT pick the launches; NCU_EXTRA adds sections (InstructionStats,
        # SourceCounters: the SASS lines that stall most).
        step ncu 150 60 ncu --clock-control none -k "regex:${NCU_KERNELS:-chunk_inverse|fused_forward|fused_backward}" \
            -c "${NCU_COUNT:-3}" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
            --section SchedulerStats --section MemoryWorkloadAnalysis ${NCU_EXTRA:-} \
            "$PYTHON" -c 'import sys, torch; from flashqla.bench import make_inputs, implementations, first_call_s
heads, lens = sys.argv[1].split(":"); heads = tuple(map(int, heads.split("/"))); lens = list(map(int, lens.split("+")))
print(first_call_s(implementations([])["ours"], make_inputs(heads, lens)))' "${NCU_SHAPE:-16/64:8192}"
        ;;
    ncu-source)
        # One launch of NCU_KERNELS (default the reverse walk) with PC sampling, kept as $OUT/ncu-source.ncu-rep,
        # then its per-SASS-instruction page as CSV and the 40 instructions with the most stall samples.
        "$PYTHON" tools/restore_kernel_sources.py  # the cached kernels' sources where their line tables point
        step ncu-source-collect 150 60 ncu --clock-control none -k "regex:${NCU_KERNELS:-fused_backward}" -c 1 \
            --section WarpStateStats --section SourceCounters --section InstructionStats --import-source yes \
            -f -o "$OUT/ncu-source" \
            "$PYTHON" -c 'import sys, torch; from flashqla.bench import make_inputs, implementations, first_call_s
heads, lens = sys.argv[1].split(":"); heads = tuple(map(int, heads.split("/"))); lens = list(map(int, lens.split("+")))
print(first_call_s(implementations([])["ours"], make_inputs(heads, lens)))' "${NCU_SHAPE:-16/64:8192}"
        step ncu-source-page 60 20 bash -c 'ncu -i "$0/ncu-source.ncu-rep" --page source --print-source sass --csv \
            > "$0/ncu-source.csv" && '"$PYTHON"' tools/ncu_top_stalls.py "$0/ncu-source.csv"' "$OUT"
        # the same samples by line of the generated CUDA: which role's loop each wait is in. The CUDA-only
        # page came back without metric columns (twenty-first session), so this asks for the correlated
        # CUDA + SASS page; the file comes back raw even where the parser does not read its format.
        step ncu-source-lines 60 20 bash -c 'ncu -i "$0/ncu-source.ncu-rep" --page source --print-source cuda,sass \
            --csv > "$0/ncu-source-cuda-sass.csv"; head -c 400 "$0/ncu-source-cuda-sass.csv"; echo; \
            '"$PYTHON"' tools/ncu_top_stalls.py --cuda "$0/ncu-source-cuda-sass.csv"' "$OUT"
        ;;
    tests-model)
        # the conv kernel, the loss's compiled passes and the model's GPU tests (a quicker subset of tests)
        step pytest-model 400 60 "$PYTHON" -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout=300 \
            tests/flashqla/test_causal_conv.py tests/qwen_hybrid
        ;;
    walk-timeline)
        step walk-timeline 240 60 bash -c 'for shape in "16/64 32768 everything" "16/64 32768 nothing" \
                "16/64 8192,8192,8192,8192 everything" "16/16 131072 everything" "2/8 32768 everything"; do
            set -- $shape
            '"$PYTHON"' tools/walk_timeline.py --heads $1 --lengths $2 --keep $3 '"${WALK_OPTION:+--option $WALK_OPTION}"' || exit 1
        done'
        ;;
    fused-bench:* | fused-timeline:* | fused-tests:* | fused-spread:*)
        local form=${1#*:} kernel=flashqla/hopper/backward_fused.py
        [ -f /tmp/backward_fused_main.py ] || cp "$kernel" /tmp/backward_fused_main.py
        if [ "$form" = main ]; then cp /tmp/backward_fused_main.py "$kernel"; else cp ".devkit/alt/backward_fused_$form.py" "$kernel"; fi
        case $1 in
        fused-bench:*)
            step "$1" 150 30 "$PYTHON" -m flashqla.bench --compare backward_fused --rep 50 --json "$LOGS/compare-$form.json" ;;
        fused-timeline:*)
            local shape=(${FUSED_TIMELINE:-16/16 131072})
            step "$1" 60 25 bash -c 'for mode in "" --model; do
                '"$PYTHON"' tools/walk_timeline.py --backward $mode --heads '"${shape[0]}"' --lengths '"${shape[1]}"' \
                    '"${WALK_OPTION:+--option $WALK_OPTION}"' \
                    --json "'"$LOGS/timeline-$form${WALK_OPTION:+-$WALK_OPTION}"'${mode:+-model}.json" || exit 1
            done' ;;
        fused-tests:*)
            step "$1" 200 150 "$PYTHON" -m pytest -m gpu -q -x -rfE -p no:cacheprovider \
                tests/flashqla/test_hopper_backward_fused.py ;;
        fused-spread:*)
            step "$1" 150 40 bash -c 'for shape in "2/8 32768" "8/8 131072"; do for mode in "" --model; do
                set -- $shape
                '"$PYTHON"' tools/walk_timeline.py --backward --spread $mode --heads $1 --lengths $2 \
                    --json "'"$LOGS/spread-$form"'-${1/\//_}-$2${mode:+-model}.json" || exit 1
            done; done' ;;
        esac
        cp /tmp/backward_fused_main.py "$kernel"
        ;;
    compare-conv)
        step compare-conv 200 40 "$PYTHON" -m flashqla.bench --compare conv --json "$OUT/compare-conv.json"
        ;;
    attention)
        step attention 300 60 env OUT="$OUT" "$PYTHON" -m benchmarks.attention_backends ${ATTENTION_ARGS:-}
        ;;
    loss-curves)
        # 20 steps at 8192 tokens, same seed, by this tree and by the tree in baseline/ (git archive of
        # the commit to compare with): the loss of every step side by side
        for tree in . baseline; do
            [ -d "$tree/train" ] || continue
            step "curve-${tree//./current}" 200 60 env PYTHONPATH="/tmp/devkit/site:$PWD/$tree" bash -c "cd $tree && $PYTHON \
                train/pretrain.py experiment=h200_single train.steps=20 train.warmup_steps=2 logger.mode=disabled \
                train.checkpoint_every=0 train.checkpoint_at_exit=false train.export_hf=false \
                train.overwrite=true run_dir=/tmp/runs/curve-${tree//./current} && cp /tmp/runs/curve-${tree//./current}/metrics.jsonl $LOGS/curve-${tree//./current}.jsonl"
        done
        step curve-compare 30 5 "$PYTHON" -c 'import json, sys
runs = [[json.loads(l) for l in open(p)] for p in sys.argv[1:]]
losses = [{r["step"]: r["loss"] for r in run if "loss" in r} for run in runs]
for step in sorted(losses[0]):
    print(step, *(f"{l.get(step, -1):.4f}" for l in losses))
print("max |difference|", max(abs(losses[0][s] - losses[1][s]) for s in losses[0] if s in losses[1]))' \
            "$LOGS/curve-current.jsonl" "$LOGS/curve-baseline.jsonl"
        ;;
    idle)
        # what idles the GPU between kernels at 32768 tokens: the profile, then DeepSpeed without its
        # per-bucket device synchronisation (overlap_comm), and ZeRO-1 (STEPS=6 is plenty)
        TAG=profile train_run idle-profile 0.8B 32768 tilelang benchmark.kernel_timing=false benchmark.profile_step=4
        TAG=nooverlap train_run idle-nooverlap 0.8B 32768 tilelang benchmark.kernel_timing=false \
            +deepspeed.overrides.zero_optimization.overlap_comm=false
        TAG=zero1 train_run idle-zero1 0.8B 32768 tilelang benchmark.kernel_timing=false deepspeed=zero1
        TAG=8k-profile train_run idle-8k-profile 0.8B 8192 tilelang benchmark.kernel_timing=false benchmark.profile_step=4
        ;;
    step-time)
        # issue 15's short rows as users run them: kernel timing off, 8192 (profiled at PROFILE_STEP=6) and 32768
        TAG=step-time train_run step-time-8k 0.8B 8192 tilelang benchmark.kernel_timing=false \
            benchmark.profile_step=${PROFILE_STEP:-6}
        TAG=step-time train_run step-time-32k 0.8B 32768 tilelang benchmark.kernel_timing=false
        ;;
    grad-checks)
        # ZeRO's gradient checks per tensor (DeepSpeed's) or in one pass (train/zero_step.py), 8192 and 32768
        for checks in true false; do
            TAG=onepass-$checks train_run "onepass-$checks-8k" 0.8B 8192 tilelang benchmark.kernel_timing=false \
                deepspeed.one_pass_grad_checks=$checks benchmark.profile_step=${PROFILE_STEP:-6}
            TAG=onepass-$checks train_run "onepass-$checks-32k" 0.8B 32768 tilelang benchmark.kernel_timing=false \
                deepspeed.one_pass_grad_checks=$checks
        done
        ;;
    zero1-nohooks)
        # ZeRO-1 without contiguous gradients or overlap: DeepSpeed registers no per-parameter gradient hooks
        for tokens in 8192 32768; do
            TAG=zero1-nohooks train_run "zero1-nohooks-$tokens" 0.8B $tokens tilelang benchmark.kernel_timing=false \
                deepspeed=zero1 +deepspeed.overrides.zero_optimization.contiguous_gradients=false \
                +deepspeed.overrides.zero_optimization.overlap_comm=false
        done
        ;;
    timing-cost)
        TAG=timing-on train_run timing-on 0.8B 32768 tilelang benchmark.kernel_timing=true
        TAG=timing-off train_run timing-off 0.8B 32768 tilelang benchmark.kernel_timing=false
        ;;
    checkpoint-layers)
        TAG=ckpt16 train_run ckpt16-128k 0.8B 131072 tilelang benchmark.kernel_timing=false train.checkpoint_layers=16
        ;;
    model-bench)
        step model-bench 500 60 "$PYTHON" -m flashqla.bench --model --fwd --bwd --baselines "${BASELINES-fla,flashqla}" \
            --json "$OUT/model-bench.json" ${SHAPES:+--shapes "$SHAPES"} ${BREAKDOWN:+--breakdown} \
            ${KEEP:+--keep "$KEEP"}
        ;;
    model-bench-ab)
        # this tree against baseline/ (a git archive of the commit to compare with), alternating ROUNDS (default 2)
        # times in separate processes: the model bench, ours alone (SHAPES, default 16/16,8/8), with the breakdown
        [ -d baseline/flashqla ] || { SUMMARY+=("$(printf '%-22s %-9s' model-bench-ab "NO baseline/")"); return 1; }
        for round in $(seq "${ROUNDS:-2}"); do
            for tree in . baseline; do
                local tag="ab-${tree//./current}-$round"
                step "$tag" 150 40 env PYTHONPATH="$PWD/$tree:${PYTHONPATH:-}" bash -c "cd $tree && $PYTHON -m flashqla.bench \
                    --model --fwd --bwd --baselines= --breakdown --shapes '${SHAPES:-16/16,8/8}' --json $LOGS/$tag.json"
            done
        done
        ;;
    model-vs-hf)
        step model-vs-hf 590 60 env OUT="$OUT" "$PYTHON" -m benchmarks.model_vs_hf \
            '[{"size": "0.8B", "tokens": 16384, "backend": "tilelang"}, {"impl": "hf", "size": "0.8B", "tokens": 16384},
              {"impl": "hf", "size": "0.8B", "tokens": 16384, "hf_gdn": "flashqla"}]'
        ;;
    train-32k) train_run train-0.8B-32k-tilelang 0.8B 32768 tilelang ;;
    train-32k-compare) train_run train-0.8B-32k-compare 0.8B 32768 tilelang,fla ;;
    train-32k-compare-recompute)
        TAG=recompute train_run train-0.8B-32k-compare-recompute 0.8B 32768 tilelang,fla model.gdn_keep_for_backward=false ;;
    train-128k-compare) train_run train-0.8B-128k-compare 0.8B 131072 tilelang,fla ;;
    keep-levels)
        # peak memory and GDN backward against fla for each of what the op may keep (true, products, false)
        for keep in true products false; do
            TAG=keep-$keep train_run "keep-$keep-32k" 0.8B 32768 tilelang,fla model.gdn_keep_for_backward=$keep
        done
        ;;
    train-256k) train_run train-0.8B-256k-tilelang 0.8B 262144 tilelang ;;
    # the preset's recompute_attention=auto: steps 1-2 recompute every attention layer, 3-4 keep what fits
    train-512k) STEPS=4 TRAIN_TIMEOUT_S=${TRAIN_TIMEOUT_S:-540} train_run train-0.8B-512k-tilelang 0.8B 524288 tilelang ;;
    train-384k) STEPS=4 TRAIN_TIMEOUT_S=${TRAIN_TIMEOUT_S:-330} train_run train-0.8B-384k-tilelang 0.8B 393216 tilelang ;;
    train-8k) train_run train-0.8B-8k-compare 0.8B 8192 tilelang,fla ;;
    train-128k-tilelang) train_run train-0.8B-128k-tilelang 0.8B 131072 tilelang ;;
    train-128k-attention)
        # issue 15's 131072 row as users run it (kernel timing off) on each attention backend: sdpa (cuDNN both
        # ways), auto (FA4's forward with cuDNN's backward where FA4 imports: source tools/fa4_kit.sh unpack first)
        for backend in sdpa auto; do
            TAG=attention-$backend train_run "train-128k-$backend" 0.8B 131072 tilelang benchmark.kernel_timing=false \
                model.attention_backend=$backend
        done
        ;;
    train-128k-fla) train_run train-0.8B-128k-fla 0.8B 131072 fla ;;
    train-2b) train_run train-2B-128k-tilelang 2B 131072 tilelang ;;
    train)
        for part in train-8k train-128k-tilelang train-128k-fla train-2b; do run_part $part; done
        ;;
    tp2)
        # every GPU test that needs two devices (today test_tp2_on_two_gpus_over_nccl_matches_unsharded)
        step pytest-tp2-nccl 240 60 "$PYTHON" -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout=200 \
            tests/qwen_hybrid/test_tensor_parallel.py tests/train/test_train_parallel.py
        step train-0.8B-128k-tp2sp "${TRAIN_TIMEOUT_S:-240}" 150 env OUT="$LOGS" TP=2 SP=1 \
            launch/benchmark.sh 0.8B 131072 tilelang ${TP2_OVERRIDES:-}
        ;;
    tp2-8k)
        step train-0.8B-8k-tp2 "${TRAIN_TIMEOUT_S:-240}" 150 env OUT="$LOGS" TP=2 \
            launch/benchmark.sh 0.8B 8192 tilelang ${TP2_OVERRIDES:-}
        ;;
    *)
        echo "unknown part '$1': tests, tests-model, walk-timeline, unverified, candidates, compare, compare-conv, fused-bench:FORM, fused-timeline:FORM, fused-tests:FORM, fused-spread:FORM, attention, bench, bench-warm, ncu, ncu-source," \
            "train-8k, train-32k, train-32k-compare, train-32k-compare-recompute, train-128k-compare, train-128k-tilelang, train-128k-fla, train-256k, train-384k, train-512k, train-2b, train," \
            "idle, timing-cost, checkpoint-layers, keep-levels, model-bench, model-bench-ab, model-vs-hf," \
            "tp2, tp2-8k" >&2
        SUMMARY+=("$(printf '%-22s %-9s' "$1" "UNKNOWN")")
        ;;
    esac
}

[ $# -eq 0 ] && set -- tests
for part in "$@"; do run_part "$part" || true; done

# Each run's last metrics line is its summary (step time, tokens/s, peak memory).
for metrics in "$LOGS"/metrics-*.jsonl; do
    [ -f "$metrics" ] || continue
    SUMMARY+=("$(basename "$metrics" .jsonl): $(grep run_summary "$metrics" | tail -1 | cut -c1-400)")
done
# a second script in the same call adds its logs to the first one's tarball
[ -f "$OUT/logs.tgz" ] && tar -xzf "$OUT/logs.tgz" -C "$OUT"
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
tar -czf "$OUT/tritoncache.tgz" -C /tmp "$(basename "$TRITON_CACHE_DIR")"
{
    echo "device_session $* : $((SECONDS - STARTED)) s of ${BUDGET_S} s"
    printf '%-22s %-9s %6s  %s\n' step status time "last line"
    printf '%s\n' "${SUMMARY[@]}"
} | tee "$OUT/summary.txt"
