"""The DFlash drafter's kernel path (impl "triton": drafter/fused.py over the Triton kernels, in the
interpreter on the CPU) against its torch reference path (impl "ref", the SDPA forward): the same
hidden states, cache rows and lengths over ragged rounds, the same draft logits for the shipped
kimi-nano drafter, the same greedy engine output; parameters packed as views keep their names, values
and checkpoints."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from kdtree_engine.drafter import DFlashDrafter, load_drafter, random_drafter, save_drafter
from kdtree_engine.drafter.packed import packed_weights
from tests.drafter.tiny import CFG
from tests.kernels.test_drafter_attention import assert_close

F_IN = len(CFG.target_layer_ids) * CFG.hidden_size
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def run_rounds(drafter, rounds, impl, seed=0, max_len=32):
    """Feeds the same ragged rounds (context rows per request) to a fresh cache on the drafter's device:
    ([(hidden, seqlens) per round], cache)."""
    dtype, dev = drafter.fc.weight.dtype, drafter.fc.weight.device
    gen = torch.Generator().manual_seed(seed)
    cache = drafter.new_cache(len(rounds[0]), max_len)
    outs = []
    for lens in rounds:
        b, c = len(lens), max(lens)
        context = (100 * torch.randn(b, c, F_IN, generator=gen)).to(dev, dtype)  # garbage padding rows too
        block = torch.randn(b, CFG.block_size, CFG.hidden_size, generator=gen).to(dev, dtype)
        lens_t = torch.tensor(lens, device=dev)
        start = cache.seqlens + lens_t
        kept = block.clone()
        outs.append((drafter(block, context, lens_t, start, cache, impl=impl), cache.seqlens.clone()))
        assert torch.equal(block, kept), "forward must not write into block_embeds"
    return outs, cache


def assert_same_cache(got, want, tol):
    for r, n in enumerate(want.seqlens.tolist()):  # the rows in use; padding rows may differ in order
        assert_close("cache k", got.k[:, r, :n], want.k[:, r, :n], tol)
        assert_close("cache v", got.v[:, r, :n], want.v[:, r, :n], tol)


ROUNDS = {
    "ragged": [[5, 3, 0], [2, 4, 1], [1, 1, 5], [0, 0, 0]],
    "one-row": [[1], [1], [5]],
    "full": [[5, 5], [5, 5], [5, 5], [5, 5], [5, 5], [5, 5]],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounds", ROUNDS.values(), ids=ROUNDS.keys())
def test_kernel_path_equals_reference_path(device, dtype, rounds):
    drafter = random_drafter(CFG, seed=3, dtype=dtype, device=device)
    want, want_cache = run_rounds(drafter, rounds, "ref")
    got, got_cache = run_rounds(drafter, rounds, "triton")
    for (h_got, len_got), (h_want, len_want) in zip(got, want):
        assert torch.equal(len_got, len_want)
        assert_close("hidden", h_got, h_want, TOL[dtype])
    assert_same_cache(got_cache, want_cache, TOL[dtype])


def test_attention_biases(device):
    drafter = random_drafter(replace(CFG, attention_bias=True), seed=8, device=device)
    want, _ = run_rounds(drafter, ROUNDS["ragged"], "ref")
    got, _ = run_rounds(drafter, ROUNDS["ragged"], "triton")
    for (h_got, _), (h_want, _) in zip(got, want):
        assert_close("hidden", h_got, h_want, TOL[torch.float32])


def test_a_context_of_no_rows_still_drafts(device):
    drafter = random_drafter(CFG, seed=4, device=device)
    block = torch.randn(1, CFG.block_size, CFG.hidden_size, device=device)
    empty, start = torch.zeros(1, 0, F_IN, device=device), torch.tensor([0], device=device)
    got = drafter(block, empty, start, start, drafter.new_cache(1, 8), impl="triton")
    want = drafter(block, empty, start, start, drafter.new_cache(1, 8), impl="ref")
    assert_close("hidden", got, want, 1e-4)


def test_impl_is_checked_and_float64_runs_the_reference():
    drafter = random_drafter(CFG, seed=5, dtype=torch.float64)  # on the CPU, even on CUDA machines
    block = torch.randn(1, CFG.block_size, CFG.hidden_size, dtype=torch.float64)
    args = (block, torch.randn(1, 2, F_IN, dtype=torch.float64), torch.tensor([2]), torch.tensor([2]))
    with pytest.raises(ValueError, match="impl"):
        drafter(*args, drafter.new_cache(1, 8), impl="cuda")
    assert not drafter.uses_kernels("triton", block.device)
    assert torch.equal(
        drafter(*args, drafter.new_cache(1, 8), impl="triton"), drafter(*args, drafter.new_cache(1, 8))
    )
    assert drafter._packed is None  # the reference never packs


def test_packing_keeps_names_values_and_checkpoints(tmp_path):
    drafter = random_drafter(CFG, seed=6)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    params = dict(drafter.named_parameters())
    packed = packed_weights(drafter)
    after = drafter.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(params[k] is p for k, p in drafter.named_parameters())  # an optimizer's references hold
    q = drafter.layers[1].self_attn.q_proj.weight
    with torch.no_grad():
        q.mul_(2)  # in-place updates reach the fused buffer
    assert torch.equal(packed.qkv[1, : q.shape[0]], q)
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())


def test_a_dtype_change_repacks(device):
    drafter = random_drafter(CFG, seed=7, device=device)
    old = packed_weights(drafter)
    drafter.to(torch.bfloat16)
    assert not old.intact()
    new = packed_weights(drafter)
    assert new.intact() and new.qkv.dtype == torch.bfloat16
    want, _ = run_rounds(drafter, ROUNDS["one-row"], "ref")
    got, _ = run_rounds(drafter, ROUNDS["one-row"], "triton")
    assert_close("hidden", got[-1][0], want[-1][0], TOL[torch.bfloat16])


def nano(device, dtype=torch.float32):
    from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH
    from kdtree_engine.model import load_model

    return load_model(KIMI_NANO, dtype, device), load_drafter(KIMI_NANO_DFLASH, dtype, device)


def test_shipped_kimi_nano_drafter_drafts_the_same_logits(device):
    target, drafter = nano(device)
    gen = torch.Generator().manual_seed(0)
    f = len(drafter.target_layer_ids) * drafter.config.hidden_size
    ctx = torch.randn(2, 70, f, generator=gen).to(device)
    lens, bonus = torch.tensor([70, 41], device=device), torch.tensor([5, 9], device=device)
    logits = {}
    for impl in ("ref", "triton"):
        logits[impl] = drafter.draft(target, ctx, lens, bonus, lens, drafter.new_cache(2, 128), impl=impl)
    assert_close("logits", logits["triton"], logits["ref"], 1e-4)
    assert torch.equal(logits["triton"].argmax(-1), logits["ref"].argmax(-1))


class _KernelDrafter(DFlashDrafter):
    """A DFlash drafter that always drafts through the kernels (the engine passes no impl to draft)."""

    def draft(self, *args, impl=None):
        return super().draft(*args, impl="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; on CUDA tests/engine/test_gpu.py")
def test_greedy_engine_output_through_the_kernel_drafter():
    from kdtree_engine.engine import GenerationConfig, generate
    from kdtree_engine.model import greedy_generate
    from tests.engine.helpers import random_prompts, tiny_drafter, tiny_target

    target = tiny_target(0)
    drafter = copy.deepcopy(tiny_drafter(0, block_size=4))
    drafter.__class__ = _KernelDrafter
    prompts = random_prompts(0, [3, 6], target.config.vocab_size)
    expected = greedy_generate(target, prompts, 6)
    for method, budget in (("dflash", None), ("ddtree", 4)):
        config = GenerationConfig(max_new_tokens=6, method=method, budget=budget, impl="ref")
        reference = generate(target, tiny_drafter(0, block_size=4), prompts, config)
        out = generate(target, drafter, prompts, config)
        assert out.tokens == expected, method
        assert out.stats.accept_lengths == reference.stats.accept_lengths, method  # the same drafts


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_captured_draft_replays_new_rounds():
    """draft() through the kernels captured once in a CUDA graph, replayed on new inputs and lengths,
    equals eager drafts of the same rounds (bf16 kimi-nano)."""
    target, drafter = nano("cuda", torch.bfloat16)
    f, t = len(drafter.target_layer_ids) * drafter.config.hidden_size, drafter.block_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    prefix = torch.randn(3, 90, f, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.tensor([90, 40, 7], device="cuda")
    bonus = torch.tensor([3, 4, 5], device="cuda")
    ctx = torch.zeros(3, t, f, device="cuda", dtype=torch.bfloat16)
    ctx_lens, start = torch.zeros_like(lens), torch.zeros_like(lens)
    eager, graphed = drafter.new_cache(3, 200), drafter.new_cache(3, 200)
    for cache in (eager, graphed):
        drafter.draft(target, prefix, lens, bonus, lens, cache)
    drafter.draft(target, ctx, ctx_lens, bonus, graphed.seqlens + ctx_lens, graphed)  # C = t compiled
    graphed.seqlens.copy_(eager.seqlens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = drafter.draft(target, ctx, ctx_lens, bonus, start, graphed)
    graphed.seqlens.copy_(eager.seqlens)
    for step in range(3):
        ctx.normal_(generator=gen)
        ctx_lens.copy_(torch.tensor([5, 16, 1 + step], device="cuda"))
        start.copy_(eager.seqlens + ctx_lens)
        bonus.random_(0, target.config.vocab_size, generator=gen)
        want = drafter.draft(target, ctx, ctx_lens, bonus, start, eager)
        graph.replay()
        assert torch.equal(graphed.seqlens, eager.seqlens)
        assert_close("replay", out, want, 1e-3)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_kimi_nano_bf16_kernels_near_the_reference():
    target, drafter = nano("cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    f = len(drafter.target_layer_ids) * drafter.config.hidden_size
    ctx = torch.randn(4, 200, f, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens, bonus = torch.tensor([200, 150, 64, 1], device="cuda"), torch.tensor([5, 9, 11, 12], device="cuda")
    logits = {}
    for impl in ("ref", "triton"):
        logits[impl] = drafter.draft(target, ctx, lens, bonus, lens, drafter.new_cache(4, 256), impl=impl)
    rel = (logits["triton"] - logits["ref"]).norm() / logits["ref"].norm()
    assert rel < 2e-2, rel
    assert (logits["triton"].argmax(-1) == logits["ref"].argmax(-1)).float().mean() > 0.9
