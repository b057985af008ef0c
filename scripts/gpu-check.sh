#!/usr/bin/env bash
# Build the test binaries here, run them on a GPU machine that has no cargo.
#
#   scripts/gpu-check.sh build   # here, from the repo root: fills .gpu/ (git-ignored)
#   bash .gpu/run.sh run         # there, from the folder that holds .gpu/ (or any copy of it)
#
# build: compiles every test target in release mode, copies the test executables (and any
#        [[bin]] and bench executables) into .gpu/bin/, strips them, copies tests/data if it
#        exists, writes .gpu/manifest.tsv and .gpu/run.sh (a copy of this script), and prints
#        the total size (it must stay under about 60 MiB to travel).
# run:   prints an nvidia-smi summary, runs each test executable with --test-threads=1
#        --include-ignored and STITCH_REQUIRE_GPU=1 (the GPU tests are #[ignore]d so that a
#        plain `cargo test` without a GPU reports them as ignored, not passed; here they run,
#        and a GPU test that finds no CUDA device fails instead of printing SKIPPED)
#        (logs in $OUT/<name>.log when OUT is set, else ./gpu-logs/), runs the gpu test
#        executable again under compute-sanitizer memcheck when available (skipping the
#        tests that make deliberate failing API calls), and gpu_invariants under memcheck
#        with a few cases; the GPU bench executables (bench-gpu*) run with short criterion
#        settings after the tests and before the memcheck runs. It prints a summary table
#        (and the benches' own summaries) and exits non-zero if anything failed.
#
# Environment: CARGO_TARGET_DIR (build) is honoured; GPU_DIR (run) overrides the folder with
# bin/ and manifest.tsv (default: the folder of this script when it holds them, else ./.gpu).
# GPU_TESTS (run): space-separated test executables to run (default: all of them);
# GPU_BENCHES (run): bench executables to run (default: every bench-gpu*; "none" for none);
# BENCH_ARGS (run): criterion arguments (default: --warm-up-time 1 --measurement-time 3);
# MEMCHECK_CASES (run): proptest cases per test for gpu_invariants under memcheck (default 8,
# 0 to skip that run); GPU_TIMEOUT (run): seconds each executable may run before it is
# killed and counted as failed (default: no limit); STITCH_REQUIRE_GPU (run): 1 by default,
# set it to 0 only to try the bundle on a machine without a GPU (GPU tests then skip).
set -euo pipefail

MAX_MIB=60

die() {
    echo "gpu-check: $*" >&2
    exit 2
}

