"""``ds4lab info``: the banner plus the geometry's per-rank op shapes."""
from __future__ import annotations

import json

from ds4lab.banner import env_banner
from ds4lab.geometry import SUPPORTED_TP, describe, layer_counts, load_config


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="config.json or checkpoint folder (default: official V4-Flash)")
    p.add_argument("--tp", type=int, action="append", help="tensor-parallel degree(s); default all")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")


def main(args) -> int:
    cfg = load_config(args.config)
    rows = describe(cfg, args.tp or SUPPORTED_TP)
    if args.json:
        print(json.dumps({"layers": layer_counts(cfg), "ops": rows}, indent=1))
        return 0
    print(env_banner())
    print("layers:", layer_counts(cfg))
    for r in rows:
        dims = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("op", "tp", "family", "replicated"))
        print(f"tp={r['tp']}  {r['op']:<18} {r['family']:<10} {dims}")
    return 0
