#!/usr/bin/env bash
# Replays every shipped trace and snapshot (plus generated full-size traces) on sim and host,
# with and without --gpu-lag, and writes one JSON per run with wall-clock keys removed, so a
# refactor can be proven to change no figure: run before and after, then `diff -r`.
# usage: scripts/replay-baseline.sh OUT_DIR [STITCH_BIN]   (build: cargo build --release --features cli)
set -euo pipefail
out=${1:?usage: replay-baseline.sh OUT_DIR [STITCH_BIN]}
bin=${2:-target/release/stitch}
mkdir -p "$out"
# Generated traces at a fixed path, so the reports name the same file in every run.
gen=/tmp/stitch-replay-baseline-traces
mkdir -p "$gen"
for k in llm train checkerboard adversarial; do
    "$bin" gen "$k" --seed 1 --out "$gen/$k-full.trace.gz" >/dev/null
done
strip='del(.. | .wall_s?, .wall_ms?, .wall_time_s?, .events_per_s?, .events_per_second?, .wall_us?) '
for f in tests/data/*.trace tests/data/*.trace.gz tests/data/*.pickle tests/data/zoo/*.pickle.gz "$gen"/*-full.trace.gz; do
    name=$(basename "$f")
    for backend in sim host; do
        for lag in 0 1000; do
            # The host backend needs real memory; keep its capacity modest for full traces.
            extra=()
            "$bin" replay "$f" --json --backend "$backend" --gpu-lag "$lag" "${extra[@]}" \
                >"$out/$name.$backend.lag$lag.raw.json" 2>"$out/$name.$backend.lag$lag.err" || true
            python3 - "$out/$name.$backend.lag$lag.raw.json" >"$out/$name.$backend.lag$lag.json" <<'PY'
import json, sys, re
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("unreadable:", e); sys.exit(0)
def scrub(x):
    if isinstance(x, dict):
        return {k: scrub(v) for k, v in x.items() if not re.search(r"wall|per_s|per_second|elapsed|seconds_real", k)}
    if isinstance(x, list):
        return [scrub(v) for v in x]
    return x
print(json.dumps(scrub(d), indent=1, sort_keys=True))
PY
            rm -f "$out/$name.$backend.lag$lag.raw.json"
        done
    done
done
echo "wrote $(ls "$out"/*.json | wc -l) reports to $out"
