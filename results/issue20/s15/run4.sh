#!/usr/bin/env bash
# Session 15, device call 4 (issue 20; ~2 min): the native build at batch 1 (plain and MTP) with the shipped narrow row
# (mmaq_n64s4xl, the loop scan) against the old one (ABBA, B = mmaq_n64s4x).
# Usage (device): OUT=DIR bash results/issue20/s15/run4.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
. scripts/gpu/step_ab.sh   # step NAME TIMEOUT ARGS...
step b1_native_narrow 150 --arch native --batch 1 --mode plain --mode mtp --abba \
  --ab "moe_w4a16.DECODE_ROW_NARROW='mmaq_n64s4x'"
