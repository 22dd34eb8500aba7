#!/usr/bin/env bash
# Session 16: the early-signal A/B (callx.sh), then compare with what is left.
set -uo pipefail
OUT=$1; SECONDS=0
bash diag/w10/callx.sh $OUT
P=c BUDGET=$(( 585 - SECONDS )) bash diag/w10/call.sh $OUT
