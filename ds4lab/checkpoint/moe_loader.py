"""Read DeepSeek-V4 routed-expert weights in compressed-tensors ``pack-quantized`` INT4 layout from
safetensors, into the stacked tensors ``ds4lab_kernels.moe_w4a16.fused_moe_w4a16`` takes.

Two layouts are understood (SPEC.md §1, community checkpoint
``canada-quant/DeepSeek-V4-Flash-W4A16-FP8-MTP``):

- per expert, as the checkpoint stores them (vLLM ``DeepseekV4`` expert mapping: ``w1`` gate,
  ``w3`` up, ``w2`` down): ``{prefix}.experts.{e}.{w1,w2,w3}.weight_packed`` int32 ``[N, K/8]``,
  ``.weight_scale`` ``[N, K/128]`` (bf16/fp16/fp32), optional ``.weight_shape`` int ``[2]`` = ``(N, K)``;
- stacked, as vLLM's fused-MoE parameters: ``{prefix}.experts.w13_weight_packed`` ``[E, 2I, D/8]``,
  ``w13_weight_scale`` ``[E, 2I, D/128]``, ``w2_weight_packed`` ``[E, D, I/8]``, ``w2_weight_scale``
  ``[E, D, I/128]``.

Router tensors next to them: ``{prefix}.gate.weight`` ``[E, D]``, ``{prefix}.gate.bias``
(vLLM's ``e_score_correction_bias``) and, on hash layers, ``{prefix}.gate.tid2eid`` ``[vocab, topk]``.
Tensor parallelism (vLLM ``FusedMoE``): rank r of t keeps gate/up rows and down input columns
``[r*I/t, (r+1)*I/t)``; ``I/t`` must stay a multiple of the 128-element quant group.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

GROUP = 128
PACK = 8

__all__ = ["MoEWeights", "load_moe_layer", "expert_prefix"]


@dataclass
class MoEWeights:
    """One layer's routed experts at one TP rank, in the kernels' layout."""
    w13_packed: torch.Tensor   # [E, 2*I_r, D/8] int32
    w13_scale: torch.Tensor    # [E, 2*I_r, D/128]
    w2_packed: torch.Tensor    # [E, D, I_r/8] int32
    w2_scale: torch.Tensor     # [E, D, I_r/128]
    gate_weight: torch.Tensor | None = None        # [E, D]
    e_score_correction_bias: torch.Tensor | None = None  # [E] fp32
    tid2eid: torch.Tensor | None = None            # [vocab, topk] int32

    def kernel_kwargs(self) -> dict:
        return {"w13_packed": self.w13_packed, "w13_scale": self.w13_scale,
                "w2_packed": self.w2_packed, "w2_scale": self.w2_scale}


def expert_prefix(layer: int) -> str:
    """The checkpoint's name prefix of layer ``layer``'s MoE block (``layers.{L}.ffn``)."""
    return f"layers.{layer}.ffn"


class _Files:
    """Name -> safetensors file map over one file, a list of files, or a folder (with or without a
    ``model.safetensors.index.json``)."""

    def __init__(self, path):
        from safetensors import safe_open
        self._open = safe_open
        if isinstance(path, (list, tuple)):
            files = [os.fspath(p) for p in path]
        elif os.path.isdir(path):
            idx = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(idx):
                with open(idx) as f:
                    wm = json.load(f)["weight_map"]
                files = sorted({os.path.join(path, v) for v in wm.values()})
            else:
                files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        else:
            files = [os.fspath(path)]
        if not files:
            raise FileNotFoundError(f"path={path!r}: no .safetensors files")
        self.where: dict[str, str] = {}
        for fn in files:
            with safe_open(fn, framework="pt") as f:
                for k in f.keys():
                    self.where[k] = fn
        self._handles: dict[str, object] = {}

    def _h(self, fn):
        if fn not in self._handles:
            self._handles[fn] = self._open(fn, framework="pt")
        return self._handles[fn]

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, rows=None, cols=None) -> torch.Tensor:
        """The tensor, optionally sliced ``[rows]`` on dim -2 and ``[cols]`` on dim -1 (read lazily)."""
        if name not in self.where:
            raise KeyError(f"tensor {name!r} not found")
        sl = self._h(self.where[name]).get_slice(name)
        nd = len(sl.get_shape())
        idx = [slice(None)] * nd
        if rows is not None:
            idx[nd - 2] = rows
        if cols is not None:
            idx[nd - 1] = cols
        return sl[tuple(idx)]


def _check_packed(name, p, s, N, K):
    if p.dtype != torch.int32:
        raise TypeError(f"{name}: weight_packed dtype {p.dtype}, expected int32 (pack-quantized, 8 nibbles per word)")
    if tuple(p.shape[-2:]) != (N, K // PACK):
        raise ValueError(f"{name}: weight_packed shape {tuple(p.shape)}, expected [..., {N}, {K // PACK}]")
    if tuple(s.shape[-2:]) != (N, K // GROUP):
        raise ValueError(f"{name}: weight_scale shape {tuple(s.shape)}, expected [..., {N}, {K // GROUP}] "
                         f"(group {GROUP}, symmetric; zero points are not supported)")


def load_moe_layer(path, layer: int | None = None, prefix: str | None = None, tp: int = 1, rank: int = 0,
                   device="cpu", num_experts: int | None = None) -> MoEWeights:
    """Load one layer's routed experts (and router tensors when present) for TP rank ``rank`` of ``tp``.

    Args:
        path: a ``.safetensors`` file, a list of them, or a checkpoint folder.
        layer / prefix: the layer index (prefix ``layers.{layer}.ffn``) or an explicit prefix.
        tp, rank: tensor-parallel split of the intermediate size.
        device: where the returned tensors live.
        num_experts: how many experts to read (default: every ``experts.{e}`` present).

    Raises:
        KeyError: missing tensors; TypeError/ValueError: dtypes or shapes that are not
        pack-quantized INT4 group-128, or an ``I/tp`` that is not a multiple of 128.
    """
    if prefix is None:
        if layer is None:
            raise ValueError("give layer or prefix")
        prefix = expert_prefix(layer)
    if not (isinstance(tp, int) and tp >= 1 and 0 <= rank < tp):
        raise ValueError(f"tp={tp!r}, rank={rank!r}: need 0 <= rank < tp")
    fs = _Files(path)
    stacked = fs.has(f"{prefix}.experts.w13_weight_packed")
    if stacked:
        p13 = fs.get(f"{prefix}.experts.w13_weight_packed")
        E, N2, D8 = p13.shape
        I, D = N2 // 2, D8 * PACK
    else:
        ids = sorted({int(k[len(prefix) + 9:].split(".")[0]) for k in fs.where
                      if k.startswith(f"{prefix}.experts.") and k.endswith(".w1.weight_packed")})
        if not ids:
            raise KeyError(f"no experts under {prefix!r} (looked for {prefix}.experts.{{e}}.w1.weight_packed "
                           f"and {prefix}.experts.w13_weight_packed)")
        E = num_experts or (ids[-1] + 1)
        I, D8 = fs.get(f"{prefix}.experts.{ids[0]}.w1.weight_packed").shape
        D = D8 * PACK
    if I % tp or (I // tp) % GROUP:
        raise ValueError(f"tp={tp}: intermediate size {I} / tp = {I / tp:g} is not a multiple of {GROUP}")
    Ir = I // tp
    r0, r1 = rank * Ir, (rank + 1) * Ir
    if stacked:
        p13 = fs.get(f"{prefix}.experts.w13_weight_packed")
        s13 = fs.get(f"{prefix}.experts.w13_weight_scale")
        _check_packed("w13", p13, s13, 2 * I, D)
        w13p = torch.cat([p13[:, r0:r1], p13[:, I + r0:I + r1]], 1)
        w13s = torch.cat([s13[:, r0:r1], s13[:, I + r0:I + r1]], 1)
        w2p = fs.get(f"{prefix}.experts.w2_weight_packed", cols=slice(r0 // PACK, r1 // PACK))
        w2s = fs.get(f"{prefix}.experts.w2_weight_scale", cols=slice(r0 // GROUP, r1 // GROUP))
        _check_packed("w2", w2p, w2s, D, Ir)
    else:
        w13p, w13s, w2p, w2s = [], [], [], []
        for e in range(E):
            pre = f"{prefix}.experts.{e}"
            parts = {}
            for wn in ("w1", "w3", "w2"):
                p = fs.get(f"{pre}.{wn}.weight_packed")
                s = fs.get(f"{pre}.{wn}.weight_scale")
                N, K = (I, D) if wn != "w2" else (D, I)
                _check_packed(f"{pre}.{wn}", p, s, N, K)
                if fs.has(f"{pre}.{wn}.weight_shape"):
                    ws = tuple(int(v) for v in fs.get(f"{pre}.{wn}.weight_shape").tolist())
                    if ws != (N, K):
                        raise ValueError(f"{pre}.{wn}.weight_shape={ws}, expected {(N, K)}")
                if wn == "w2":
                    parts[wn] = (p[:, r0 // PACK:r1 // PACK], s[:, r0 // GROUP:r1 // GROUP])
                else:
                    parts[wn] = (p[r0:r1], s[r0:r1])
            w13p.append(torch.cat([parts["w1"][0], parts["w3"][0]]))
            w13s.append(torch.cat([parts["w1"][1], parts["w3"][1]]))
            w2p.append(parts["w2"][0])
            w2s.append(parts["w2"][1])
        w13p, w13s, w2p, w2s = (torch.stack(v) for v in (w13p, w13s, w2p, w2s))
    out = MoEWeights(w13p.contiguous().to(device), w13s.contiguous().to(device),
                     w2p.contiguous().to(device), w2s.contiguous().to(device))
    if fs.has(f"{prefix}.gate.weight"):
        out.gate_weight = fs.get(f"{prefix}.gate.weight").to(device)
    for name in (f"{prefix}.gate.bias", f"{prefix}.gate.e_score_correction_bias"):
        if fs.has(name):
            out.e_score_correction_bias = fs.get(name).float().to(device)
    if fs.has(f"{prefix}.gate.tid2eid"):
        t = fs.get(f"{prefix}.gate.tid2eid")
        if t.dim() != 2 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{prefix}.gate.tid2eid: expected an int [vocab, topk] table, got {t.dtype} {tuple(t.shape)}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= E):
            raise ValueError(f"{prefix}.gate.tid2eid: entries outside [0, {E})")
        out.tid2eid = t.to(torch.int32).to(device)
    return out
