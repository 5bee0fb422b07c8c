"""`kdtree-engine bench kimi` on the CPU: the routings draw the distinct experts they promise; the
per-GPU attention and MoE shares add up over the ranks to the whole layer (float64, the reference ops),
so what the bench times is a real share; the MoE share's kernel path equals its reference (Triton
interpreter); the projection's arithmetic; the measuring sections end to end at small shapes with a
stand-in timer, `--from` re-projecting their json; the CLI's errors. The GPU run is
`scripts/gpu_check.sh kimi`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from kdtree_engine.bench import kimi, kimi_measure
from kdtree_engine.bench import kimi_projection as projection
from kdtree_engine.bench import kimi_routing as routing
from kdtree_engine.bench.attention import _tree_visibility
from kdtree_engine.bench.experts import uniform_touched
from kdtree_engine.bench.kimi_layer import (
    KIMI_K2,
    AttentionShard,
    DrafterShape,
    MoEShard,
    Shard,
    randomize_,
)
from kdtree_engine.bench.timing import Timing
from kdtree_engine.cli import main
from kdtree_engine.ref.moe import moe_experts_ref

SMALL = KIMI_K2.replace(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=8,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=16,
    num_experts_per_tok=4,
    num_hidden_layers=4,
)
SMALL_DRAFTER = DrafterShape(layers=2, hidden=64, heads=8, kv_heads=2, head_dim=16, intermediate=96, block=4)
KIMI = routing.ExpertGrid()


# routing


@pytest.mark.parametrize("n", [1, 9, 33])
def test_uniform_routing_touches_what_uniform_choice_touches(n):
    ids = routing.route(KIMI, 300, n, "uniform", seed=n)
    assert ids.shape == (300 * n, 8) and int(ids.min()) >= 0 and int(ids.max()) < 384
    assert all(len(set(row.tolist())) == 8 for row in ids)  # k distinct experts per token
    want = uniform_touched(384, 8, n)
    assert abs(routing.distinct_per_request(ids, 300) - want) < 0.03 * want + 0.01


@pytest.mark.parametrize("n", [9, 17, 33, 65])
def test_nano_routing_touches_the_measured_share_of_uniform(n):
    ids = routing.route(KIMI, 300, n, "nano", seed=n)
    want = routing.nano_ratio(n) * uniform_touched(384, 8, n)
    got = routing.distinct_per_request(ids, 300)
    assert abs(got - want) < 0.03 * want, (got, want)
    assert got < 0.97 * uniform_touched(384, 8, n)  # fewer than uniform: the routing is not uniform


def test_nano_ratio_interpolates_the_measured_points():
    assert routing.nano_ratio(1) == 1.0 and routing.nano_ratio(9) == 0.83 and routing.nano_ratio(33) == 0.91
    assert routing.nano_ratio(13) == pytest.approx(0.83 + 0.03 * 4 / 7)
    assert routing.nano_ratio(5) == pytest.approx(1.0 - 0.17 * 4 / 8)
    assert routing.nano_ratio(200) == 0.95
    with pytest.raises(ValueError, match="tokens"):
        routing.nano_ratio(0)
    with pytest.raises(ValueError, match="routing"):
        routing.route(KIMI, 1, 1, "zipf")
    with pytest.raises(ValueError, match="ranks"):
        routing.ExpertGrid(384, 8, 7)


def test_local_ids_and_the_busiest_rank():
    grid = routing.ExpertGrid(16, 2, 4)
    ids = torch.tensor([[0, 5], [6, 7], [4, 15]])
    assert routing.local_ids(ids, grid, 1).tolist() == [[-1, 1], [2, 3], [0, -1]]
    assert routing.rank_load(ids, grid, 1) == (4, 4)
    assert routing.rank_load(ids, grid, 0) == (1, 1)
    assert routing.busiest_rank(ids, grid) == 1
    assert routing.busiest_rank(torch.tensor([[0, 15]]), grid) == 0  # a tie: the lower rank


# the shares add up to the whole layer


def test_moe_shares_sum_to_the_whole_layer():
    """ep = tp = 2: each rank's routed experts and slice of the shared expert's width; the sum of the
    shares equals the whole MoE (ref.moe) on the same normed input."""
    shard = Shard(tp=2, ep=2, model=SMALL, drafter=SMALL_DRAFTER)
    parts = [randomize_(MoEShard(shard, r).double(), seed=0) for r in range(2)]
    gen = torch.Generator().manual_seed(1)
    w_gate_up = torch.randn(16, 64, 64, generator=gen, dtype=torch.float64) / 8
    w_down = torch.randn(16, 64, 32, generator=gen, dtype=torch.float64) / 6
    shared = [torch.randn(s, generator=gen, dtype=torch.float64) / 7 for s in [(32, 64), (32, 64), (64, 32)]]
    with torch.no_grad():
        for r, part in enumerate(parts):
            part.gate_up_proj.copy_(w_gate_up[8 * r : 8 * r + 8])
            part.down_proj.copy_(w_down[8 * r : 8 * r + 8])
            part.shared_gate.copy_(shared[0][16 * r : 16 * r + 16])
            part.shared_up.copy_(shared[1][16 * r : 16 * r + 16])
            part.shared_down.copy_(shared[2][:, 16 * r : 16 * r + 16])
    x = torch.randn(3, 5, 64, generator=gen, dtype=torch.float64)
    ids = routing.route(shard.experts, 3, 5, "uniform", seed=2)
    weights = torch.rand(15, 4, generator=gen)
    got = sum(part(x, weights, ids, "ref") for part in parts)
    h = parts[0].post_attention_layernorm(x).reshape(15, 64)
    want = moe_experts_ref(h, weights, ids, w_gate_up, w_down, tuple(shared)).view_as(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _head_slice(whole: AttentionShard, part: AttentionShard, r: int, heads: int) -> None:
    """Copies into `part` rank r's share of `whole`'s MLA: the shared projections whole, q_b_proj and
    kv_b_proj rows of its heads, o_proj columns of its heads."""
    c = whole.c
    dq, dkv, dv = c.qk_head_dim, c.qk_nope_head_dim + c.v_head_dim, c.v_head_dim
    cuts = {
        "self_attn.q_b_proj.weight": (0, dq),
        "self_attn.kv_b_proj.weight": (0, dkv),
        "self_attn.o_proj.weight": (1, dv),
    }
    own = dict(part.named_parameters())
    with torch.no_grad():
        for name, p in whole.named_parameters():
            dim, width = cuts.get(name, (None, None))
            if dim is None:
                own[name].copy_(p)
            else:
                own[name].copy_(p.narrow(dim, r * heads * width, heads * width))


def test_attention_shares_sum_to_the_whole_layer():
    """tp = 2: each rank's heads; the sum of the shares' outputs equals the whole MLA's, and every
    share writes the same latent rows into its copy of the cache."""
    shard = Shard(tp=2, ep=2, model=SMALL, drafter=SMALL_DRAFTER)
    whole = randomize_(AttentionShard(SMALL).double(), seed=3)
    parts = [AttentionShard(shard.attention_config).double() for _ in range(2)]
    for r, part in enumerate(parts):
        _head_slice(whole, part, r, 4)
    b, t, prefix = 2, 5, 7
    gen = torch.Generator().manual_seed(4)
    vis = _tree_visibility(b, t, gen)
    kv = torch.randn(b, prefix + t, SMALL.latent_dim, generator=gen, dtype=torch.float64)
    x = torch.randn(b, t, 64, generator=gen, dtype=torch.float64)
    caches = [kv.clone() for _ in range(3)]
    want = whole(x, caches[0], whole.context(b, t, prefix, vis, "ref"))
    got = sum(
        part(x, cache, part.context(b, t, prefix, vis, "ref")) for part, cache in zip(parts, caches[1:])
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert torch.equal(caches[1], caches[0]) and torch.equal(caches[2], caches[0])


def test_moe_share_kernel_equals_its_reference(device):
    """The MoE share on the kernel path (router and experts kernels, remote experts -1) against the
    reference ops, float32."""
    shard = Shard(tp=2, ep=4, model=SMALL, drafter=SMALL_DRAFTER)
    part = randomize_(MoEShard(shard, 2), seed=5).to(device)
    ids = routing.route(shard.experts, 2, 9, "nano", seed=6)
    part.rank = routing.busiest_rank(ids, shard.experts)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 9, 64, generator=gen).to(device)
    weights = torch.rand(18, 4, generator=gen).to(device)
    got = part(x, weights, ids.to(device), "triton").cpu()
    want = part.cpu()(x.cpu(), weights.cpu(), ids, "ref")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_shard_rejects_cuts_that_do_not_divide():
    with pytest.raises(ValueError, match="tp"):
        Shard(tp=3)
    with pytest.raises(ValueError, match="ranks"):
        Shard(ep=5)
    assert Shard().attention_config.num_attention_heads == 8 and Shard().experts.per_rank == 48
    assert Shard().shared_width == 256 and Shard().vocab == 20480


# projection


def test_collectives_follow_the_alpha_beta_model():
    comm = projection.Collectives(10.0, 100.0, 4)
    assert comm.all_reduce_us(1e6) == pytest.approx(10.0 + 1.5 * 1e6 / 1e5)
    assert comm.all_gather_us(1e6) == pytest.approx(10.0 + 0.75 * 1e6 / 1e5)
    assert projection.Collectives(ranks=1).all_reduce_us(1e9) == 0.0
    with pytest.raises(ValueError):
        projection.Collectives(bus_gbps=0)


def test_published_profiles_scale_kimi_nano_and_cap_at_the_block():
    mt, math = projection.PROFILES[:2]
    assert mt.dflash == 3.7 and mt.ddtree[32] == pytest.approx(3.7 * 5.27 / 3.95)
    assert math.ddtree[64] == 8.0  # 5.5 x 5.80 / 3.95 = 8.08: capped at the block
    assert all(mt.ddtree[a] < mt.ddtree[b] for a, b in [(8, 16), (16, 32), (32, 64)])


def _synthetic(budgets=(8,)) -> dict:
    """Every row the projection reads at batch 2, prefix 1024, nano routing, with round numbers."""
    rows: dict = {"attention": [], "moe": [], "plan": [], "lm_head": []}
    for n in [1, 8] + [b + 1 for b in budgets]:
        rows["attention"].append({"batch": 2, "tokens": n, "prefix": 1024, "us": 10.0 + n})
        rows["moe"].append({"batch": 2, "tokens": n, "routing": "nano", "us": 20.0 + 2 * n})
        rows["plan"].append({"batch": 2, "tokens": n, "prefix": 1024, "us": 3.0})
        rows["lm_head"].append({"batch": 2, "tokens": n, "us": 50.0})
    rows["drafter"] = [{"batch": 2, "prefix": 1024, "layer_us": 30.0, "fixed_us": 100.0}]
    rows["tree"] = [{"batch": 2, "budget": b, "us": 40.0} for b in budgets]
    rows["port_tree"] = [{"batch": 2, "budget": b, "us": 400.0} for b in budgets]
    rows["port_attention"] = [
        {
            "batch": 2,
            "t": b + 1,
            "prefix": 1024,
            "port_step_us": 300.0,
            "port_kernel_us": 100.0,
            "ours_step_us": 30.0,
            "ours_run_us": 20.0,
        }
        for b in budgets
    ]
    return rows


def test_round_times_add_up_the_measured_parts():
    counts = projection.ModelCounts(layers=3, draft_layers=2, hidden=10, vocab=100, block=8)
    comm = projection.Collectives(5.0, 1.0, 2)  # 1 GB/s: 1000 bytes per microsecond
    m, pt = projection.Measured(_synthetic()), projection.Point(2, 1024, "nano")
    ar = (
        3 * (11.0 + 22.0)
        + 3.0
        + 50.0
        + 2 * 3 * (5.0 + 1.0 * 2 * 1 * 10 * 2 / 1e3)
        + 5.0
        + 0.5 * 2 * 100 * 2 / 1e3
    )
    assert projection.forward_us(m, pt, 1, counts, comm) == pytest.approx(ar)
    draft = 100.0 + 2 * 30.0 + 2 * 2 * (5.0 + 1.0 * 2 * 8 * 10 * 2 / 1e3)
    assert projection.draft_us(m, pt, counts, comm) == pytest.approx(draft)
    r = projection.rounds(m, pt, (8,), counts, comm)
    assert r.ar == pytest.approx(ar)
    assert r.ddtree[8] == pytest.approx(draft + 40.0 + projection.forward_us(m, pt, 9, counts, comm))
    assert r.dflash == pytest.approx(draft + projection.forward_us(m, pt, 8, counts, comm))
    swapped = r.ddtree[8] - 40.0 + 400.0 + 3 * (100.0 - 20.0) + (200.0 - 10.0)
    assert r.port[8] == pytest.approx(swapped)


def test_projection_picks_the_best_option_and_marks_what_is_missing():
    counts, comm = projection.ModelCounts(layers=3, draft_layers=2), projection.Collectives()
    m = projection.Measured(_synthetic())
    tau = projection.Acceptance("t", "test", 2.0, {8: 4.0, 16: 9.0})
    p = projection.project(m, projection.Point(2, 1024, "nano"), tau, (8, 16), counts, comm)
    assert p["ddtree"][16] is None and p["port"][16] is None  # budget 16 was not measured
    best = max([("AR", p["ar"]), ("B8", p["ddtree"][8])], key=lambda kv: kv[1])
    assert (p["auto_choice"], p["auto"]) == best
    assert p["ddtree"][8] == pytest.approx(4.0 / p["rounds"].ddtree[8] * 1e6)
    text = projection.report(
        _synthetic(),
        [projection.Point(2, 1024, "nano"), projection.Point(4, 1024, "nano")],
        budgets=(8,),
        counts=counts,
    )
    assert text.count("| nano | 1024 | 4 | - |") == 3  # batch 4 unmeasured: one row per profile


# the sections end to end (small shapes, stand-in timer)


def _stand_in_timer(fn, rep_ms=0.0):
    fn()
    return Timing(10.0, 9.0, 11.0, 1, "stand-in")


def test_sections_measure_every_point_and_the_json_reprojects(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kimi_measure, "time_graph", _stand_in_timer)
    args = SimpleNamespace(
        batch=[1, 2],
        tokens=[1, 4, 5],
        prefixes=[8],
        routings=["uniform", "nano"],
        budgets=[4],
        rep_ms=1.0,
        seed=0,
        iters=1,
        reps=1,
        tp=2,
        out=tmp_path,
        allreduce_us=15.0,
        bus_gbps=460.0,
        row_invariant=False,
    )
    shard = Shard(tp=2, ep=4, model=SMALL, drafter=SMALL_DRAFTER)
    grid = {k: getattr(args, k) for k in ("batch", "tokens", "prefixes", "routings", "budgets", "tp")}
    results = {"header": "test run", "grid": {**grid, "counts": kimi.counts_of(shard).__dict__}, "errors": []}
    run = SimpleNamespace(
        args=args,
        shard=shard,
        device=torch.device("cpu"),
        copy_bw=1e12,
        emit=lambda s, row: results.setdefault(s, []).append(row),
    )
    for section in ("layer", "drafter", "tree"):
        kimi_measure.SECTIONS[section](run)
    sections = ("attention", "plan", "moe", "lm_head", "drafter", "drafter_attention", "tree")
    counts = {s: len(results[s]) for s in sections}
    assert counts == dict(attention=6, plan=6, moe=12, lm_head=6, drafter=2, drafter_attention=2, tree=2)
    assert all(r["splits"] == 1 and r["max_diff"] == 0.0 for r in results["drafter_attention"])  # 8 rows
    assert {r["kernel"] for r in results["attention"]} == {"ref"}
    assert all(0 < r["experts_rank"] <= 4 for r in results["moe"])  # ep = 4: four experts per rank
    assert all(r["tokens"] == 1 or r["over_roofline"] > 0 for r in results["moe"])
    text = kimi.write(results, args)
    assert "| 8 | 2 | 10.0 | 10.0 | 0.0 | 10.0 |" in text  # the drafter: the same stand-in time twice
    assert "| 8 | 2 | 1 | 10.0 | 10.0 |" in text  # its attention: one split for 8 context rows
    assert "Projected round" in text and "Kimi-K2.5-DFlash, MT-Bench" in text
    saved = tmp_path / "kimi_bench.json"
    assert json.loads(saved.read_text())["moe"] == results["moe"]
    capsys.readouterr()
    assert (
        main(["bench", "kimi", "--from", str(saved), "--out", str(tmp_path / "again"), "--budgets", "4"]) == 0
    )
    assert (tmp_path / "again" / "kimi_bench.md").read_text() == text


@pytest.mark.gpu
@pytest.mark.parametrize("invariant", [False, True])
def test_sections_capture_and_time_on_the_gpu(invariant):
    """The sections on CUDA at small shapes with the real timer: every forward captures in a graph and
    replays (kernel paths: attention plan, router and expert kernels with remote experts, the drafter's
    kernels, our tree path)."""
    args = SimpleNamespace(
        batch=[1, 3],
        tokens=[1, 9],
        prefixes=[64],
        routings=["nano"],
        budgets=[8],
        rep_ms=5.0,
        seed=0,
        iters=2,
        reps=2,
        row_invariant=invariant,
    )
    results: dict = {}
    run = SimpleNamespace(
        args=args,
        shard=Shard(tp=2, ep=4, model=SMALL, drafter=SMALL_DRAFTER),
        device=torch.device("cuda"),
        copy_bw=3e12,
        emit=lambda s, row: results.setdefault(s, []).append(row),
    )
    for section in ("layer", "drafter", "tree"):
        kimi_measure.SECTIONS[section](run)
    timed = [r for s in ("attention", "plan", "moe", "lm_head", "tree") for r in results[s]]
    assert len(timed) == 4 + 4 + 4 + 4 + 2 and all(r["us"] > 0 for r in timed)
    assert {r["kernel"] for r in results["attention"]} <= ({"triton"} if invariant else {"triton", "hopper"})
    assert all(r["one_layer_us"] > 0 and r["two_layer_us"] > 0 for r in results["drafter"])


# the command line


def _err(capsys, *argv) -> str:
    try:
        rc = main(["bench", "kimi", *argv])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_cli_errors_name_the_argument(capsys, tmp_path):
    assert "tokens:" in _err(capsys, "--tokens", "2", "4")
    assert "batch:" in _err(capsys, "--batch", "0")
    assert "tp" in _err(capsys, "--tp", "3")
    assert "from:" in _err(capsys, "--from", str(tmp_path / "missing.json"))
    assert "allreduce-us" in _err(capsys, "--allreduce-us", "-1")
    assert "into:" in _err(capsys, "--into", str(tmp_path / "missing.json"))
    if not torch.cuda.is_available():
        assert "device:" in _err(capsys, "--out", str(tmp_path))


def test_into_takes_an_earlier_run_of_the_same_grid_only(tmp_path):
    path = tmp_path / "kimi_bench.json"
    path.write_text(json.dumps({"header": "first call", "grid": {"batch": [1]}, "moe": [{"us": 1.0}]}))
    again = kimi.earlier_run(path, {"batch": [1]}, "second call")
    assert again["header"] == "first call\n\nsecond call" and again["moe"] == [{"us": 1.0}]
    with pytest.raises(ValueError, match="into: .* another grid"):
        kimi.earlier_run(path, {"batch": [1, 4]}, "second call")
