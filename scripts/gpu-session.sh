#!/usr/bin/env bash
# One device-machine session: everything that needs the GPU, in one or two calls.
#
# Here (build machine):   scripts/gpu-session.sh build
#   builds .gpu/ with scripts/gpu-check.sh, adds the C library, the stitch binary and the full
#   generated traces; the folder travels with the device tool's `carry: [".gpu"]`.
# There (GPU machine, repo root, no cargo):
#   bash scripts/gpu-session.sh suite    # tests (GPU ones included and required: a missing GPU
#                                        # fails them), memcheck, GPU benches, trace replays,
#                                        # examples/cuda_server, Python tests
#   bash scripts/gpu-session.sh torch    # scripts/torch-validate.py (PyTorch default vs
#                                        # expandable segments vs stitch-alloc, fresh processes)
#   bash scripts/gpu-session.sh zoo [args]  # scripts/torch-zoo.py --record: the workload zoo,
#                                        # snapshots packed into $OUT/zoo-snapshots.tgz
#   bash scripts/gpu-session.sh throughput [args] # scripts/torch-zoo.py --fixed-shapes: step
#                                        # times, default against stitch-alloc, one process at a
#                                        # time, 5 each, median and 95% interval of the speed
#   bash scripts/gpu-session.sh dropin [args] # scripts/torch-dropin.py: torch's memory API,
#                                        # OOM, cuDNN, torch.compile, graphs, history, IPC
#                                        # under default and stitch-alloc, one line per case
#   bash scripts/gpu-session.sh allocpair [args] # scripts/torch-alloc-pair.py: PyTorch's
#                                        # allocator and stitch-alloc's C ABI, ns per malloc +
#                                        # free pair, alternating rounds in one process
#   AB_B=conf bash scripts/gpu-session.sh ab # the zoo under two STITCH_ALLOC_CONF settings,
#                                        # alternating (AB_A, AB_B, AB_REPEAT), medians side by side
#   bash scripts/gpu-session.sh clients [args] # scripts/torch-clients.py: real clients unchanged
#                                        # (timm, Lightning, transformers generate/Trainer, peft,
#                                        # torch.compile) under default and stitch-alloc, results
#                                        # compared, memory side by side
#   bash scripts/gpu-session.sh verify   # after an engine change, in one call of under 600 s:
#                                        # step times in one process against PyTorch default (moe:
#                                        # the loop region; bert-encode: the pair's cost in the
#                                        # step), then the whole zoo and every
#                                        # holdout once under stitch-alloc with unet-denoise and
#                                        # llm-train-l three times (memory); the suite is a second
#                                        # call, `dropin` and `zoo --workloads holdout5` a third,
#                                        # `zoo --configs default --workloads holdout,holdout2,
#                                        # holdout3,holdout4` (the holdout histories) a fourth
#                                        # (design/zoo.md, "Thirty-third session")
# Logs and results go to $OUT (or ./gpu-logs), packed into one tarball plus a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
out=${OUT:-$(pwd)/gpu-logs}
mkdir -p "$out"

case "$mode" in
build)
    set -e
    bash scripts/gpu-check.sh build
    cargo build --release --lib --bins --features cli,capi
    cp target/release/libstitch_alloc.so .gpu/
    # examples/cuda_server.rs: Allocator<CudaDriver> on cudarc streams with a PTX kernel.
    cargo build --release --example cuda_server
    cp target/release/examples/cuda_server .gpu/
    strip .gpu/libstitch_alloc.so
    mkdir -p .gpu/traces
    ./target/release/stitch gen llm --seed 1 --out .gpu/traces/llm.trace.gz
    ./target/release/stitch gen checkerboard --seed 1 --out .gpu/traces/checkerboard.trace.gz
    git rev-parse --short HEAD >.gpu/COMMIT
    du -sh .gpu
    ;;
