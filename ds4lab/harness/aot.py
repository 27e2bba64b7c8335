"""sm_89 / sm_90 / sm_120 compile report: every registered (kernel, config), compiled ahead of time
on a machine with no GPU, with the resources and matrix instructions ptxas produced.

How: the real launcher is called on CPU tensors while ``JITFunction.run`` is replaced by a
compile-only hook. The hook uses Triton's own binder for a ``GPUTarget("cuda", cc, 32)`` backend,
so the signature, constexprs and divisibility hints (``tt.divisibility`` from pointer alignment and
integer values) are exactly what the JIT would use on that GPU with those arguments. Each compiled
kernel's cubin is inspected with the wheel's ``cuobjdump`` (registers, local memory, SASS) and its
PTX re-assembled with ``ptxas -v`` (the ptxas Triton itself uses for that target: the wheel's
``ptxas-blackwell`` from sm_100 on) for spill bytes.

A row fails when shared memory exceeds the target's per-block opt-in limit
(``ds4lab_kernels._arch.SMEM_LIMIT``: 101,376 B on sm_89 and sm_120, 232,448 B on sm_90; Triton only
notices at first launch) or when ptxas spills.

Each target compiles the config table its devices read (``_arch.table_for``): sm_120 (RTX 5090,
RTX PRO 6000 Blackwell: Ada's 99 KiB per block, FP8 mma.sync) reads the sm_89 table, so its rows
are the sm_89 table's GPU defaults built for compute capability 12.0 (``--all-configs``: every row).
A target the wheel's ptxas does not know gives one ``not compiled`` row per kernel (ok, with the
reason) instead of failing.

Must run WITHOUT ``TRITON_INTERPRET`` (``@triton.jit`` must build JITFunctions): the CLI and the
tests run it in a subprocess with that variable removed.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

from ds4lab.tables import format_table
from ds4lab_kernels._arch import SMEM_LIMIT, table_for

__all__ = ["SMEM_LIMIT", "ARCH_CC", "DEFAULT_ARCHS", "DEFAULTS_ONLY", "labels_for", "AotRow", "capture_compiles",
           "compile_spec", "report", "report_table", "summary", "table_of", "ptxas_unsupported", "main",
           "add_arguments", "ptx_for_other_arch"]

ARCH_CC = {"sm_89": 89, "sm_90": 90, "sm_120": 120}
DEFAULT_ARCHS = ("sm_89", "sm_90", "sm_120")
# targets that build only their table's GPU defaults (a family's ``GPU_DEFAULTS``, the rows its
# pick_config can return on a GPU) unless ``all_configs``: sm_120 reads the sm_89 table, whose every row
# sm_89 already builds; all of it at sm_120 was 142 functions (+49% on the report's 288, all fitting,
# max 98,304 B, no spills), its defaults are 81
DEFAULTS_ONLY = ("sm_120",)


def table_of(arch: str) -> str:
    """The config table (``"sm_89"`` / ``"sm_90"``) a device of compile target ``arch`` reads."""
    return table_for(ARCH_CC[arch], SMEM_LIMIT[arch])
MMA_OPS = ("QMMA", "HMMA", "HGMMA", "QGMMA", "IMMA", "DMMA")


@dataclass
class AotRow:
    kernel: str            # registry name
    triton_fn: str         # the @triton.jit function compiled
    arch: str
    config: str
    shape: dict
    num_warps: int = 0
    num_stages: int = 0
    shared: int = 0        # bytes of shared memory per block (Triton metadata)
    registers: int = 0
    spill_stores: int = 0  # bytes (ptxas -v)
    spill_loads: int = 0
    local: int = 0         # bytes of local memory (stack frame) per thread (cuobjdump STACK)
    mma: dict = field(default_factory=dict)  # SASS matrix instruction counts
    ok: bool = True
    why: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _tool(name: str) -> str:
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name} not found in the triton wheel at {path}")
    return path


def _ptxas(arch: str) -> str:
    """The ptxas Triton assembles ``arch`` with (``ptxas-blackwell`` for sm_100+ in triton 3.6)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(ARCH_CC[arch]).path
    except (ImportError, AttributeError):
        return _tool("ptxas")


