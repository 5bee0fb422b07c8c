"""The row-invariant projection (kernels/linear.py) against its reference (ref/linear.py) on fresh random
inputs, and its defining property: a row's bits do not depend on the other rows of the launch (the same
row in launches of M = 1 .. 100 rows, at other positions, next to other rows). The small-M launch
(invariant=False) against the same reference, at every row tile it takes. On the CPU through the
Triton interpreter at small shapes; the Kimi-K2 and 2.5B shapes, CUDA-graph replay and the same property
on the GPU are marked gpu.

Tolerances, relative to the output's largest magnitude, against the reference run on the float32 values
of the inputs: float32 1e-5 (another summation order), 16-bit 1e-2 (one rounding of the output)."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels import linear as kernels
from kdtree_engine.ref.linear import linear_ref

SHAPES = [  # (M, N, K)
    (1, 16, 16),
    (1, 40, 24),  # N, K not multiples of 16
    (2, 64, 200),  # K over one 128-wide step, not a multiple of it
    (15, 33, 48),
    (16, 64, 64),
    (17, 70, 130),  # one row into the second tile; N into a second column block
    (33, 24, 96),
    (100, 20, 40),
]


def _inputs(m, n, k, dtype, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_kernel_matches_reference(shape, dtype, device):
    m, n, k = shape
    for bias in (True, False):
        x, w, b = _inputs(m, n, k, dtype, seed=m * n + k, bias=bias)
        got = kernels.linear(x.to(device), w.to(device), None if b is None else b.to(device))
        assert got.dtype == dtype and got.shape == (m, n)
        want = linear_ref(x.float(), w.float(), None if b is None else b.float())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        scale = float(want.abs().max())
        torch.testing.assert_close(got.cpu().float(), want, rtol=tol, atol=tol * scale)


def assert_rows_invariant(x: torch.Tensor, w: torch.Tensor, b, sizes, seed: int) -> None:
    """Every launch of the first m rows (m in sizes), and of all rows shuffled, gives each row the bits
    it has in the launch of all rows."""
    whole = kernels.linear(x, w, b)
    for m in sizes:
        part = kernels.linear(x[:m], w, b)
        bad = (part != whole[:m]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"M={m}: rows {bad[:5]} differ from the launch of {len(x)} rows"
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed)).to(x.device)
    shuffled = kernels.linear(x[perm], w, b)
    assert torch.equal(shuffled, whole[perm]), "rows at other positions of the launch got other bits"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_are_invariant_to_the_launch(dtype, device):
    x, w, b = (t.to(device) for t in _inputs(100, 70, 130, dtype, seed=1))
    assert_rows_invariant(x, w, b, sizes=[1, 2, 9, 16, 17, 33, 64], seed=2)


def test_leading_dims_empty_rows_and_float64(device):
    x, w, b = _inputs(6, 24, 40, torch.float32, seed=3)
    got = kernels.linear(x.view(2, 3, 40).to(device), w.to(device), b.to(device))
    assert got.shape == (2, 3, 24)
    assert torch.equal(got.reshape(6, 24), kernels.linear(x.to(device), w.to(device), b.to(device)))
    assert kernels.linear(x[:0].to(device), w.to(device)).shape == (0, 24)
    x64, w64 = x.double(), w.double()
    assert torch.equal(kernels.linear(x64, w64), linear_ref(x64, w64))


def test_bad_arguments_name_what_is_wrong():
    x, w, b = _inputs(2, 8, 16, torch.float32, seed=4)
    with pytest.raises(ValueError, match="weight: expected x's dtype"):
        kernels.linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="x: expected"):
        kernels.linear(x[:, :8], w)
    with pytest.raises(ValueError, match="bias"):
        kernels.linear(x, w, b[:4])
    with pytest.raises(ValueError, match="weight: expected \\[N, K\\]"):
        kernels.linear(x, w[0])


def test_launch_config_depends_on_the_weight_only():
    assert kernels.launch_config(7168, 2112, 2) == kernels.Launch(64, 128, 4, 4)
    assert kernels.launch_config(7168, 2112, 4) == kernels.Launch(64, 64, 4, 4)
    assert kernels.launch_config(24, 40, 2) == kernels.Launch(32, 64, 4, 4)
    assert kernels.launch_config(1, 1, 2) == kernels.Launch(16, 16, 4, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batched_into_strided_views(dtype, device):
    """MLA's per-head products as the model calls them: x a column slice of a wider buffer, weight a
    transposed view (W_UK read in place), out columns of a wider buffer; values against float64 bmm,
    the other columns of out untouched, and rows invariant to M."""
    gen = torch.Generator().manual_seed(7)
    h, m, d_nope, r = 3, 21, 24, 40
    q = torch.randn(m, h, d_nope + 8, generator=gen).to(dtype).to(device)
    w_uk = (torch.randn(h, d_nope, r, generator=gen) * d_nope**-0.5).to(dtype).to(device)
    buf = torch.full((m, h, r + 8), 7.0, dtype=dtype, device=device)
    x = q[..., :d_nope].transpose(0, 1)  # [h, m, d_nope]
    out = kernels.batched_linear_into(x, w_uk.transpose(1, 2), buf[..., :r].transpose(0, 1))
    want = torch.bmm(x.double().cpu(), w_uk.double().cpu())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    assert bool((buf[..., r:] == 7.0).all())
    for rows in (1, 2, 17):
        part = torch.empty(h, rows, r, dtype=dtype, device=device)
        kernels.batched_linear_into(x[:, :rows], w_uk.transpose(1, 2), part)
        assert torch.equal(part, out[:, :rows])
    with pytest.raises(ValueError, match="batched_linear_into"):
        kernels.batched_linear_into(x, w_uk, buf[..., :r].transpose(0, 1))


SMALL_M_SHAPES = [  # (M, N, K): each row tile (16, 32, 64), N and K off the blocks, one K step and several
    (1, 40, 24),
    (3, 16, 300),
    (16, 70, 130),
    (17, 33, 48),
    (33, 96, 520),
    (64, 20, 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SMALL_M_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_small_m_launch_matches_reference(shape, dtype, device):
    m, n, k = shape
    x, w, b = _inputs(m, n, k, dtype, seed=m + n * k)
    want = linear_ref(x.float(), w.float(), b.float())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    got = kernels.linear(x.to(device), w.to(device), b.to(device), invariant=False)
    torch.testing.assert_close(got.cpu().float(), want, rtol=tol, atol=tol * float(want.abs().max()))
    first = kernels.linear(x.to(device), w.to(device), b.to(device), invariant=False, weight_first=True)
    assert torch.equal(first, got)  # the weight read before the PDL wait: the same sum
    x3 = x.to(device)[None].expand(2, m, k)
    out = torch.empty(2, m, n, dtype=dtype, device=device)
    kernels.batched_linear_into(x3, w.to(device)[None].expand(2, n, k), out, invariant=False)
    torch.testing.assert_close(
        out[1].cpu().float(), want - b.float(), rtol=tol, atol=tol * float(want.abs().max())
    )


def test_small_m_launch_tiles_every_row_and_beyond_takes_the_invariant_launch(device):
    """One row tile of M rounded up to a power of two (16 at least); M > SMALL_M falls back to the
    invariant launch (so its rows keep the invariant bits); M outside 1..SMALL_M is refused by name."""
    assert [kernels.small_m_launch(m, 2048, 2048, 2, 132).block_m for m in (1, 16, 17, 33, 64)] == [
        16,
        16,
        32,
        64,
        64,
    ]
    for bad in (0, kernels.SMALL_M + 1):
        with pytest.raises(ValueError, match="small_m_launch: M"):
            kernels.small_m_launch(bad, 64, 64, 2, 132)
    x, w, _ = (t.to(device) for t in _inputs(kernels.SMALL_M + 1, 24, 40, torch.float32, seed=8))
    assert torch.equal(kernels.linear(x, w, invariant=False), kernels.linear(x, w))
    assert kernels.small_m_launch(1, 1344, 2048, 2, 132) != kernels.launch_config(1344, 2048, 2)


def test_small_m_wins_at_one_row_tile_or_a_small_weight():
    """The rule the model's projections follow (model.linear): M <= 16 at any weight size; up to SMALL_M
    rows only for weights of at most SMALL_WEIGHT bytes; never past SMALL_M or at M = 0."""
    big, small = 8 << 20, kernels.SMALL_WEIGHT
    assert kernels.small_m_wins(1, big) and kernels.small_m_wins(16, big)
    assert not kernels.small_m_wins(17, big)
    assert kernels.small_m_wins(33, small) and kernels.small_m_wins(64, small)
    assert not kernels.small_m_wins(33, small + 1) and not kernels.small_m_wins(65, 1)
    assert not kernels.small_m_wins(0, 1)


KIMI_SHAPES = [
    (2112, 7168),
    (1536, 1536),
    (7168, 1024),
    (20480, 7168),
]  # (N, K): a-proj, q_b, o, lm_head rows


@pytest.mark.gpu
@pytest.mark.parametrize("nk", KIMI_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rows_are_invariant_on_the_gpu_at_kimi_shapes(nk):
    """bf16 on the GPU: the same property at Kimi-K2's projection shapes, for the decode, verify and
    batched-verify sizes, and the values against the float32 reference."""
    n, k = nk
    x, w, _ = (
        t.cuda() if t is not None else None
        for t in _inputs(64 * 33, n, k, torch.bfloat16, seed=n, bias=False)
    )
    assert_rows_invariant(x, w, None, sizes=[1, 2, 9, 17, 33, 65, 16 * 33], seed=5)
    want = linear_ref(x[:33].float(), w.float())
    torch.testing.assert_close(
        kernels.linear(x[:33], w).float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max())
    )


@pytest.mark.gpu
@pytest.mark.parametrize("nk", [(1344, 2048), (3072, 768), (2048, 2048), (163840, 2048), *KIMI_SHAPES[:3]],
                         ids=lambda s: "x".join(map(str, s)))  # fmt: skip
def test_small_m_launch_on_the_gpu(nk):
    """bf16 on the GPU at the 2.5B shape's and Kimi-K2's projection shapes, for a decode step and tree
    verifies: values against the float32 reference, and the same bits when captured in a graph."""
    n, k = nk
    x, w, _ = (
        t.cuda() if t is not None else None for t in _inputs(64, n, k, torch.bfloat16, seed=n, bias=False)
    )
    for m in (1, 4, 17, 33, 64):
        want = linear_ref(x[:m].float(), w.float())
        got = kernels.linear(x[:m], w, invariant=False)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.linear(x[:33], w, invariant=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kernels.linear(x[:33], w, invariant=False))


@pytest.mark.gpu
def test_cuda_graph_replay_gives_the_eager_bits():
    x, w, b = (t.cuda() for t in _inputs(33, 2112, 7168, torch.bfloat16, seed=6))
    eager = kernels.linear(x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.linear(x, w, b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
