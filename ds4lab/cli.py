"""``ds4lab`` command line: a thin face over the functions the notebooks call.

Each sub-command lives in its own module, which defines ``add_arguments(parser)`` and
``main(args) -> int``; this file only routes (modules import lazily so ``ds4lab --help`` is fast).
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("ds4lab.geometry_cli", "version banner and the model geometry's per-rank op shapes"),
    "aot": ("ds4lab.harness.aot", "compile every registered kernel config for sm_89/sm_90/sm_120 and report resources"),
    "bench": ("ds4lab.harness.bench", "check-then-time registered kernels on a CUDA GPU; append rows to results/"),
    "step": ("ds4lab.harness.step", "time the whole decode step per op group (CUDA graph; --cpu: tiny model on the interpreter)"),
    "tiny": ("ds4lab.checkpoint.tiny", "write the tiny DeepSeek-V4 checkpoint used as the embedded default"),
    "plan": ("ds4lab.planner.cli", "plan GPU memory: gpu-memory-utilization against KV headroom"),
    "serve": ("ds4lab.serve.cli", "launch the OpenAI-compatible vLLM server (MTP speculative decoding)"),
    "doctor": ("ds4lab.doctor.cli", "check the serving stack for the known traps"),
    "tour": ("ds4lab.tour", "run the notebook tour headless and write build/tour/index.html"),
}


def plain(text: str) -> str:
    """``text`` without reStructuredText inline markup (````literal````, ```ref```, ``:role:`x```), for
    terminal help taken from a docstring."""
    return re.sub(r"(?::[a-z]+:)?`{1,2}([^`]+)`{1,2}", r"\1", text)


def _available() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (mod, helptext) in COMMANDS.items():
        if importlib.util.find_spec(mod) is not None:
            out[name] = (mod, helptext)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="ds4lab", description=plain(__doc__.splitlines()[0]))
    sub = parser.add_subparsers(dest="command", required=True)
    cmds = _available()
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (mod, helptext) in cmds.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.set_defaults(_module=mod)
        if name == chosen:  # only the command being run is imported (one broken module cannot break the rest)
            importlib.import_module(mod).add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except (ValueError, KeyError, OSError) as e:  # bad input: one line naming it, not a traceback
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"ds4lab {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
