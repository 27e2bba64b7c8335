#!/usr/bin/env bash
# Session 15, device call 4 (issue 20; ~2 min): the native build at batch 1 (plain and MTP) with the shipped narrow row
# (mmaq_n64s4xl, the loop scan) against the old one (ABBA, B = mmaq_n64s4x).
# Usage (device): OUT=DIR bash results/issue20/s15/run4.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
timeout 150 python3 -m ds4lab.harness.step --tp 4 --ctx 8192 --out "$OUT/b1_native_narrow" --arch native --batch 1 \
  --mode plain --mode mtp --abba --ab "moe_w4a16.DECODE_ROW_NARROW='mmaq_n64s4x'" > "$OUT/b1_native_narrow.log" 2>&1
echo "rc=$?"; grep -E "^TP=" "$OUT/b1_native_narrow.log"
