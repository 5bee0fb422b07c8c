"""Fused weights for the drafter's kernel path, without a second copy: the parameters that one GEMM
should read together (q/k/v of every layer, gate/up of every layer) become views of one buffer.

The parameters keep their checkpoint names, shapes and Parameter objects (an optimizer holding them is
unaffected; load_state_dict and in-place updates write through to the buffer). Anything that replaces
a parameter's storage (`.to(dtype)`, `.to(device)`, `to_empty`, assigning `.data`) breaks the views;
`packed_weights` notices (a host-side pointer check, no device work) and packs again.

Dimension names: n layers, h heads, g kv heads, d head_dim, H hidden, I intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kdtree_engine.impl import capturing
from kdtree_engine.packing import intact, pack_rows


@dataclass
class PackedWeights:
    """qkv [n, (h + 2g) d, H] (rows: q_proj, k_proj, v_proj), qkv_bias [n, (h + 2g) d] or None,
    gate_up [n, 2I, H] (rows: gate_proj, up_proj), q_norm / k_norm [n, d]; all in the parameters'
    dtype and device. `ptrs`: where each packed parameter must point for the views to hold."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    ptrs: tuple[tuple[nn.Parameter, int], ...]

    def intact(self) -> bool:
        return intact(self.ptrs)


def _groups(drafter) -> dict[str, list[list[nn.Parameter]]]:
    """Per packed buffer, per layer, the parameters concatenated along their first dim."""
    attn = [layer.self_attn for layer in drafter.layers]
    mlp = [layer.mlp for layer in drafter.layers]
    groups = {
        "qkv": [[a.q_proj.weight, a.k_proj.weight, a.v_proj.weight] for a in attn],
        "gate_up": [[m.gate_proj.weight, m.up_proj.weight] for m in mlp],
        "q_norm": [[a.q_norm.weight] for a in attn],
        "k_norm": [[a.k_norm.weight] for a in attn],
    }
    if attn[0].q_proj.bias is not None:
        groups["qkv_bias"] = [[a.q_proj.bias, a.k_proj.bias, a.v_proj.bias] for a in attn]
    return groups


def pack(drafter) -> PackedWeights:
    """Packs the drafter's parameters (a copy of the q/k/v, gate/up and q/k-norm weights into fused
    buffers, then the parameters point into them) and returns the buffers."""
    ptrs: list = []
    bufs = {name: pack_rows(g, ptrs) for name, g in _groups(drafter).items()}
    return PackedWeights(
        qkv=bufs["qkv"],
        qkv_bias=bufs.get("qkv_bias"),
        gate_up=bufs["gate_up"],
        q_norm=bufs["q_norm"],
        k_norm=bufs["k_norm"],
        ptrs=tuple(ptrs),
    )


def packed_weights(drafter) -> PackedWeights:
    """The drafter's fused buffers, packing (again) when its parameters are not views of them."""
    packed = getattr(drafter, "_packed", None)
    if packed is None or not packed.intact():
        if capturing(drafter.fc.weight.device):  # a captured copy would re-read freed storage on replay
            raise RuntimeError(
                "drafter: its kernel path packs the weights at its first call; run one eager draft "
                "(after any .to()) before capturing it in a CUDA graph"
            )
        packed = pack(drafter)
        drafter._packed = packed
    return packed
