"""The Triton kernels compiled for an H200 (sm_90) exactly as the package launches them (launch_compile.py:
the real forward, draft and attention plans on CPU tensors, every launch compiled and none run), at
the shapes that matter: one GPU's share of Kimi-K2 under 8-way tensor parallelism (hidden 7168, 8 MLA
heads on a 512 + 64 latent cache, a 1024-token prefix; 2 layers and 8 experts, which changes no kernel),
its DFlash drafter's share (8 query heads and 1 KV head of 128), the shipped kimi-nano pair, and the
attention at decode on a contiguous cache and on pages of 64 and of 1 (SGLang's). bf16, batch 2.

What a GPU run would only show as time: whether the kernels that stream weights or a cache read it
16 bytes at a time and keep a tile's copy in flight while the previous one is used. Each property
failed before the fix it holds in place: the paged decode attention had one tile buffer (refilled only
after use), the drafter's attention and the row-invariant projection read bf16 two bytes at a time
and synchronously, because strides kept out of Triton's specialization hid the rows' alignment."""

from __future__ import annotations

import pytest
from tests.kernels.launch_compile import run_launch_script
from tests.kernels.offline_compile import MAX_SHARED

SCENARIOS = r"""
from types import SimpleNamespace
from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH
from kdtree_engine.attention import plan_attention
from kdtree_engine.bench.forward_cost import draft_call, forward_call
from kdtree_engine.bench.kimi_layer import KIMI_K2, Shard, drafter_shard
from kdtree_engine.drafter import load_drafter
from kdtree_engine.model.loader import load_model
from kdtree_engine.model.testing import random_model

bf = torch.bfloat16
found = {}
torch.manual_seed(0)
with torch.no_grad():
    kimi = KIMI_K2.replace(num_hidden_layers=2, num_attention_heads=8, n_routed_experts=8, vocab_size=4096,
                           intermediate_size=2048, moe_intermediate_size=256)
    target = aligned(random_model(kimi, dtype=bf))
    for t in (1, 33):
        forward_call(target, 2, t, 1024, "triton")()
        found[f"kimi t={t}"] = launched()
        cache = target.new_cache(2, 1024 + t)
        cache.seqlens.fill_(1024)
        target(torch.zeros(2, t, dtype=torch.long), cache, impl="triton", validate=False, row_invariant=True)
        found[f"kimi row-invariant t={t}"] = launched()
    drafter, stand_in = drafter_shard(Shard(), 1)
    drafter = aligned(drafter.to(bf))
    stand_in = SimpleNamespace(embed_tokens=aligned(stand_in.embed_tokens.to(bf)),
                               lm_head=aligned(stand_in.lm_head.to(bf)))
    b, block = 2, drafter.block_size
    cache = drafter.new_cache(b, 1024 + 2 * block)
    cache.seqlens.fill_(1024)
    lens = torch.full((b,), 3)
    context = torch.zeros(b, block, drafter.fc.in_features, dtype=bf)
    drafter.draft(stand_in, context, lens, torch.zeros(b, dtype=torch.long), cache.seqlens + lens, cache,
                  impl="triton")
    found["kimi drafter"] = launched()

    nano = aligned(load_model(KIMI_NANO, dtype=bf))
    nano_drafter = aligned(load_drafter(KIMI_NANO_DFLASH, dtype=bf))
    for t in (1, 33):
        forward_call(nano, 2, t, 256, "triton")()
        found[f"nano t={t}"] = launched()
    draft_call(nano_drafter, nano, 2, 256, "triton")[1]()
    found["nano drafter"] = launched()

    s = 4096
    for h, t in ((8, 1), (64, 9)):
        q = torch.zeros(2, t, h, 576, dtype=bf)
        for page in (0, 64, 1):
            table = None
            if page:
                kv = torch.zeros(2 * s // page, page, 576, dtype=bf)
                table = torch.arange(2 * s // page, dtype=torch.int32).view(2, -1)
            else:
                kv = torch.zeros(2, s, 576, dtype=bf)
            lengths = torch.full((2,), s, dtype=torch.int64)
            plan = plan_attention(q, kv, lengths, softmax_scale=0.1, d_v=512, block_table=table,
                                  impl="triton", validate=False)
            plan.run(q, kv)
            found[f"attention h={h} t={t} page={page}"] = launched()
print(json.dumps(found))
"""

# Kernels whose time is reading weights or a cache from memory, tile after tile.
STREAMING = (
    "_split_kv_kernel",
    "_drafter_attention_kernel",
    "_linear_kernel",
    "_gate_up_kernel",
    "_down_kernel",
    "_logits_kernel",
)


@pytest.fixture(scope="module")
def launches() -> dict:
    return run_launch_script(SCENARIOS)


def _reports(launches, names=None):
    for scenario, kernels in launches.items():
        for name, reports in kernels.items():
            if names is None or name in names:
                for report in reports:
                    yield f"{scenario}: {name} {report['constants']}", name, report


def test_every_scenario_launched_the_streaming_kernels(launches):
    assert len(launches) == 14
    launched = {name for _, name, _ in _reports(launches)}
    assert set(STREAMING) <= launched, set(STREAMING) - launched
    for h in (8, 64):
        for page in (0, 64, 1):
            assert "_split_kv_kernel" in launches[f"attention h={h} t={1 if h == 8 else 9} page={page}"]


def test_no_kernel_spills_or_overflows_shared_memory(launches):
    for where, _, report in _reports(launches):
        assert report["local"] == 0, f"{where}: spills {report}"
        assert report["shared"] <= MAX_SHARED, f"{where}: {report}"


def test_streaming_kernels_read_16_bytes_at_a_time(launches):
    """No 16-bit global load: bf16 tiles arrive as 16-byte vectors or asynchronous copies (the byte loads
    left are the tree mask's)."""
    for where, _, report in _reports(launches, STREAMING):
        assert report["loads_16bit"] == 0, f"{where}: {report['loads']}"


def test_streaming_kernels_keep_a_copy_in_flight(launches):
    """Every tile a streaming kernel loops over is copied asynchronously into two or more buffers, and the
    loop's first wait leaves copies in flight. The one exception is the Triton attention's 64-row launch
    (t * h > 16): two buffers, refilled once the P V product is issued (a third does not fit next to 64
    query rows of 576); on an H200 the Hopper kernel serves those calls unless the pages are not
    multiples of 64."""
    for where, name, report in _reports(launches, STREAMING):
        assert report["copy_buffers"] and min(report["copy_buffers"]) >= 2, f"{where}: {report}"
        if name == "_split_kv_kernel" and report["constants"]["BLOCK_M"] == 64:
            continue
        assert report["waits"][0] > 0, f"{where}: {report}"
