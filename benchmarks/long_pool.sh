#!/usr/bin/env bash
# Long tasks on a pool of the six multi-step families of the simulated desktop, with
# `arpo train`'s defaults, on five seeds chosen before any run (12-16, the default; they
# chose `prefill_demos_from_turns = 3`, which was then confirmed on the fresh seeds 22-26),
# then per-step success before and after training. Run alone (2 cores: about
# 10 minutes per seed and 3 per seed's probes). Resumable: finished seeds and probes are
# kept; delete a seed's folder to redo it.
#
#     benchmarks/long_pool.sh [OUT] [NAME] [extra arpo train arguments...]
#
# OUT (runs/long-pool/defaults) holds the runs; NAME (long-pool-defaults) names the results
# in benchmarks/results/NAME-<date>.{md,json,png} and NAME-steps-<date>.{md,json}.
# SEEDS=... picks other seeds; PROBES=0 skips the per-step probes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-runs/long-pool/defaults}
NAME=${2:-long-pool-defaults}
shift 2 || true
SEEDS=${SEEDS:-12,13,14,15,16}
DATE=${DATE:-$(date +%F)}
FAMILIES='["fill_form","list_select","click_sequence","type_submit","menu_pick","dialog_confirm"]'
$PY benchmarks/demo_runs.py --seeds "$SEEDS" --out "$OUT" \
    --extra "sim_families=$FAMILIES" sim_tasks_per_family=2 local_desktops=0 \
    learner.iterations=40 "$@" --save-as "$NAME-$DATE" ${PAIRED:+--paired-with "$PAIRED"}
[ "${PROBES:-1}" = 0 ] && exit 0
for s in ${SEEDS//,/ }; do
    run="$OUT/seed-$s"
    ckpt=$(ls -d "$run"/learner/checkpoints/ckpt-* | sort | tail -1)
    [ -f "$run/probe-warm.json" ] || $PY benchmarks/long_tasks.py probe --out "$run" \
        --temperatures 0.6 --runs 8 --name warm
    [ -f "$run/probe-trained.json" ] || $PY benchmarks/long_tasks.py probe --out "$run" \
        --model "$ckpt" --checkpoint --temperatures 0.6 --runs 8 --name trained
done
$PY benchmarks/long_tasks.py steps --runs "$OUT" --names warm,trained --save-as "$NAME-steps-$DATE"
