#!/usr/bin/env bash
# Session 16, final lease, call 2: verification part 1, then the dispatch-scaling probe.
set -uo pipefail
OUT=$1; SECONDS=0
P=1 BUDGET=355 COMMIT=$COMMIT bash diag/w10/call.sh $OUT
bash diag/w10/scale.sh $OUT
