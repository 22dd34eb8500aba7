#!/usr/bin/env bash
# Session 19, final lease, call 2 (world 2): verification part 2 on the final library commit.
set -uo pipefail
P=2 BUDGET=590 COMMIT=$1 bash diag/w11/call.sh $2
