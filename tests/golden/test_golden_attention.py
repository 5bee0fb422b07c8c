"""Replay the committed attention bundles through every available impl. NaN fills every cache slot the
op must not read, so a stray read fails loudly. Tolerances: the reference against its own stored output
1e-6 (float32, same arithmetic); the Triton kernel (fp32 tl.dot) 1e-4 relative to the output scale."""

from pathlib import Path

import pytest
import torch

from kdtree_engine.attention import tree_mla_attention
from kdtree_engine.golden import read_bundle
from kdtree_engine.golden.attention_cases import CASES

HERE = Path(__file__).parent
TOLERANCE = {"ref": 1e-6, "triton": 1e-4}


def impls():
    try:
        import kdtree_engine.kernels.mla_attention_triton  # noqa: F401
    except ImportError:
        return ["ref"]
    return ["ref", "triton"]


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("name", sorted(CASES))
def test_replay(name, impl):
    bundle = read_bundle(HERE / f"{name}.safetensors")
    t, p = bundle.tensors, bundle.params
    assert bundle.meta["op"] == "attention"
    dev = torch.device("cuda" if impl == "triton" and torch.cuda.is_available() else "cpu")
    out, lse = tree_mla_attention(
        t["in.q"].to(dev), t["in.kv_cache"].to(dev), t["in.cache_seqlens"].to(dev),
        softmax_scale=p["softmax_scale"], d_v=p["d_v"], visibility=t["in.visibility"].to(dev), impl=impl,
    )  # fmt: skip
    tol = TOLERANCE[impl]
    for got, want in ((out.float().cpu(), t["out.out"]), (lse.cpu(), t["out.lse"])):
        assert not got.isnan().any()
        worst = (got - want).abs().max().item() / max(want.abs().max().item(), 1.0)
        assert worst <= tol, f"{name} {impl}: worst relative error {worst:.2e}"
