#!/usr/bin/env bash
# Runs the same deterministic cnr jobs into a fresh folder and prints one digest per job
# (scripts/store_digest.py): run it before and after a change that must not alter what cnr
# stores, and compare the two outputs line by line. Sharding types are pinned: torchrec's planner
# may pick table_wise or column_wise for the same tables from one run to the next.
#   usage: scripts/store_digests.sh WORK_DIR [PYTHON]
# The cnr it runs is the one `python -m cnr` imports from the current folder: run it from the
# root of the checkout under test.
set -euo pipefail
work=${1:?usage: scripts/store_digests.sh WORK_DIR [PYTHON]}
py=${2:-.venv/bin/python}
here=$(cd "$(dirname "$0")/.." && pwd)
# beside the work folder (its path, recorded in the manifests, is left out of the digests)
tier="$work.tier"
rm -rf "$work" "$tier" && mkdir -p "$work"

run() {  # NAME ARGS... [--compact]
  local name=$1; shift
  local compact=0
  if [ "${@: -1}" = "--compact" ]; then compact=1; set -- "${@:1:$#-1}"; fi
  "$py" -m cnr train --config "$here/configs/tiny.yaml" --storage "$work/$name" \
    --set 'model.sharding_types=[table_wise]' "$@" \
    >"$work/$name.log" 2>&1 || { echo "$name: cnr train failed, see $work/$name.log" >&2; exit 1; }
  if [ $compact = 1 ]; then
    "$py" -m cnr compact "$work/$name" --keep-last 1 >>"$work/$name.log" 2>&1 \
      || { echo "$name: cnr compact failed, see $work/$name.log" >&2; exit 1; }
  fi
  echo "$name $("$py" "$here/scripts/store_digest.py" "$work/$name" --total)"
}

run full_fp32 --set checkpoint.policy=full
run incremental_4bit --set checkpoint.policy=intermittent --set checkpoint.bits=4 \
  --set train.steps=100
run two_ranks_8bit_optim --nproc 2 --set 'model.sharding_types=[column_wise]' --set checkpoint.policy=intermittent --set checkpoint.bits=8 \
  --set checkpoint.optimizer_bits=8 --set train.steps=100
# merging and retention inside a job run in the background, when they get to it, and a publish is
# skipped while the one before is in flight: so the job's chain is compacted offline, and
# publishing (timing-dependent) is not among these jobs
run consecutive_compacted --set checkpoint.policy=consecutive --set checkpoint.bits=8 \
  --set checkpoint.compaction=external --set checkpoint.keep_last=0 --set train.steps=120 --compact
run local_tier --set checkpoint.local_dir="$tier" --set train.steps=80