suite)
    logs=$(mktemp -d)
    # GPU tests are #[ignore]d for plain `cargo test`; run.sh runs them with
    # --include-ignored, and STITCH_REQUIRE_GPU=1 makes one that finds no GPU fail.
    STITCH_REQUIRE_GPU=1 OUT=$logs bash .gpu/run.sh run 2>&1 | tee "$out/suite-summary.txt" | tail -40
    stitch=.gpu/bin/stitch
    [ -x "$stitch" ] || stitch=$(ls .gpu/bin/stitch* 2>/dev/null | head -1)
    {
        echo "== stitch info"
        "$stitch" info --backend cuda
        for t in .gpu/traces/llm.trace.gz .gpu/traces/checkerboard.trace.gz tests/data/*.trace* tests/data/torch-small.pickle.gz; do
            for flag in "" --no-stitch; do
                echo "== replay $t $flag (cuda)"
                "$stitch" replay "$t" --backend cuda $flag --json
                echo
            done
        done
        echo "== demo on the GPU"
        "$stitch" demo --backend cuda
        echo "== examples/cuda_server (a Rust server on two CUDA streams, PTX kernel)"
        .gpu/cuda_server
        echo "cuda_server exit $?"
    } >"$logs/replays.txt" 2>&1
    tail -c 3000 "$logs/replays.txt"
    echo "== python tests"
    STITCH_ALLOC_LIB=$(pwd)/.gpu/libstitch_alloc.so PYTHONUNBUFFERED=1 \
        timeout 300 python3 -m pytest python/tests -v -s -rs >"$logs/pytest.txt" 2>&1
    echo "pytest exit $?"
    tail -25 "$logs/pytest.txt"
    cp "$logs/replays.txt" "$out/replays.txt"
    tar czf "$out/suite-logs.tgz" -C "$logs" .
    ;;
torch)
    STITCH_ALLOC_LIB=$(pwd)/.gpu/libstitch_alloc.so PYTHONUNBUFFERED=1 \
        timeout "${TORCH_TIMEOUT:-540}" python3 scripts/torch-validate.py --out "$out/torch-validate.json" \
        "${@:2}" 2>&1 | tee "$out/torch-validate.txt" | tail -60
    ;;
zoo)
    zoo=$(mktemp -d)
    STITCH_ALLOC_LIB=$(pwd)/.gpu/libstitch_alloc.so PYTHONUNBUFFERED=1 \
        timeout "${ZOO_TIMEOUT:-560}" python3 scripts/torch-zoo.py --out "$zoo" --record "${@:2}" 2>&1 |
        tee "$out/zoo.txt" | tail -80
    cp "$zoo/zoo.json" "$zoo/zoo.md" "$out/" 2>/dev/null
    # Files come back at most 16 MiB each: the tarball in 15 MiB parts (cat them to unpack).
    [ -d "$zoo/snapshots" ] && tar cf - -C "$zoo" snapshots | split -b 15m - "$out/zoo-snapshots.tar.part-" &&
        ls -la "$out"
    ;;
throughput)
    tp=$(mktemp -d)
    # THROUGHPUT_CPUS (a taskset list, e.g. 2-5): every run on the same cores, so that the
    # processes differ in their allocator rather than in where the scheduler put them.
    pin=()
    [ -n "${THROUGHPUT_CPUS:-}" ] && pin=(taskset -c "$THROUGHPUT_CPUS")
    echo "cpus: ${THROUGHPUT_CPUS:-any}; $(nproc --all) online; governor $(cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null || echo unknown)" | tee "$out/throughput-cpus.txt"
    STITCH_ALLOC_LIB=$(pwd)/.gpu/libstitch_alloc.so PYTHONUNBUFFERED=1 \
        timeout "${THROUGHPUT_TIMEOUT:-560}" "${pin[@]}" python3 scripts/torch-zoo.py --out "$tp" --fixed-shapes \
        --workloads "${THROUGHPUT_WORKLOADS:-llm-train-s,bert-encode}" --configs default,stitch \
        --repeat "${THROUGHPUT_REPEAT:-5}" --jobs 1 "${@:2}" 2>&1 | tee "$out/throughput.txt" | tail -30
    cp "$tp/zoo.json" "$out/throughput.json" 2>/dev/null
    ;;
allocpair)
    # PyTorch's allocator and stitch-alloc's C ABI per malloc + free pair in one process
    # (scripts/torch-alloc-pair.py: builds a small C++ extension first, about a minute).
    PYTHONUNBUFFERED=1 timeout "${ALLOCPAIR_TIMEOUT:-400}" python3 scripts/torch-alloc-pair.py \
        --lib "$(pwd)/.gpu/libstitch_alloc.so" "${@:2}" 2>&1 | tee "$out/allocpair.txt" | tail -20
    ;;
ab)
    # One stitch-alloc setting against another through torch (the simulator shortlists,
    # torch decides: design/zoo.md): AB_A and AB_B are STITCH_ALLOC_CONF strings, run
    # alternately AB_REPEAT times each over the zoo (AB_WORKLOADS, default all), then the
    # median per workload and the geometric mean of each side. About 140 s per side and
    # repeat at --jobs 4 (AB_JOBS; memory figures only: driver times need --jobs 1).
    a_conf=${AB_A:-backend:cuda,log:error}
    b_conf=${AB_B:?AB_B: the STITCH_ALLOC_CONF to compare, e.g. backend:cuda,log:error,small_threshold:256KiB}
    for r in $(seq 1 "${AB_REPEAT:-1}"); do
        for side in a b; do
            conf=$a_conf
            [ "$side" = b ] && conf=$b_conf
            STITCH_ALLOC_LIB=$(pwd)/.gpu/libstitch_alloc.so PYTHONUNBUFFERED=1 \
                timeout "${AB_TIMEOUT:-280}" python3 scripts/torch-zoo.py --out "$out/ab-$side-$r" \
                --configs stitch --jobs "${AB_JOBS:-4}" --stitch-conf "$conf" \
                ${AB_WORKLOADS:+--workloads "$AB_WORKLOADS"} 2>&1 | grep -E "ratio=|Error" | sed "s/^/$side$r /"
        done
    done
    python3 - "$out" "$a_conf" "$b_conf" <<'PY'
import glob, json, math, os, statistics, sys
out, confs = sys.argv[1], {"a": sys.argv[2], "b": sys.argv[3]}
ratios = {"a": {}, "b": {}}
for side in "ab":
    for f in glob.glob(os.path.join(out, f"ab-{side}-*", "zoo.json")):
        for r in json.load(open(f))["results"]:
            m = r.get("memory") or {}
            if r.get("ok") and m.get("reserved_over_requested"):
                ratios[side].setdefault(r["workload"], []).append(m["reserved_over_requested"])
print("| workload | A runs | B runs | A median | B median |")
print("|---|---|---|---|---|")
common = sorted(set(ratios["a"]) & set(ratios["b"]))
for w in common:
    a, b = ratios["a"][w], ratios["b"][w]
    print(f"| {w} | {', '.join(f'{x:.4f}' for x in a)} | {', '.join(f'{x:.4f}' for x in b)} "
          f"| {statistics.median(a):.4f} | {statistics.median(b):.4f} |")
for side in "ab":
    if common:
        g = math.exp(statistics.fmean(math.log(statistics.median(ratios[side][w])) for w in common))
        print(f"{side.upper()} ({confs[side]}): geometric mean of the medians {g:.4f} over {len(common)}")
PY
    ;;
soak)
    # scripts/torch-soak.py: 8 threads for ${SOAK_SECONDS:-180} s, then a short run under
    # compute-sanitizer memcheck (4 threads, 10 s).
    STITCH_ALLOC_LIB=$(pwd)/.gpu/libstitch_alloc.so PYTHONUNBUFFERED=1 \
        timeout $((${SOAK_SECONDS:-180} + 150)) python3 scripts/torch-soak.py --seconds "${SOAK_SECONDS:-180}" \
        2>&1 | tee "$out/soak.txt" | tail -12
    echo "soak exit ${PIPESTATUS[0]}"
    if command -v compute-sanitizer >/dev/null; then
        STITCH_ALLOC_LIB=$(pwd)/.gpu/libstitch_alloc.so PYTHONUNBUFFERED=1 \
            timeout 240 compute-sanitizer --tool memcheck --error-exitcode 97 \
            python3 scripts/torch-soak.py --seconds 10 --threads 4 2>&1 | tee "$out/soak-memcheck.txt" | tail -8
        echo "memcheck soak exit ${PIPESTATUS[0]}"
    fi
    ;;
wait)
    # Issue #13 item 8 before and after: the same GPU test built from main before the change
    # (.gpu/bin/gpu_before, if carried) and now.
    for b in gpu_before gpu; do
        [ -x ".gpu/bin/$b" ] || continue
        echo "== $b"
        (cd .gpu && STITCH_REQUIRE_GPU=1 timeout 120 "./bin/$b" --test-threads=1 --nocapture \
            --include-ignored gpu_fast_path_goes_on 2>&1 | grep -E "slow path waited|test result|panicked|fast-path pair")
    done 2>&1 | tee "$out/wait.txt"
    ;;
dropin)
    STITCH_ALLOC_LIB=$(pwd)/.gpu/libstitch_alloc.so PYTHONUNBUFFERED=1 \
        timeout "${DROPIN_TIMEOUT:-580}" python3 scripts/torch-dropin.py --out "$out/torch-dropin.json" \
        "${@:2}" 2>&1 | tee "$out/torch-dropin.txt" | tail -40
    ;;
clients)
    STITCH_ALLOC_LIB=$(pwd)/.gpu/libstitch_alloc.so PYTHONUNBUFFERED=1 \
        timeout "${CLIENTS_TIMEOUT:-580}" python3 scripts/torch-clients.py --out "$out/torch-clients.json" \
        "${@:2}" 2>&1 | tee "$out/torch-clients.txt" | tail -60
    ;;
verify)
    # Carry only .gpu/libstitch_alloc.so and .gpu/COMMIT for this mode. About 200 s + 330 s.
    export STITCH_ALLOC_LIB=$(pwd)/.gpu/libstitch_alloc.so PYTHONUNBUFFERED=1
    echo "library of $(cat .gpu/COMMIT 2>/dev/null || echo '?'); $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
    timeout "${VERIFY_SPEED_TIMEOUT:-220}" python3 scripts/torch-inproc-speed.py --lib "$STITCH_ALLOC_LIB" \
        --workloads "${VERIFY_SPEED:-moe,bert-encode}" --rounds 12 --steps 10 --alloc-clock 3 \
        >"$out/verify-speed.txt" 2>&1
    echo "speed exit $?"
    tail -30 "$out/verify-speed.txt"
    # VERIFY_PASSES: which zoo passes follow the speed run ("" for the speed run alone).
    for pass in ${VERIFY_PASSES-all repeat}; do
        if [ "$pass" = all ]; then
            w=zoo,holdout,holdout2,holdout3,holdout4 r=1 t=${VERIFY_ZOO_TIMEOUT:-210}
        else
            w=${VERIFY_REPEAT:-unet-denoise,llm-train-l} r=2 t=${VERIFY_REPEAT_TIMEOUT:-120}
        fi
        timeout "$t" python3 scripts/torch-zoo.py --configs stitch --jobs 4 --repeat "$r" \
            --timeout $((t - 10)) --workloads "$w" --out "$out/verify-$pass" \
            >"$out/verify-$pass.txt" 2>&1
        echo "zoo ($pass) exit $?"
        grep -E "ratio=|Error" "$out/verify-$pass.txt" | tail -40
    done
    ;;
*)
    echo "usage: $0 build|suite|torch|zoo|throughput|ab|soak|wait|dropin|clients|verify" >&2
    exit 2
    ;;
esac
