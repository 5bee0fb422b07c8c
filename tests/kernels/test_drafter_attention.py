"""The drafter's block attention over its context cache (kernels/drafter_attention.py) against the
float32 reference (ref/drafter_attention.py), and the reference against what the drafter's torch path
computes (cache concatenated with the block, heads expanded, SDPA with a mask over every slot).

Fresh random inputs; every cache slot at or past new_len holds NaN (never read). Lengths at 0, 1, the
key tile (64) +- 1, max_len, ragged across the batch; T = 1 and 16; h = g and h / g = 4; float32
(1e-5) and bf16 (2e-2: output rounding and bf16 probabilities in P @ V). The context cut into splits
(forced counts, more splits than tiles included: empty splits add nothing) equals the reference too, and
`pick_splits` cuts only long contexts on few programs. CPU CI runs the kernel in the Triton
interpreter; the larger sweep is marked gpu."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdtree_engine.kernels.drafter_attention import BLOCK_N, MAX_SPLITS, drafter_attention, pick_splits
from kdtree_engine.ref.drafter_attention import drafter_attention as reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def assert_close(name, got, want, tol):
    """|got - want| <= tol * (1 + |want|) everywhere; on failure report the worst element."""
    got, want = got.float().cpu(), want.float().cpu()
    assert not got.isnan().any(), f"{name}: NaN at {got.isnan().nonzero()[0].tolist()}"
    excess = (got - want).abs() - tol * (1 + want.abs())
    worst = int(excess.argmax())
    idx = [int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape)]
    got_w, want_w = got.flatten()[worst], want.flatten()[worst]
    assert excess.max() <= 0, f"{name}: worst at {idx}: got {got_w:.6g}, want {want_w:.6g} (tol {tol})"


def make_inputs(lens, t, h, g, d, max_len, dtype, device, seed):
    """q [B, T, h, d], NaN-poisoned caches [B, max_len + 3, g, d], new_len [B], k_blk / v_blk."""
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q, k_blk, v_blk = rnd(b, t, h, d), rnd(b, t, g, d), rnd(b, t, g, d)
    caches = [rnd(b, max_len + 3, g, d) for _ in range(2)]
    for cache in caches:
        for r, n in enumerate(lens):
            cache[r, n:] = float("nan")
    return q, caches[0], caches[1], torch.tensor(lens, device=device), k_blk, v_blk


def sdpa_path(q, cache_k, cache_v, new_len, k_blk, v_blk):
    """What DFlashAttention.forward computed before the kernel (without o_proj), in float32."""
    b, t, h, _ = q.shape
    s = cache_k.shape[1]
    key_valid = torch.arange(s, device=q.device)[None, :] < new_len[:, None]
    k = torch.cat([cache_k.nan_to_num(), k_blk], dim=1).float()
    v = torch.cat([cache_v.nan_to_num(), v_blk], dim=1).float()
    mask = torch.cat([key_valid, key_valid.new_ones(b, t)], dim=1)[:, None, None, :]
    rep = h // k_blk.shape[2]
    k, v = (z.repeat_interleave(rep, dim=2).transpose(1, 2) for z in (k, v))
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k, v, attn_mask=mask)
    return out.transpose(1, 2)


EDGE_LENS = [[0], [1], [BLOCK_N - 1], [BLOCK_N], [BLOCK_N + 1], [150], [0, 150, 1, BLOCK_N + 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, h, g", [(16, 8, 4), (1, 4, 4), (16, 8, 2), (3, 4, 4)])
@pytest.mark.parametrize("lens", EDGE_LENS, ids=lambda lens: "-".join(map(str, lens)))
def test_kernel_matches_reference(device, dtype, t, h, g, lens):
    args = make_inputs(lens, t, h, g, 32, 150, dtype, device, seed=sum(lens) + t + h + g)
    got = drafter_attention(*args)
    assert got.shape == args[0].shape and got.dtype == dtype and got.is_contiguous()
    assert_close("out", got, reference(*args), TOL[dtype])


@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("t, h, g", [(16, 8, 4), (1, 4, 4), (3, 8, 2)])
@pytest.mark.parametrize("lens", [[0], [1], [BLOCK_N + 1], [150], [0, 150, 1, BLOCK_N]], ids=str)
def test_split_context_matches_reference(device, t, h, g, lens, splits):
    """Each split streams whole tiles of the context sized from new_len on the device; the last one also
    takes the block; the partials merge by log-sum-exp. 150 rows in 5 splits: 3 tiles, 2 empty splits."""
    args = make_inputs(lens, t, h, g, 32, 150, torch.float32, device, seed=sum(lens) + t + h + splits)
    got = drafter_attention(*args, num_splits=splits)
    assert got.shape == args[0].shape and got.is_contiguous()
    assert_close("split", got, reference(*args), TOL[torch.float32])


def test_split_bf16_and_graph_lengths(device):
    """bf16 partials, and the same launch with other lengths (as a graph replay) still right."""
    q, ck, cv, new_len, kb, vb = make_inputs([20, 140], 16, 8, 4, 32, 150, torch.bfloat16, device, seed=4)
    ck, cv = ck.nan_to_num(), cv.nan_to_num()
    assert_close("bf16", drafter_attention(q, ck, cv, new_len, kb, vb, num_splits=3),
                 reference(q, ck, cv, new_len, kb, vb), TOL[torch.bfloat16])  # fmt: skip
    new_len.copy_(torch.tensor([140, 0]))
    assert_close("relen", drafter_attention(q, ck, cv, new_len, kb, vb, num_splits=3),
                 reference(q, ck, cv, new_len, kb, vb), TOL[torch.bfloat16])  # fmt: skip


@pytest.mark.parametrize("bad", [0, -1, MAX_SPLITS + 1, 2.0])
def test_bad_split_count_is_refused(device, bad):
    args = make_inputs([5], 1, 4, 4, 32, 8, torch.float32, device, seed=0)
    with pytest.raises(ValueError, match="num_splits"):
        drafter_attention(*args, num_splits=bad)


def test_pick_splits_cuts_long_contexts_on_few_programs():
    # Kimi-K2.5 drafter share (1 kv head of 128, bf16), 132 multiprocessors: 32k slots stream 16 MB
    assert pick_splits(1, 1, 32768, 128, 2, 132) == 32  # 512 KB each
    assert pick_splits(16, 1, 32768, 128, 2, 132) == 9  # one wave of 144 programs
    assert pick_splits(64, 1, 32768, 128, 2, 132) == 3
    assert pick_splits(1, 1, 1 << 20, 128, 2, 132) == MAX_SPLITS == 128
    # kimi-nano (4 kv heads of 32) at its 2048-token limit: 256 KB a head, one launch as before
    assert pick_splits(1, 4, 2048 + 32, 32, 2, 132) == 1
    assert pick_splits(200, 1, 32768, 128, 2, 132) == 1  # the batch alone fills the GPU


@pytest.mark.parametrize("lens", [[0, 5], [64, 150]], ids=["short", "long"])
def test_reference_is_the_masked_sdpa_of_the_torch_path(device, lens):
    args = make_inputs(lens, 16, 8, 2, 32, 150, torch.float32, device, seed=7)
    assert_close("ref", reference(*args), sdpa_path(*args), 1e-5)


def test_strided_block_views_and_a_layer_of_the_cache(device):
    """k_blk / v_blk as views of a fused projection, the cache as one layer of [n, B, S, g, d]."""
    gen = torch.Generator().manual_seed(3)
    b, t, h, g, d, s = 2, 5, 8, 2, 16, 40
    qkv = torch.randn(b, t, h + 2 * g, d, generator=gen).to(device)
    q, k_blk, v_blk = qkv[:, :, :h], qkv[:, :, h : h + g], qkv[:, :, h + g :]
    caches = torch.randn(2, 3, b, s, g, d, generator=gen).to(device)
    new_len = torch.tensor([7, 33], device=device)
    args = (q, caches[0, 1], caches[1, 1], new_len, k_blk, v_blk)
    assert_close("views", drafter_attention(*args), reference(*args), 1e-5)


def test_new_len_is_read_on_the_device_and_changes_the_result(device):
    """The same launch with other lengths (what a CUDA graph replay does) gives the other result."""
    q, ck, cv, new_len, kb, vb = make_inputs([20, 90], 4, 4, 2, 32, 100, torch.float32, device, seed=1)
    ck, cv = ck.nan_to_num(), cv.nan_to_num()
    first = drafter_attention(q, ck, cv, new_len, kb, vb)
    new_len.copy_(torch.tensor([90, 20]))
    second = drafter_attention(q, ck, cv, new_len, kb, vb)
    assert_close("second", second, reference(q, ck, cv, new_len, kb, vb), 1e-5)
    assert (first - second).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t, h, g, d", [(16, 8, 4, 32), (16, 32, 8, 128), (8, 16, 16, 64), (1, 32, 4, 128)])
def test_gpu_sweep(dtype, t, h, g, d):
    lens = [0, 1, 63, 64, 65, 200, 1000, 4095, 4096]
    args = make_inputs(lens, t, h, g, d, 4096, dtype, torch.device("cuda"), seed=t + h + g + d)
    assert_close("out", drafter_attention(*args), reference(*args), TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 7, 40])
def test_gpu_split_sweep(splits):
    """Kimi-K2.5 drafter share shapes (8 query heads, 1 kv head of 128, block 8) at long contexts."""
    lens = [0, 65, 8191, 32768]
    args = make_inputs(lens, 8, 8, 1, 128, 32768, torch.bfloat16, torch.device("cuda"), seed=11)
    assert_close("out", drafter_attention(*args, num_splits=splits), reference(*args), TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 7])
def test_gpu_graph_replay_reads_new_lengths(splits):
    q, ck, cv, new_len, kb, vb = make_inputs([30, 200], 16, 8, 4, 32, 256, torch.bfloat16, "cuda", seed=2)
    drafter_attention(q, ck, cv, new_len, kb, vb, num_splits=splits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = drafter_attention(q, ck, cv, new_len, kb, vb, num_splits=splits)
    new_len.copy_(torch.tensor([0, 7], device="cuda"))
    graph.replay()
    assert_close("replay", out, reference(q, ck, cv, new_len, kb, vb), TOL[torch.bfloat16])
