"""``ds4lab doctor`` command line (``add_arguments`` / ``main`` for ``ds4lab/cli.py``)."""
from __future__ import annotations

import sys

from ds4lab.config.stacks import stacks
from ds4lab.doctor.checks import CHECKS, run_doctor
from ds4lab.doctor.context import _serve_profiles, split_server_cmd
from ds4lab.doctor.report import text_header, text_row

__all__ = ["add_arguments", "main"]


def add_arguments(p) -> None:
    p.add_argument("--profile", choices=sorted(set(stacks()) | set(_serve_profiles())), default=None,
                   help="stack from ds4lab/config/stacks.toml, or a ds4lab serve profile meaning its stack "
                        "(tiny-cpu = cpu) (default: from this machine; cpu without CUDA)")
    p.add_argument("--python", default=None, help="interpreter of the server's venv to check (default: this one)")
    p.add_argument("--hf-cache", default=None,
                   help="hub cache folder (default: huggingface_hub's resolution); a missing folder is reported")
    p.add_argument("--server-cmd", default=None,
                   help="the intended server command line, quoted once (default: the profile's flags)")
    p.add_argument("--only", action="append", choices=list(CHECKS), help="run only this check (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args) -> int:
    """Text mode streams: a progress line on stderr at once, then the header and each row on stdout
    as soon as that check finishes (the probes take 10-20 s); ``--json`` prints one document at the end."""
    kw = dict(profile=args.profile, python=args.python, hf_cache=args.hf_cache, server_argv=args.server_cmd,
              only=args.only)
    if args.json:
        rep = run_doctor(**kw)
        print(rep.to_json())
        return 0 if rep.ok else 1
    if isinstance(args.server_cmd, str):
        split_server_cmd(args.server_cmd)  # an input error names --server-cmd before anything is printed
    print(f"ds4lab doctor: probing {args.python or sys.executable} (packages, devices, an sm_89 Triton "
          "compile; 10-20 s) ...", file=sys.stderr, flush=True)
    w_name = max(len(n) for n in (args.only or CHECKS))
    rep = run_doctor(**kw, on_context=lambda ctx: print(text_header(ctx.profile_name, ctx.python) + "\n", flush=True),
                     on_result=lambda r: print(text_row(r, w_name), flush=True))
    print("\n" + rep.text_footer(), flush=True)
    return 0 if rep.ok else 1