build() {
    [ -f Cargo.toml ] || die "run 'build' from the repository root"
    command -v python3 >/dev/null || die "python3 is needed to read cargo's JSON"
    local out=.gpu
    rm -rf "$out"
    mkdir -p "$out/bin"
    : >"$out/manifest.tsv"

    # Lists "kind<TAB>name<TAB>path" for every executable artifact in cargo's JSON on stdin.
    local parse='
import json, sys
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("{"):
        continue
    m = json.loads(line)
    exe = m.get("executable")
    if m.get("reason") != "compiler-artifact" or not exe:
        continue
    t = m["target"]
    kinds = t["kind"]
    if "bench" in kinds:
        kind, name = "bench", "bench-" + t["name"]
    elif m["profile"]["test"]:
        kind = "test"
        name = "unit-" + t["name"] if ("lib" in kinds or "bin" in kinds) else t["name"]
    elif "bin" in kinds:
        kind, name = "bin", t["name"]
    else:
        continue
    print(kind, name, exe, sep="\t")
'
    echo "== cargo test --release --no-run"
    local list
    list=$(cargo test --release --no-run --message-format=json | python3 -c "$parse")
    echo "== cargo build --release --features cli,capi --bins --benches"
    list+=$'\n'$(cargo build --release --features cli,capi --bins --benches --message-format=json | python3 -c "$parse")

    local kind name path n=0
    while IFS=$'\t' read -r kind name path; do
        [ -n "${kind:-}" ] || continue
        # A bench built by `cargo test` as a test and again by `cargo build`: keep one.
        grep -qxF "$name" <(cut -f2 "$out/manifest.tsv") && continue
        cp "$path" "$out/bin/$name"
        strip "$out/bin/$name" 2>/dev/null || echo "warning: could not strip $name" >&2
        printf '%s\t%s\n' "$kind" "$name" >>"$out/manifest.tsv"
        n=$((n + 1))
    done <<<"$list"
    [ "$n" -gt 0 ] || die "no executables found"

    if [ -d tests/data ]; then
        mkdir -p "$out/tests"
        cp -r tests/data "$out/tests/data"
    fi
    cp "${BASH_SOURCE[0]}" "$out/run.sh"
    chmod +x "$out/run.sh" "$out"/bin/*
    git rev-parse HEAD >"$out/COMMIT" 2>/dev/null || true

    echo "== $out/manifest.tsv"
    cat "$out/manifest.tsv"
    local bytes mib
    bytes=$(du -sb "$out" | cut -f1)
    mib=$(((bytes + 1048575) / 1048576))
    echo "== $out holds $n executable(s), $mib MiB ($bytes bytes)"
    [ "$mib" -le "$MAX_MIB" ] || die "$out is $mib MiB, over the $MAX_MIB MiB limit"
}

# Prints "passed failed ignored" summed over every libtest "test result:" line of a log.
counts() {
    awk '/^test result:/ {
            for (i = 1; i <= NF; i++) {
                if ($(i) ~ /^passed;?$/) p += $(i - 1)
                if ($(i) ~ /^failed;?$/) f += $(i - 1)
                if ($(i) ~ /^ignored;?$/) g += $(i - 1)
            }
         }
         END { printf "%d %d %d\n", p, f, g }' "$1"
}

run() {
    local dir="${GPU_DIR:-}"
    if [ -z "$dir" ]; then
        dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
        [ -f "$dir/manifest.tsv" ] || dir=$(pwd)/.gpu
    fi
    [ -f "$dir/manifest.tsv" ] || die "no manifest.tsv in $dir: run 'build' first"
    local logs="${OUT:-$(pwd)/gpu-logs}"
    mkdir -p "$logs"
    logs=$(cd "$logs" && pwd)

    echo "== GPU"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used \
            --format=csv || true
    else
        echo "nvidia-smi not found"
    fi
    [ -f "$dir/COMMIT" ] && echo "built from commit $(cat "$dir/COMMIT")"

    local rows=() any_fail=0 kind name rc p f g s secs t0 log tmo=()
    [ -n "${GPU_TIMEOUT:-}" ] && tmo=(timeout "$GPU_TIMEOUT")
    # A GPU test without a GPU fails here (see tests/common/mod.rs, gpu_or_skip).
    STITCH_REQUIRE_GPU="${STITCH_REQUIRE_GPU:-1}"
    export STITCH_REQUIRE_GPU
    echo "STITCH_REQUIRE_GPU=$STITCH_REQUIRE_GPU"
    # The CLI tests run the bundled binary, not the build machine's target/ path.
    STITCH_BIN="$(cd "$dir" && pwd)/bin/stitch"
    export STITCH_BIN
    while IFS=$'\t' read -r kind name; do
        [ "$kind" = test ] || continue
        if [ -n "${GPU_TESTS:-}" ] && ! grep -qw -- "$name" <<<"$GPU_TESTS"; then
            continue
        fi
        log="$logs/$name.log"
        echo "== $name"
        t0=$(date +%s.%N)
        set +e
        (cd "$dir" && ${tmo[@]+"${tmo[@]}"} "./bin/$name" --test-threads=1 --nocapture \
            --include-ignored) >"$log" 2>&1
        rc=$?
        set -e
        secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
        cat "$log"
        read -r p f g < <(counts "$log")
        s=$(grep -c 'SKIPPED (' "$log" || true)
        [ "$rc" -eq 0 ] && [ "$f" -eq 0 ] || any_fail=1
        rows+=("$(printf '%-32s %7s %7s %7s %8s %5s %8s' "$name" "$p" "$f" "$g" "$s" "$rc" "${secs}s")")
    done <"$dir/manifest.tsv"

    # GPU benches (criterion): a bench "passes" when it exits 0.
    local bench_logs=()
    while IFS=$'\t' read -r kind name; do
        [ "$kind" = bench ] || continue
        if [ -n "${GPU_BENCHES:-}" ]; then
            grep -qw -- "$name" <<<"$GPU_BENCHES" || continue
        else
            case "$name" in bench-gpu*) ;; *) continue ;; esac
        fi
        log="$logs/$name.log"
        echo "== $name"
        t0=$(date +%s.%N)
        set +e
        # shellcheck disable=SC2086
        (cd "$dir" && CRITERION_HOME="${TMPDIR:-/tmp}/criterion" ${tmo[@]+"${tmo[@]}"} \
            "./bin/$name" --bench \
            ${BENCH_ARGS:---warm-up-time 1 --measurement-time 3}) >"$log" 2>&1
        rc=$?
        set -e
        secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
        cat "$log"
        s=$(grep -c 'SKIPPED (' "$log" || true)
        g=0
        if [ "$rc" -eq 0 ]; then p=1 f=0; else p=0 f=1 any_fail=1; fi
        rows+=("$(printf '%-32s %7s %7s %7s %8s %5s %8s' "$name" "$p" "$f" "$g" "$s" "$rc" "${secs}s")")
        bench_logs+=("$log")
    done <"$dir/manifest.tsv"

    # The GPU tests again under memcheck, without the tests that fail API calls on purpose.
    if command -v compute-sanitizer >/dev/null && [ -x "$dir/bin/gpu" ]; then
        name=gpu-memcheck
        log="$logs/$name.log"
        echo "== $name"
        t0=$(date +%s.%N)
        set +e
        (cd "$dir" && ${tmo[@]+"${tmo[@]}"} compute-sanitizer --tool memcheck --error-exitcode 97 \
            ./bin/gpu --test-threads=1 --nocapture --include-ignored \
            --skip gpu_errors_are_values --skip gpu_oom_) \
            >"$log" 2>&1
        rc=$?
        set -e
        secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
        cat "$log"
        read -r p f g < <(counts "$log")
        s=$(grep -c 'SKIPPED (' "$log" || true)
        [ "$rc" -eq 0 ] && [ "$f" -eq 0 ] || any_fail=1
        rows+=("$(printf '%-32s %7s %7s %7s %8s %5s %8s' "$name" "$p" "$f" "$g" "$s" "$rc" "${secs}s")")
    else
        echo "== compute-sanitizer not found (or no gpu binary): memcheck run skipped"
    fi

    # The GPU invariants under memcheck, a few cases each: random stream hazards with real
    # work in flight, where an early unmap would be an illegal access.
    if command -v compute-sanitizer >/dev/null && [ -x "$dir/bin/gpu_invariants" ] &&
        [ "${MEMCHECK_CASES:-8}" != 0 ]; then
        name=gpu_invariants-memcheck
        log="$logs/$name.log"
        echo "== $name"
        t0=$(date +%s.%N)
        set +e
        (cd "$dir" && PROPTEST_CASES="${MEMCHECK_CASES:-8}" ${tmo[@]+"${tmo[@]}"} \
            compute-sanitizer --tool memcheck \
            --error-exitcode 97 ./bin/gpu_invariants --test-threads=1 --nocapture \
            --include-ignored) >"$log" 2>&1
        rc=$?
        set -e
        secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
        cat "$log"
        read -r p f g < <(counts "$log")
        s=$(grep -c 'SKIPPED (' "$log" || true)
        [ "$rc" -eq 0 ] && [ "$f" -eq 0 ] || any_fail=1
        rows+=("$(printf '%-32s %7s %7s %7s %8s %5s %8s' "$name" "$p" "$f" "$g" "$s" "$rc" "${secs}s")")
    fi

    {
        local bl
        for bl in ${bench_logs[@]+"${bench_logs[@]}"}; do
            # The bench's own summary: everything from its first "== gpu bench summary" line.
            sed -n '/^== gpu bench summary/,$p' "$bl"
        done
        echo "== summary"
        printf '%-32s %7s %7s %7s %8s %5s %8s\n' binary passed failed ignored skipped exit time
        printf '%s\n' "${rows[@]}"
        if [ "$any_fail" -eq 0 ]; then echo "ALL PASSED"; else echo "SOME FAILED"; fi
    } | tee "$logs/summary.txt"
    return "$any_fail"
}

case "${1:-}" in
build) build ;;
run) run ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
