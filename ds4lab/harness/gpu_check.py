"""What the GPU check scripts (``scripts/gpu/*_check.py``, ``compress_1l.py``) share: the command line and
build set-up, the PASS/FAIL rows they write, and the tensor copies their bit-identity checks compare.

- :func:`setup`: ``--arch native|sm89`` and ``--out`` (default ``$OUT``, else ``.``) plus the script's own
  options, the build chosen before triton is imported (``bench._setup_build``), and without CUDA the
  Triton CPU interpreter installed (a smoke run of the script's own logic on small shapes);
- :class:`Checks`: rows ``{build, check, what, status, detail}``; :meth:`Checks.attempt` records an
  exception as a FAIL row, so one failing candidate does not stop the rest; written as one CSV per build;
- :func:`clone_inputs` / :func:`cache_bytes`: copies that keep a tensor's strides, and the bytes a
  (possibly padded) cache tensor spans, for byte-for-byte comparisons of two launch paths.

Runs on the H200 image's python3 (torch, triton; nothing else); torch is imported inside the functions so
that :func:`setup` can set the build first.
"""
from __future__ import annotations

import argparse
import csv
import os

__all__ = ["setup", "Checks", "clone_inputs", "cache_bytes"]


def setup(argv, description: str, add_arguments=None,
          default_arch: str = "native") -> tuple[argparse.Namespace, bool]:
    """Parse ``argv`` (None: ``sys.argv``): ``--arch`` (``native`` | ``sm89``, default ``default_arch``),
    ``--out`` and whatever ``add_arguments(parser)`` adds; set the build up (before triton is imported);
    without a CUDA device set ``TRITON_INTERPRET=1`` and install ds4lab's interpreter fixes.

    Returns ``(args, gpu)``: ``gpu`` is ``torch.cuda.is_available()``. Raises SystemExit on bad arguments
    (argparse), ValueError from ``bench._setup_build`` on an unknown build."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--arch", default=default_arch, choices=["native", "sm89"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args(argv)
    from ds4lab.harness.bench import _setup_build
    _setup_build(args.arch)
    import torch
    gpu = torch.cuda.is_available()
    if not gpu:   # a smoke run of the script's logic on the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        from ds4lab import interp
        interp.install()
    return args, gpu


class Checks:
    """The PASS/FAIL rows of one build (``build``: the ``--arch`` value). A FAIL row is also printed at
    once: ``FAIL <check> <what> <detail>``, check and what padded to ``widths`` characters."""

    def __init__(self, build: str, widths: tuple[int, int] = (9, 60)):
        self.build = build
        self.widths = widths
        self.rows: list[dict] = []

    def row(self, check: str, what: str, ok, detail="") -> None:
        """Record one check (``detail`` cut to 160 characters)."""
        self.rows.append({"build": self.build, "check": check, "what": what, "status": "PASS" if ok else "FAIL",
                          "detail": str(detail)[:160]})
        if not ok:
            wc, ww = self.widths
            print(f"FAIL {check:<{wc}} {what:<{ww}} {self.rows[-1]['detail']}", flush=True)

    def attempt(self, check: str, what: str, fn) -> None:
        """Run ``fn() -> (ok, detail)`` and record it; an exception is a FAIL row naming it."""
        try:
            ok, detail = fn()
        except Exception as e:   # one failing candidate must not stop the rest
            ok, detail = False, f"{type(e).__name__}: {e}"
        self.row(check, what, ok, detail)

    def failing(self) -> list[dict]:
        return [r for r in self.rows if r["status"] != "PASS"]

    def tally(self, key=lambda r: r["check"]) -> dict:
        """``{key(row): [n_fail, n_pass]}`` in first-seen order (the summary table's rows)."""
        by: dict = {}
        for r in self.rows:
            by.setdefault(key(r), [0, 0])[r["status"] == "PASS"] += 1
        return by

    def write_csv(self, out_dir: str, name: str) -> str:
        """Write the rows to ``out_dir/<name>_<build>.csv`` (the folder made if missing); returns the path.
        Raises IndexError when there are no rows (nothing ran: the caller's bug)."""
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{name}_{self.build}.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(self.rows[0]))
            w.writeheader()
            w.writerows(self.rows)
        return path


def clone_inputs(d: dict) -> dict:
    """A copy of a kernel's keyword inputs: every tensor cloned, a non-contiguous one with its strides
    (its whole span copied and re-viewed, so a strided view of a wider buffer stays that view's layout);
    other values as they are."""
    import torch
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor) and not v.is_contiguous() and v.numel():
            span = sum((n - 1) * s for n, s in zip(v.shape, v.stride())) + 1
            v = torch.as_strided(torch.as_strided(v, (span,), (1,)).clone(), v.shape, v.stride())
        elif isinstance(v, torch.Tensor):
            v = v.clone()
        out[k] = v
    return out


def cache_bytes(c):
    """A 3-D cache ``(blocks, ...)`` as the flat span of its storage from block 0 to the end of the last
    block (padding between blocks included: a stray write there shows); any other tensor as it is."""
    import torch
    return torch.as_strided(c, ((c.shape[0] - 1) * c.stride(0) + c[0].numel(),), (1,)) if c.dim() == 3 else c