def ptxas_unsupported(arch: str) -> str:
    """Empty when the wheel's ptxas for ``arch`` lists it as a ``--gpu-name``, else the reason."""
    try:
        tool = _ptxas(arch)
        p = subprocess.run([tool, "--help"], capture_output=True, text=True)
        ver = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    except (OSError, FileNotFoundError) as e:
        return f"no ptxas for {arch}: {e}"
    if re.search(rf"\b{arch}a?\b", p.stdout + p.stderr):
        return ""
    return f"not compiled: the triton wheel's ptxas ({ver[-1] if ver else tool}) does not know {arch}"


@contextlib.contextmanager
def capture_compiles(arch: str):
    """Within the block, launching any ``@triton.jit`` kernel compiles it for ``arch`` and records
    the CompiledKernel instead of running it. Yields the list of ``(jit_fn, compiled)``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime import jit as jitmod

    if arch not in ARCH_CC:
        raise ValueError(f"arch={arch!r}: expected one of {sorted(ARCH_CC)}")
    target = GPUTarget("cuda", ARCH_CC[arch], 32)
    backend = make_backend(target)
    captured: list = []
    orig_run = jitmod.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or False
        binder = jitmod.create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        compiled = compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
        captured.append((self, compiled))
        return None

    jitmod.JITFunction.run = run
    try:
        yield captured
    finally:
        jitmod.JITFunction.run = orig_run


def _inspect(compiled, arch: str) -> dict:
    """Resources of one compiled kernel: ``shared``, ``num_warps``, ``num_stages`` (Triton metadata),
    ``registers`` and ``local`` (bytes of stack a thread; cuobjdump), ``mma`` (SASS counts) and the
    ``spill_stores`` / ``spill_loads`` bytes of ``ptxas -v``. Memoised in Triton's cache
    (``triton.runtime.cache``, under ``TRITON_CACHE_DIR``): the result is a function of the cubin, the PTX, the
    target, the wheel's tools and this inspection's code, all in the key, so the notebooks' compile reports and
    the suite's reuse what the whole-registry report already assembled (about 0.7 s a kernel of cuobjdump and
    ptxas runs). ``DS4LAB_AOT_CACHE=0`` turns the memo off."""
    if os.environ.get("DS4LAB_AOT_CACHE", "1") == "0":
        return _inspect_uncached(compiled, arch)
    import hashlib
    import inspect

    import triton
    from triton.runtime.cache import get_cache_manager
    h = hashlib.sha256()
    for part in ("ds4lab-aot-inspect", arch, triton.__version__, _ptxas(arch), _tool("cuobjdump"),
                 inspect.getsource(_inspect_uncached)):
        h.update(part.encode() + b"\0")
    h.update(compiled.asm["cubin"])
    h.update(compiled.asm["ptx"].encode())
    cache = get_cache_manager(h.hexdigest())
    path = cache.get_file("ds4lab_aot_inspect.json")
    if path:
        with open(path) as f:
            return json.load(f)
    out = _inspect_uncached(compiled, arch)
    cache.put(json.dumps(out), "ds4lab_aot_inspect.json", binary=False)
    return out


def _inspect_uncached(compiled, arch: str) -> dict:
    md = compiled.metadata
    out = {"shared": int(md.shared), "num_warps": int(md.num_warps), "num_stages": int(md.num_stages)}
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
        # "REG:n STACK:n SHARED:n LOCAL:n ...": per-thread local memory (spills and local arrays) is
        # the STACK frame; LOCAL counts only non-stack local variables (0 for Triton kernels)
        m = re.search(r"REG:(\d+)\s+STACK:(\d+)", res)
        if not m:
            raise RuntimeError(f"cuobjdump -res-usage printed no REG/STACK line: {res[-400:]!r}")
        out["registers"], out["local"] = int(m.group(1)), int(m.group(2))
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
        out["mma"] = {op: len(re.findall(rf"\b{op}\b", sass)) for op in MMA_OPS}
        out["mma"] = {k: v for k, v in out["mma"].items() if v}
        out["mma"]["LDL/STL"] = len(re.findall(r"\b(LDL|STL)\b", sass))
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        # assemble for the PTX's own target (sm_90a for Hopper builds: plain sm_90 rejects the
        # wgmma/setmaxnreg the PTX uses, and a failed ptxas run reports no spills at all)
        tgt = re.search(r"^\.target\s+(sm_\d+a?)", compiled.asm["ptx"], re.M)
        gpu_name = tgt.group(1) if tgt else arch
        p = subprocess.run([_ptxas(arch), "-v", f"--gpu-name={gpu_name}", ptx, "-o", os.path.join(d, "x.cubin")],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"ptxas --gpu-name={gpu_name} failed (rc {p.returncode}): {p.stderr[-400:]}")
        log = p.stderr
        st = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        out["spill_stores"] = sum(int(a) for a, _ in st)
        out["spill_loads"] = sum(int(b) for _, b in st)
    return out


def ptx_for_other_arch(ptx: str, arch: str = "sm_90") -> str:
    """Retarget PTX text (``.target`` line) so an sm_89 build can be assembled for the H200."""
    return re.sub(r"^\.target\s+sm_\d+a?", f".target {arch}", ptx, count=1, flags=re.M)


def compile_spec(spec, arch: str, label: str, shape: dict | None = None) -> list[AotRow]:
    """Compile one (kernel, config of the table ``arch`` reads) for ``arch`` by calling its launcher
    on CPU tensors."""
    shape = shape or _aot_shapes(spec)[0]
    cfg = spec.configs[table_of(arch)][label]
    inputs = spec.make_inputs(shape, spec.cases[0], 0, "cpu")
    rows = []
    try:
        with capture_compiles(arch) as captured:
            spec.launcher_fn()(**inputs, config=cfg)
    except Exception as e:  # a compile error is a failing row, not a crash of the report
        return [AotRow(spec.name, "?", arch, label, shape, ok=False, why=f"{type(e).__name__}: {e}"[:400])]
    if not captured:
        return [AotRow(spec.name, "?", arch, label, shape, ok=False, why="launcher compiled no Triton kernel")]
    for fn, compiled in captured:
        try:
            info = _inspect(compiled, arch)
        except RuntimeError as e:   # ptxas/cuobjdump failed: a failing row, never a silent pass
            rows.append(AotRow(spec.name, fn.__name__, arch, label, shape, ok=False, why=str(e)[:400]))
            continue
        row = AotRow(spec.name, fn.__name__, arch, label, shape, **info)
        why = []
        if row.shared > SMEM_LIMIT[arch]:
            why.append(f"shared {row.shared} B > {SMEM_LIMIT[arch]} B limit")
        if row.spill_stores or row.spill_loads:
            why.append(f"spills {row.spill_stores}/{row.spill_loads} B")
        row.ok, row.why = not why, "; ".join(why)
        rows.append(row)
    return rows


def _aot_shapes(spec) -> list[dict]:
    """``spec.aot_shape``: one shape or a list (constexpr specialisations the launcher reaches at
    different shapes, e.g. the C4A and C128A block sizes of sparse MLA decode); default test_shapes[-1]."""
    s = spec.aot_shape or spec.test_shapes[-1]
    return list(s) if isinstance(s, (list, tuple)) else [s]


def labels_for(spec, arch: str, shape: dict, all_configs: bool = False) -> list[str]:
    """Config labels compiled for ``spec`` on ``arch`` at ``shape``: the registry's labels of the table
    ``arch`` reads, limited to the family's ``GPU_DEFAULTS`` on a ``DEFAULTS_ONLY`` target (its entry for
    ``arch`` itself if it has one, else for the table)."""
    table = table_of(arch)
    labels = spec.config_labels(table, shape)
    if arch in DEFAULTS_ONLY and not all_configs:
        try:
            gpu_defaults = importlib.import_module(f"ds4lab_kernels.{spec.family}").GPU_DEFAULTS
        except (ImportError, AttributeError):  # every row of the family's table is a default
            return labels
        # a family lists a target of its own where that target's picks differ from its table's (the indexer: sm_120)
        defaults = gpu_defaults.get(arch, gpu_defaults[table])
        labels = [lb for lb in labels if lb in defaults]
    return labels


def report(names: list[str] | None = None, archs=DEFAULT_ARCHS, progress=None,
           all_configs: bool = False) -> list[AotRow]:
    """Compile every (kernel, arch, AOT shape, config of :func:`labels_for`);
    ``progress(msg)`` is called once per kernel."""
    from ds4lab.harness.registry import all_specs
    rows = []
    skip = {arch: ptxas_unsupported(arch) for arch in archs}
    for spec in all_specs():
        if names and spec.name not in names and spec.family not in names:
            continue
        if progress:
            progress(f"compiling {spec.name} for {', '.join(archs)}")
        for arch in archs:
            for shape in _aot_shapes(spec):
                if skip[arch]:
                    rows.append(AotRow(spec.name, "-", arch, "-", shape, why=skip[arch]))
                    continue
                for label in labels_for(spec, arch, shape, all_configs):
                    rows.extend(compile_spec(spec, arch, label, shape))
    return rows


def summary(rows: list[AotRow]) -> str:
    """One line per arch: rows, failing rows, max shared memory (of that arch's limit), spills."""
    lines = []
    for arch in dict.fromkeys(r.arch for r in rows):
        rs = [r for r in rows if r.arch == arch]
        built = [r for r in rs if r.triton_fn != "-"]
        if not built:
            lines.append(f"{arch}: {rs[0].why}")
            continue
        top = max(built, key=lambda r: r.shared)
        spills = sum(r.spill_stores + r.spill_loads for r in built)
        lines.append(f"{arch} (table {table_of(arch)}): {len(built)} compiled, {sum(not r.ok for r in rs)} failing; "
                     f"max smem {top.shared:,} B of {SMEM_LIMIT[arch]:,} ({top.kernel} {top.config}); "
                     f"spills {spills} B")
    return "\n".join(lines)


def report_table(rows: list[AotRow]) -> str:
    """One line per compiled Triton function (:func:`ds4lab.tables.format_table`): verdict first,
    then the MMA / local-memory instruction counts, then the AOT shape where a kernel has several."""
    multi = {(r.kernel, r.arch, r.config) for r in rows
             if any(o.shape != r.shape and (o.kernel, o.arch, o.config) == (r.kernel, r.arch, r.config) for o in rows)}
    out = []
    for r in rows:
        where = ""
        if (r.kernel, r.arch, r.config) in multi:  # several AOT shapes: say which one
            where = "@" + ",".join(f"{k}={v}" for k, v in r.shape.items())
        out.append({"kernel": r.kernel, "triton fn": r.triton_fn[:36], "arch": r.arch, "config": r.config,
                    "warps": r.num_warps, "smem B": r.shared, "regs": r.registers, "spill": r.spill_stores,
                    "stack": r.local, "verdict": "OK" if r.ok else "FAIL: " + r.why,
                    "mma (SASS counts)": ",".join(f"{k}:{v}" for k, v in r.mma.items() if v) or "-",
                    "[shape]": where})
    return format_table(out, right=("warps", "smem B", "regs", "spill", "stack"))


def add_arguments(p) -> None:
    p.add_argument("kernels", nargs="*", help="kernel names or families (default: all registered)")
    p.add_argument("--arch", action="append", choices=sorted(ARCH_CC), help=f"default: {', '.join(DEFAULT_ARCHS)}")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--all-configs", action="store_true",
                   help=f"also on {', '.join(DEFAULTS_ONLY)}: every row of its table, not only the GPU defaults")


def main(args) -> int:
    if os.environ.get("TRITON_INTERPRET"):
        # JITFunctions are needed: re-run ourselves without the interpreter
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.call([sys.executable, "-m", "ds4lab", "aot", *sys.argv[2:]], env=env)
    from ds4lab.harness.registry import all_specs
    known = {s.name for s in all_specs()} | {s.family for s in all_specs()}
    unknown = sorted(set(args.kernels) - known)
    if unknown:
        raise ValueError(f"unknown kernels/families {unknown}; registered: {sorted(known)}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json {args.json}: its folder does not exist")
    rows = report(args.kernels or None, tuple(args.arch or DEFAULT_ARCHS),
                  progress=lambda m: print(m, file=sys.stderr, flush=True), all_configs=args.all_configs)
    print(report_table(rows))
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=1)
    bad = [r for r in rows if not r.ok]
    print(f"{len(rows)} compiled kernels, {len(bad)} failing")
    return 1 if bad or not rows else 0
