"""kdtree_engine.integrations.sglang.attention: our tree-verify MLA attention as an SGLang attention
backend, on the CPU (impl="ref", and the Triton kernels through the Triton interpreter).

Against a float64 dense reference that reads SGLang's pool through req_to_token: DDTree target verify on
random trees (padded trees included), ragged prefixes, page sizes 1, 16 and 64 (page boundaries +-1),
decode and draft extend; both of DeepSeek-V2's call forms; the CUDA-graph path (a plan built at capture
reading the static buffers refilled for a replay, padded requests included); bad inputs; fallback
routing. Against the port's own code (KDTREE_SGLANG_DDTREE names a checkout; skipped otherwise): its
AttentionBackend base class and dispatch, its capability check, its compile's padded visibility and
packed custom mask (the mask its Triton / FlashInfer backends read), and install() on a stand-in SGLang
tree holding its real files. The stand-ins below are written from the port's interfaces, not copied.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from kdtree_engine.integrations.sglang import attention, plugin
from kdtree_engine.integrations.sglang.attention import BackendConfig, bind, capability_with_ours

from .port import ENV


# ---- stand-ins for the SGLang pieces the backend touches -------------------------------------------------
class Mode:
    """ForwardMode's predicates for one mode name ("decode", "target_verify", "draft_extend_v2",
    "extend", "idle")."""

    def __init__(self, name: str):
        self.name = name

    def is_idle(self):
        return self.name == "idle"

    def is_decode(self):
        return self.name == "decode"

    def is_target_verify(self):
        return self.name == "target_verify"

    def is_draft_extend_v2(self):
        return self.name == "draft_extend_v2"

    def is_mixed(self):
        return False

    def is_extend(self):
        return self.name in ("extend", "target_verify", "draft_extend_v2")


class Pool:
    """The MLA token pool's interface: per layer [slots + page, 1, d] rows (latent then rope)."""

    def __init__(self, layers: int, slots: int, page: int, d: int, dtype):
        self.kv_buffer = [torch.full((slots + page, 1, d), float("nan"), dtype=dtype) for _ in range(layers)]

    def get_key_buffer(self, layer_id: int):
        return self.kv_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.kv_buffer[layer.layer_id][loc] = cache_k.to(self.kv_buffer[0].dtype)

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope):
        row = torch.cat([cache_k_nope, cache_k_rope], dim=-1)
        self.kv_buffer[layer.layer_id][loc] = row.to(self.kv_buffer[0].dtype)


class Base:
    """The port's AttentionBackend as far as the backend needs it: the hooks with the port's parameters
    and its forward dispatch (decode -> forward_decode, anything else -> forward_extend)."""

    def init_forward_metadata(self, forward_batch):
        self.init_forward_metadata_out_graph(forward_batch)
        self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        pass

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        raise NotImplementedError

    def get_cuda_graph_seq_len_fill_value(self):
        raise NotImplementedError

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        raise NotImplementedError

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        raise NotImplementedError


class Recorder:
    """A fallback backend that records which hooks it was called with."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append(name) or "fallback"


@dataclass(frozen=True)
class Dims:
    h: int = 3
    d_v: int = 64
    d_r: int = 16
    layers: int = 2

    @property
    def d(self) -> int:
        return self.d_v + self.d_r

    @property
    def scale(self) -> float:
        return 0.9 / math.sqrt(self.d)


def layer(dims: Dims, layer_id: int):
    return SimpleNamespace(
        layer_id=layer_id,
        tp_q_head_num=dims.h,
        qk_head_dim=dims.d,
        v_head_dim=dims.d_v,
        scaling=dims.scale,
        logit_cap=0.0,
    )


def random_tree(t: int, size: int, gen) -> torch.Tensor:
    """[t, t] bool visibility of a random tree of `size` real nodes (node 0 the root; a node's parent is
    an earlier node), padded as the port's compile pads: rows past `size` see only themselves."""
    vis = torch.eye(t, dtype=torch.bool)
    for i in range(1, size):
        vis[i] |= vis[int(torch.randint(0, i, (1,), generator=gen))]
    return vis


class Cache:
    """A pool, a req_to_token table and requests with prefixes: pages are handed out shuffled, tokens
    contiguous inside a page (as SGLang's paged allocator does); unused slots are NaN."""

    def __init__(
        self,
        dims: Dims,
        page: int,
        prefixes: list[int],
        new: int,
        gen,
        dtype=torch.float32,
        context: int = 256,
    ):
        self.dims, self.page, self.gen = dims, page, gen
        bs, reqs = len(prefixes), len(prefixes) + 3
        pages_per_req = -(-context // page)
        pages = torch.randperm(reqs * pages_per_req, generator=gen) + 1  # page 0: padding's sink
        self.pool = Pool(dims.layers, (reqs * pages_per_req + 1) * page, page, dims.d, dtype)
        slots = (pages.view(reqs, pages_per_req, 1) * page + torch.arange(page)).view(reqs, -1)
        self.req_to_token = slots[:, :context].to(torch.int32).contiguous()
        self.req_pool_indices = torch.randperm(reqs, generator=gen)[:bs]
        self.prefixes = torch.tensor(prefixes)
        for layer_id in range(dims.layers):
            for r, n in enumerate(prefixes):
                rows = self.req_to_token[self.req_pool_indices[r], :n].long()
                self.pool.kv_buffer[layer_id][rows] = torch.randn(n, 1, dims.d, generator=gen).to(dtype)
        self.new = new

    def runner(self):
        return SimpleNamespace(
            req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token),
            token_to_kv_pool=self.pool,
            page_size=self.page,
            use_mla_backend=True,
        )

    def out_cache_loc(self, starts: torch.Tensor) -> torch.Tensor:
        """[bs * new] slots of the new tokens: req_to_token[r, start_r : start_r + new]."""
        cols = starts[:, None] + torch.arange(self.new)
        return self.req_to_token[self.req_pool_indices[:, None], cols].reshape(-1).long()

    def inputs(self, dtype=torch.float32):
        """Per layer: q [n, h, d], k [n, 1, d] and v = k's latent part [n, 1, d_v]."""
        n, dims = len(self.prefixes) * self.new, self.dims
        out = []
        for _ in range(dims.layers):
            q = torch.randn(n, dims.h, dims.d, generator=self.gen).to(dtype)
            k = torch.randn(n, 1, dims.d, generator=self.gen).to(dtype)
            out.append((q, k, k[..., : dims.d_v]))
        return out


def dense_reference(
    cache: Cache, layer_id: int, q: torch.Tensor, starts: torch.Tensor, allowed
) -> torch.Tensor:
    """float64 attention of the new tokens of each request over req_to_token[r, : start_r + new] read
    from the pool; allowed(r) -> [new, start_r + new] bool mask. Returns [n, h * d_v]."""
    dims, new = cache.dims, cache.new
    outs = []
    for r in range(len(starts)):
        length = int(starts[r]) + new
        rows = cache.req_to_token[cache.req_pool_indices[r], :length].long()
        kv = cache.pool.kv_buffer[layer_id][rows, 0].double()  # [L, d]
        qr = q[r * new : (r + 1) * new].double()  # [new, h, d]
        scores = torch.einsum("thd,sd->ths", qr, kv) * dims.scale
        scores = scores.masked_fill(~allowed(r)[:, None, :], float("-inf"))
        outs.append(torch.einsum("ths,sd->thd", scores.softmax(-1), kv[:, : dims.d_v]))
    return torch.cat(outs).reshape(len(starts) * new, dims.h * dims.d_v)


def tree_mask(prefix: int, vis: torch.Tensor) -> torch.Tensor:
    """[t, prefix + t] bool: the whole prefix, then the tree's visibility."""
    t = vis.shape[0]
    return torch.cat([torch.ones(t, prefix, dtype=torch.bool), vis], dim=1)


def causal_mask(prefix: int, t: int) -> torch.Tensor:
    return tree_mask(prefix, torch.ones(t, t, dtype=torch.bool).tril())


def batch(mode: str, cache: Cache, seq_lens, spec_info=None, seq_lens_cpu=None, out_cache_loc=None):
    """A ForwardBatch's fields the backend reads."""
    return SimpleNamespace(
        forward_mode=Mode(mode),
        batch_size=len(seq_lens),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens_cpu,
        req_pool_indices=cache.req_pool_indices,
        out_cache_loc=out_cache_loc,
        spec_info=spec_info,
    )


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """|got - want| <= tol * (1 + |want|) everywhere; on failure, the worst element."""
    got, want = got.double(), want.double()
    assert not got.isnan().any(), f"{name}: NaN at {got.isnan().nonzero()[0].tolist()}"
    excess = (got - want).abs() - tol * (1 + want.abs())
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{name}: worst at {worst}: got {got.flatten()[worst]:.6g}, want {want.flatten()[worst]:.6g} "
        f"(tol {tol})"
    )


# ---- the backend on stand-ins -----------------------------------------------------------------------
TOL = {
    ("ref", torch.float32): 1e-5,
    ("triton", torch.float32): 1e-4,
    ("ref", torch.bfloat16): 3e-2,
    ("triton", torch.bfloat16): 3e-2,
}


def backend(cache: Cache, impl: str, base: type = Base, fallback=None, validate: bool = True):
    return bind(base)(cache.runner(), fallback=fallback or Recorder(), config=BackendConfig(impl, validate))


def verify_batch(cache: Cache, sizes: list[int], gen, extra: int = 2):
    """A DDTree verify batch: the trees in a worker-sized visibility buffer (wider than the verify width,
    one spare request), sliced as the worker slices it; seq_lens_cpu as the worker sets it (+ t)."""
    bs, t = len(sizes), cache.new
    buf = torch.zeros(bs + 1, t + extra, t + extra, dtype=torch.bool)
    for r, size in enumerate(sizes):
        buf[r, :t, :t] = random_tree(t, size, gen)
    spec = SimpleNamespace(draft_token_num=t, visibility=buf[:, :t, :t])
    seq_lens = cache.prefixes.clone()
    fb = batch("target_verify", cache, seq_lens, spec, seq_lens + t, cache.out_cache_loc(seq_lens))
    return fb, buf[:bs, :t, :t]


def run_layers(be, cache: Cache, fb, dtype, form: str = "cat"):
    """Every layer through the base class's forward, in DeepSeek-V2's `form`: "cat" (q and k with their
    rope dims) or "split" (q_rope / k_rope keyword arguments). Returns [(q, out)] per layer."""
    outs = []
    for layer_id, (q, k, v) in enumerate(cache.inputs(dtype)):
        lay = layer(cache.dims, layer_id)
        if form == "cat":
            out = be.forward(q.reshape(q.shape[0], -1), k, v, lay, fb)
        else:
            d_v = cache.dims.d_v
            out = be.forward(q[..., :d_v], k[..., :d_v], v, lay, fb, q_rope=q[..., d_v:], k_rope=k[..., d_v:])
        outs.append((q, out))
    return outs


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("page,prefixes", [(1, [0, 7, 30]), (16, [15, 16, 17, 1]), (64, [63, 64, 0, 65])])
def test_verify_matches_the_dense_reference(impl, page, prefixes):
    gen = torch.Generator().manual_seed(page + len(impl))
    t = 7
    cache = Cache(Dims(), page, prefixes, t, gen)
    sizes = [t, 1, 4, t][: len(prefixes)]  # a root-only tree and a padded one among them
    fb, vis = verify_batch(cache, sizes, gen)
    be = backend(cache, impl)
    be.init_forward_metadata(fb)
    tree = be.forward_metadata.visibility if impl == "ref" else be.forward_metadata.bits
    assert tree is not None and tree.shape[:2] == (len(prefixes), t)
    for layer_id, (q, out) in enumerate(run_layers(be, cache, fb, torch.float32)):
        want = dense_reference(
            cache, layer_id, q, fb.seq_lens, lambda r: tree_mask(int(fb.seq_lens[r]), vis[r])
        )
        assert_close(f"layer {layer_id}", out, want, TOL[impl, torch.float32])
    assert be.fallback.calls == []


def test_wide_trees_reach_the_kernel_as_visibility():
    """t > 64 nodes: no ancestor bits, the visibility itself."""
    gen = torch.Generator().manual_seed(5)
    t = 66
    cache = Cache(Dims(h=1, layers=1), 1, [3, 0], t, gen, context=96)
    fb, vis = verify_batch(cache, [t, 40], gen)
    be = backend(cache, "triton")
    be.init_forward_metadata(fb)
    assert be.forward_metadata.bits is None and be.forward_metadata.visibility.shape == (2, t, t)
    ((q, out),) = run_layers(be, cache, fb, torch.float32)
    want = dense_reference(cache, 0, q, fb.seq_lens, lambda r: tree_mask(int(fb.seq_lens[r]), vis[r]))
    assert_close("wide tree", out, want, 1e-5)


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("mode,new", [("decode", 1), ("draft_extend_v2", 4)])
def test_decode_and_draft_extend_are_causal(impl, mode, new):
    """seq_lens counts the new tokens (SGLang's decode and DRAFT_EXTEND_V2), which are causal."""
    gen = torch.Generator().manual_seed(new)
    cache = Cache(Dims(), 16, [0, 15, 33], new, gen)
    seq_lens = cache.prefixes + new
    fb = batch(mode, cache, seq_lens, None, seq_lens.clone(), cache.out_cache_loc(cache.prefixes))
    be = backend(cache, impl)
    be.init_forward_metadata(fb)
    for layer_id, (q, out) in enumerate(run_layers(be, cache, fb, torch.float32)):
        want = dense_reference(
            cache, layer_id, q, cache.prefixes, lambda r: causal_mask(int(cache.prefixes[r]), new)
        )
        assert_close(f"{mode} layer {layer_id}", out, want, TOL[impl, torch.float32])


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_both_call_forms_and_bf16(impl):
    """The split form (q_rope / k_rope, the pool's set_mla_kv_buffer) equals the concatenated one; bf16
    within bf16 tolerance of the float64 reference."""
    outs = {}
    for form in ("cat", "split"):
        gen = torch.Generator().manual_seed(11)
        cache = Cache(Dims(), 1, [9, 2], 5, gen, dtype=torch.bfloat16)
        fb, vis = verify_batch(cache, [5, 3], gen)
        be = backend(cache, impl)
        be.init_forward_metadata(fb)
        outs[form] = run_layers(be, cache, fb, torch.bfloat16, form)
        for layer_id, (q, out) in enumerate(outs[form]):
            want = dense_reference(
                cache,
                layer_id,
                q,
                fb.seq_lens,
                lambda r, fb=fb, vis=vis: tree_mask(int(fb.seq_lens[r]), vis[r]),
            )
            assert out.dtype == torch.bfloat16
            assert_close(f"{form} layer {layer_id}", out, want, TOL[impl, torch.bfloat16])
    for (_, a), (_, b) in zip(outs["cat"], outs["split"]):
        assert torch.equal(a, b)


def real_batch(mode: str, cache: Cache, gen):
    """A batch of `mode` and its reference masks: (forward batch, starts, allowed)."""
    if mode == "target_verify":
        fb, vis = verify_batch(cache, [cache.new, 2, 4][: len(cache.prefixes)], gen)
        return fb, fb.seq_lens, lambda r: tree_mask(int(fb.seq_lens[r]), vis[r])
    fb = batch(mode, cache, cache.prefixes + cache.new, None, None, cache.out_cache_loc(cache.prefixes))
    return fb, cache.prefixes, lambda r: causal_mask(int(cache.prefixes[r]), cache.new)


def pad(x: torch.Tensor, size: int, value: int) -> torch.Tensor:
    return torch.cat([x, torch.full((size - len(x), *x.shape[1:]), value, dtype=x.dtype)])


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("mode,t", [("target_verify", 5), ("decode", 1)])
def test_a_captured_plan_reads_the_refilled_graph_buffers(impl, mode, t):
    """The CUDA-graph path without a GPU: metadata written into the static buffers at capture, the plan
    built by the captured forward's first layer; then a replay's metadata (a smaller batch, padded with
    the fill value, other prefixes and trees) written into the same buffers: the plan made at capture,
    run again as the replayed graph would, gives the new batch's attention."""
    gen = torch.Generator().manual_seed(3)
    graph_bs, real_bs = 4, 3
    cache = Cache(Dims(), 16, [17, 40, 3], t, gen)
    be = backend(cache, impl)
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8 * t)
    fill = be.get_cuda_graph_seq_len_fill_value()
    tril = torch.ones(graph_bs, t, t, dtype=torch.bool).tril()
    capture = SimpleNamespace(
        forward_mode=Mode(mode),
        batch_size=graph_bs,
        seq_lens=torch.full((graph_bs,), fill),
        seq_lens_cpu=None,
        req_pool_indices=torch.zeros(graph_bs, dtype=torch.long),
        out_cache_loc=torch.zeros(graph_bs * t, dtype=torch.long),  # slot 0: the sink
        spec_info=SimpleNamespace(draft_token_num=t, visibility=tril) if mode == "target_verify" else None,
    )
    be.init_forward_metadata_out_graph(capture, in_capture=True)
    be.init_forward_metadata_in_graph(capture)
    q0, k0, _ = cache.inputs()[0]
    q0, k0 = pad(q0, graph_bs * t, 0), pad(k0, graph_bs * t, 0)
    be.forward(q0.reshape(q0.shape[0], -1), k0, k0[..., : cache.dims.d_v], layer(cache.dims, 0), capture)
    captured = be.forward_metadata.plan
    assert captured is not None and captured.problem.seqlens.data_ptr() == be.graph["seqlens"].data_ptr()
    assert be.forward_metadata.graph and be.forward_metadata.max_seqlen is None  # no bound from the capture

    fb, starts, allowed = real_batch(mode, cache, gen)
    view = SimpleNamespace(
        **{
            **vars(fb),
            "batch_size": graph_bs,
            "seq_lens": pad(fb.seq_lens, graph_bs, fill),
            "req_pool_indices": pad(cache.req_pool_indices, graph_bs, 0),
        }
    )
    be.init_forward_metadata_out_graph(view)
    for layer_id, (q, k, v) in enumerate(cache.inputs()):
        lay = layer(cache.dims, layer_id)
        cache.pool.set_kv_buffer(lay, fb.out_cache_loc, k, v)
        kv = cache.pool.get_key_buffer(layer_id).view(-1, 16, cache.dims.d)
        out, _ = captured.run(pad(q, graph_bs * t, 0).view(graph_bs, t, *q.shape[1:]), kv)
        want = dense_reference(cache, layer_id, q, starts, allowed)
        assert_close(
            f"replayed layer {layer_id}",
            out[:real_bs].reshape(real_bs * t, -1),
            want,
            TOL[impl, torch.float32],
        )


def drop_in_verify_input(lp: torch.Tensor, ids: torch.Tensor, budget: int, cache_prefixes: torch.Tensor):
    """What the port's worker hands the target with our drop-in installed: our build into its buffers
    (one request more than the batch), our compile without the packed mask (the capability answer for
    our backend) at verify width = the largest tree; returns the verify input and the sizes."""
    from kdtree_engine.integrations import sglang as drop_in

    bs, n = lp.shape[0], budget + 1
    bufs = {"_out_node_token_ids": torch.zeros(bs + 1, budget, dtype=torch.long),
            "_out_node_depths": torch.zeros(bs + 1, budget, dtype=torch.long),
            "_out_parents": torch.full((bs + 1, n), -1, dtype=torch.long),
            "_out_visibility": torch.zeros(bs + 1, n, n, dtype=torch.bool),
            "_out_actual_tree_sizes": torch.zeros(bs + 1, dtype=torch.long)}  # fmt: skip
    heap = {f"_heap_{k}": torch.empty(bs + 1, 4) for k in ("scores", "parents", "depths", "ranks")}
    tokens, depths, parents, _, vis, sizes, _ = drop_in.build_ddtree_tree_gpu(
        draft_top_log_probs=lp, draft_top_token_ids=ids, tree_budget=budget, device=lp.device, **bufs, **heap
    )
    t = int(sizes.max())
    drop_in.compile_ddtree_tree(
        root_token_ids=torch.zeros(bs, dtype=torch.long), node_token_ids=tokens, node_depths=depths,
        visibility=vis, start_positions=cache_prefixes, past_lengths=cache_prefixes, tree_budget=budget,
        actual_tree_sizes=sizes, device=lp.device, past_lens_cpu=cache_prefixes.tolist(),
        actual_sizes_cpu=sizes.tolist(), verify_token_num=t, build_attention_mask=False,
    )  # fmt: skip
    return SimpleNamespace(draft_token_num=t, visibility=vis[:, :t, :t], parents=parents[:, :t]), sizes


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_the_worker_path_with_our_drop_in_tree(impl):
    """Trees built and compiled by our drop-in as the worker calls it (a masked draft token makes one
    tree short, so its rows are padded), verified by the backend: each real node attends to the prefix,
    the root and its ancestors (from the drop-in's parents), padding rows to the prefix and themselves."""
    gen = torch.Generator().manual_seed(12)
    budget, depth, vocab = 7, 4, 10
    logits = torch.randn(3, depth, vocab, generator=gen)
    logits[1, :, 1:] = float("-inf")  # request 1: one token per depth, a chain of depth + 1 nodes
    lp, ids = logits.log_softmax(-1).topk(budget, dim=-1)
    prefixes = [12, 3, 30]
    spec, sizes = drop_in_verify_input(lp, ids, budget, torch.tensor(prefixes))
    t = spec.draft_token_num
    assert sizes.tolist()[1] < t  # padded
    cache = Cache(Dims(), 1, prefixes, t, gen)
    seq_lens = cache.prefixes.clone()
    fb = batch("target_verify", cache, seq_lens, spec, seq_lens + t, cache.out_cache_loc(seq_lens))
    be = backend(cache, impl)
    be.init_forward_metadata(fb)

    def ancestry(r: int) -> torch.Tensor:  # from parents alone, not from the visibility the backend read
        vis = torch.eye(t, dtype=torch.bool)
        for i in range(1, int(sizes[r])):
            vis[i] |= vis[int(spec.parents[r, i])]
        return tree_mask(int(seq_lens[r]), vis)

    for layer_id, (q, out) in enumerate(run_layers(be, cache, fb, torch.float32)):
        want = dense_reference(cache, layer_id, q, seq_lens, ancestry)
        assert_close(f"layer {layer_id}", out, want, TOL[impl, torch.float32])


def test_one_plan_per_forward_and_none_from_host_values_under_graphs(monkeypatch):
    """Every layer of a forward runs the plan its first layer made; a graph forward plans without
    validation (a host read) and without a host bound on the lengths."""
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return plan(*args, **kwargs)

    plan = attention.plan_attention
    monkeypatch.setattr(attention, "plan_attention", recording)
    gen = torch.Generator().manual_seed(9)
    cache = Cache(Dims(layers=3), 1, [5, 9], 3, gen)
    be = backend(cache, "triton")
    fb, _ = verify_batch(cache, [3, 2], gen)
    be.init_forward_metadata(fb)
    run_layers(be, cache, fb, torch.float32)
    assert len(calls) == 1 and calls[0]["validate"] and calls[0]["max_seqlen"] == 9 + 3 + 3
    be.init_cuda_graph_state(max_bs=2, max_num_tokens=6)
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    be.init_forward_metadata_in_graph(fb)
    run_layers(be, cache, fb, torch.float32)
    assert len(calls) == 2 and not calls[1]["validate"] and calls[1]["max_seqlen"] is None


@pytest.mark.parametrize("form", ["cat", "split"])
def test_a_layer_k_scale_divides_the_stored_rows(form):
    gen = torch.Generator().manual_seed(6)
    cache = Cache(Dims(layers=1), 1, [3], 2, gen)
    be = backend(cache, "ref")
    fb = batch("draft_extend_v2", cache, cache.prefixes + 2, None, None, cache.out_cache_loc(cache.prefixes))
    be.init_forward_metadata(fb)
    q, k, v = cache.inputs()[0]
    lay = SimpleNamespace(**{**vars(layer(cache.dims, 0)), "k_scale": 2.0})
    d_v = cache.dims.d_v
    if form == "cat":
        be.forward(q, k, v, lay, fb)
    else:
        be.forward(q[..., :d_v], k[..., :d_v], v, lay, fb, q_rope=q[..., d_v:], k_rope=k[..., d_v:])
    assert torch.equal(cache.pool.kv_buffer[0][fb.out_cache_loc], k / 2)


def test_other_forwards_go_to_the_fallback():
    gen = torch.Generator().manual_seed(0)
    cache = Cache(Dims(layers=1), 1, [4], 2, gen)
    be = backend(cache, "ref")
    fb = batch("extend", cache, cache.prefixes + 2)
    be.init_forward_metadata(fb)
    q, k, v = cache.inputs()[0]
    assert be.forward(q, k, v, layer(cache.dims, 0), fb) == "fallback"
    be.init_forward_metadata(batch("idle", cache, cache.prefixes))
    assert be.fallback.calls == ["init_forward_metadata", "forward_extend", "init_forward_metadata"]
    assert be.get_cuda_graph_seq_len_fill_value() == 1


def test_exposes_the_pools_that_sglangs_forward_context_reads():
    """forward_context.get_req_to_token_pool() / get_token_to_kv_pool() read these two attributes off the
    running backend (the port's eager runner calls them in every extend; found in the live run)."""
    cache = Cache(Dims(layers=1), 1, [4], 2, torch.Generator().manual_seed(0))
    be = backend(cache, "ref")
    assert be.req_to_token_pool.req_to_token is cache.req_to_token and be.token_to_kv_pool is cache.pool


def bad(name: str, fn) -> None:
    with pytest.raises(ValueError, match=name):
        fn()


def test_bad_inputs_name_the_argument():
    gen = torch.Generator().manual_seed(1)
    cache = Cache(Dims(layers=1), 1, [4, 6], 3, gen)
    be = backend(cache, "ref")
    fb, _ = verify_batch(cache, [3, 3], gen)
    q, k, v = cache.inputs()[0]
    lay = layer(cache.dims, 0)
    bad("impl", lambda: BackendConfig(impl="gpu"))
    bad("fallback", lambda: BackendConfig(fallback=attention.NAME))
    bad("forward_batch", lambda: be.forward(q, k, v, lay, fb))  # no metadata yet
    bad("init_cuda_graph_state", lambda: be.init_forward_metadata_out_graph(fb))
    no_tree = batch("target_verify", cache, fb.seq_lens, SimpleNamespace(draft_token_num=3, visibility=None))
    bad("spec_info.visibility", lambda: be.init_forward_metadata(no_tree))
    bad("spec_info", lambda: be.init_forward_metadata(batch("target_verify", cache, fb.seq_lens)))
    be.init_forward_metadata(fb)
    capped = SimpleNamespace(**{**vars(lay), "logit_cap": 30.0})
    bad("layer", lambda: be.forward(q, k, v, capped, fb))
    bad("layer", lambda: be.forward(q[..., :-1], k[..., :-1], v, lay, fb, save_kv_cache=False))
    bad("q", lambda: be.forward(q[:-1], k[:-1], v[:-1], lay, fb, save_kv_cache=False))
    fb.spec_info.visibility[0, 1, 1] = False  # a node that does not see itself
    be.init_forward_metadata(fb)
    bad("(visibility|ancestor_bits): every row must see itself", lambda: be.forward(q, k, v, lay, fb))
    runner = cache.runner()
    runner.page_size = 7
    seven = bind(Base)(runner, Recorder())
    seven.init_forward_metadata(fb)
    bad("page_size", lambda: seven.forward(q, k, v, lay, fb, save_kv_cache=False))  # 1282 slots
    no_fallback = bind(Base)(cache.runner(), None)
    bad("fallback", lambda: no_fallback.init_forward_metadata(batch("extend", cache, fb.seq_lens)))


def test_the_factory_builds_over_the_fallback_and_reads_the_environment(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    runner = Cache(Dims(layers=1), 1, [2], 1, gen).runner()
    monkeypatch.setenv(attention.ENV_IMPL, "ref")
    monkeypatch.setenv(attention.ENV_FALLBACK, "flashinfer")
    monkeypatch.setenv(attention.ENV_VALIDATE, "1")
    assert BackendConfig.from_env() == BackendConfig(impl="ref", validate=True, fallback="flashinfer")
    factory = attention.make_factory(bind(Base), {"flashinfer": lambda r: "fi", "triton": lambda r: "tr"})
    made = factory(runner)
    assert made.fallback == "fi" and made.config.impl == "ref"
    monkeypatch.setenv(attention.ENV_FALLBACK, "fa9")
    bad("fallback", lambda: factory(runner))
    runner.use_mla_backend = False
    bad("attention_backend", lambda: attention.make_factory(bind(Base), {"triton": None})(runner))


class Renamed(Base):
    def forward_extend(self, query, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        raise NotImplementedError


def test_a_changed_port_base_class_is_a_clear_error():
    hooks = {k: v for k, v in vars(Base).items() if k != "init_forward_metadata_in_graph"}
    lacking = type("Lacking", (), hooks)
    bad("init_forward_metadata_in_graph is missing", lambda: bind(lacking))
    bad(r"forward_extend takes \['self', 'query'", lambda: bind(Renamed))


@dataclass(frozen=True)
class Capability:
    """The port's DDTreeTargetBackendCapability fields."""

    backend_name: str
    build_attention_mask: bool
    use_visibility: bool
    supports_full_tree: bool
    unsupported_reason: str = ""


def refusing(attn_backend, speculative_attention_mode: str = "prefill"):
    """The port's answer for a backend it does not know."""
    cls = type(attn_backend)
    return Capability(f"{cls.__module__}.{cls.__name__}", False, False, False, "needs a mask or visibility")


def test_the_capability_check_hands_our_backend_the_tree():
    gen = torch.Generator().manual_seed(2)
    cache = Cache(Dims(layers=1), 1, [4], 2, gen)
    ours = backend(cache, "ref")
    check = capability_with_ours(refusing, type(ours))
    got = check(ours, speculative_attention_mode="prefill")
    assert (got.use_visibility, got.build_attention_mask, got.supports_full_tree) == (True, False, True)
    assert check(Recorder()) == refusing(Recorder())


# ---- against the port's own code ----------------------------------------------------------------------
BASE_FILE = Path("python/sglang/srt/layers/attention/base_attn_backend.py")


def port_file(path: Path) -> Path:
    """A file of the port's checkout (KDTREE_SGLANG_DDTREE); skips when unset or when the checkout is the
    two files scripts/fetch_peers.sh extracts."""
    from .port import port_dir

    found = port_dir() / path
    if not found.exists():
        pytest.skip(f"{found} is not in the checkout (a full checkout of the port is needed)")
    return found


def stub(name: str, **members) -> ModuleType:
    module = ModuleType(name)
    vars(module).update(members)
    return module


def base_stubs() -> dict:
    """What the port's base_attn_backend.py imports from SGLang: a logging decorator and is_npu."""
    return {
        "sglang.kernel_api_logging": stub("sglang.kernel_api_logging", debug_kernel_api=lambda fn: fn),
        "sglang.srt.utils.common": stub("sglang.srt.utils.common", is_npu=lambda: False),
    }


def port_base() -> type:
    """The port's AttentionBackend, from its file."""
    from kdtree_engine.bench.peers import _exec_file

    return _exec_file(port_file(BASE_FILE), "_port_base_attn_backend", base_stubs(), False).AttentionBackend


def port_base_or_stand_in() -> type:
    """The port's AttentionBackend where the checkout has it, else the stand-in (the checkout of
    scripts/fetch_peers.sh holds only ddtree_utils.py and the Triton tree kernels)."""
    from .port import port_dir

    return port_base() if (port_dir() / BASE_FILE).exists() else Base


@pytest.mark.parametrize("mode", ["target_verify", "decode"])
def test_on_the_ports_base_class_and_dispatch(mode):
    """Bound to the port's AttentionBackend: its forward() dispatches verify (an extend mode) and decode
    to ours, and the result equals the reference."""
    base = port_base()
    gen = torch.Generator().manual_seed(21)
    new = 6 if mode == "target_verify" else 1
    cache = Cache(Dims(), 16, [31, 2, 17], new, gen)
    if mode == "target_verify":
        fb, vis = verify_batch(cache, [6, 3, 1], gen)
        mask = lambda r: tree_mask(int(fb.seq_lens[r]), vis[r])  # noqa: E731
    else:
        fb = batch(mode, cache, cache.prefixes + 1, None, None, cache.out_cache_loc(cache.prefixes))
        mask = lambda r: causal_mask(int(cache.prefixes[r]), 1)  # noqa: E731
    be = backend(cache, "triton", base=base)
    assert isinstance(be, base)
    be.init_forward_metadata(fb)
    for layer_id, (q, out) in enumerate(run_layers(be, cache, fb, torch.float32)):
        want = dense_reference(cache, layer_id, q, cache.prefixes, mask)
        assert_close(f"{mode} layer {layer_id}", out, want, 1e-4)


def test_the_ports_capability_check_hands_our_backend_the_tree():
    from .port import port_utils

    utils = port_utils()
    gen = torch.Generator().manual_seed(2)
    ours = backend(Cache(Dims(layers=1), 1, [4], 2, gen), "ref", base=port_base_or_stand_in())
    before = utils.resolve_ddtree_target_backend_capability(ours)
    assert not before.supports_full_tree  # the port alone refuses it
    check = capability_with_ours(utils.resolve_ddtree_target_backend_capability, type(ours))
    got = check(ours, speculative_attention_mode="prefill")
    assert (got.use_visibility, got.build_attention_mask, got.supports_full_tree) == (True, False, True)
    assert isinstance(got, utils.DDTreeTargetBackendCapability) and got.backend_name == before.backend_name
    assert check(Recorder()) == utils.resolve_ddtree_target_backend_capability(Recorder())


def port_compile(utils, vis: torch.Tensor, sizes: list[int], prefixes: torch.Tensor, t: int, mask: bool):
    """The port's CPU compile on these trees: (padded visibility in place, packed custom mask or None)."""
    bs = len(sizes)
    depths = vis[:, 1:, :].sum(-1) - 1  # a node's depth: its ancestors, root included, minus itself
    _, _, custom, _ = utils._compile_ddtree_tree_torch(
        root_token_ids=torch.zeros(bs, dtype=torch.long),
        node_token_ids=torch.zeros(bs, t - 1, dtype=torch.long),
        node_depths=depths.long(),
        visibility=vis,
        start_positions=prefixes,
        past_lengths=prefixes,
        tree_budget=t - 1,
        actual_tree_sizes=torch.tensor(sizes),
        device=torch.device("cpu"),
        past_lens_cpu=prefixes.tolist(),
        actual_sizes_cpu=sizes,
        verify_token_num=t,
        build_attention_mask=mask,
    )
    return vis, custom


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_equals_the_ports_packed_mask_on_the_ports_compiled_trees(impl):
    """The port's compile pads short trees in the visibility that our backend reads; the packed
    [t, prefix + t] mask it builds for its Triton / FlashInfer backends, read as they read it, is the
    reference's mask: the same attention at every real node. (Padding rows differ between the port's
    two forms, its mask hiding the prefix from them; the port's accept step never reads them.)"""
    from .port import port_utils

    utils = port_utils()
    gen = torch.Generator().manual_seed(8)
    t, sizes, prefixes = 9, [9, 4, 1], [40, 0, 13]
    cache = Cache(Dims(), 1, prefixes, t, gen)
    trees = torch.zeros(3, t, t, dtype=torch.bool)
    for r, size in enumerate(sizes):
        trees[r, :size, :size] = random_tree(size, size, gen)
    vis, _ = port_compile(utils, trees.clone(), sizes, cache.prefixes, t, mask=False)
    _, packed = port_compile(utils, trees.clone(), sizes, cache.prefixes, t, mask=True)
    starts = torch.tensor([0] + [t * (p + t) for p in prefixes]).cumsum(0)
    masks = [packed[starts[r] : starts[r + 1]].view(t, prefixes[r] + t) for r in range(3)]
    spec = SimpleNamespace(draft_token_num=t, visibility=vis)
    fb = batch("target_verify", cache, cache.prefixes, spec, None, cache.out_cache_loc(cache.prefixes))
    be = backend(cache, impl, base=port_base_or_stand_in())
    be.init_forward_metadata(fb)
    real = torch.cat([torch.arange(t) < size for size in sizes])  # padding rows: discarded by the port
    for layer_id, (q, out) in enumerate(run_layers(be, cache, fb, torch.float32)):
        want = dense_reference(cache, layer_id, q, cache.prefixes, lambda r: masks[r])
        assert_close(f"layer {layer_id}", out[real], want[real], TOL[impl, torch.float32])


# ---- install() on a stand-in SGLang tree --------------------------------------------------------------
CAPABILITY = """
from dataclasses import dataclass


@dataclass(frozen=True)
class DDTreeTargetBackendCapability:
    backend_name: str
    build_attention_mask: bool
    use_visibility: bool
    supports_full_tree: bool
    unsupported_reason: str = ""


def resolve_ddtree_target_backend_capability(attn_backend, speculative_attention_mode="prefill"):
    cls = type(attn_backend)
    return DDTreeTargetBackendCapability(f"{cls.__module__}.{cls.__name__}", False, False, False, "unknown")
"""

WORKER = """from sglang.srt.speculative.ddtree_utils import follow_verified_tree_gpu
from sglang.srt.speculative.ddtree_utils import resolve_ddtree_target_backend_capability


class DDTreeWorkerV2:
    def _compute_draft_topk_log_probs_and_token_ids(self, hidden_states, lm_head, topk):
        return 'port'
"""

REGISTRY = """ATTENTION_BACKENDS = {}


def register_attention_backend(name):
    def add(factory):
        ATTENTION_BACKENDS[name] = factory
        return factory

    return add


register_attention_backend("triton")(lambda runner: "triton fallback")
"""

SERVER_ARGS = """ATTENTION_BACKEND_CHOICES = ["triton", "fa3"]


def add_attention_backend_choices(choices):
    ATTENTION_BACKEND_CHOICES.extend(choices)
"""

PROBE = """
import json
from types import SimpleNamespace
import torch
from kdtree_engine.integrations.sglang import plugin
try:
    replaced = plugin.install()
except ValueError as exc:
    print(json.dumps({"error": str(exc)})); raise SystemExit(0)
from sglang.srt import server_args
from sglang.srt.layers.attention import attention_registry as registry, base_attn_backend as base
from sglang.srt.speculative import ddtree_utils as utils, ddtree_worker_v2 as worker
tokens = SimpleNamespace(req_to_token=torch.zeros(2, 8, dtype=torch.int32))
runner = SimpleNamespace(req_to_token_pool=tokens, token_to_kv_pool=None, page_size=1, use_mla_backend=True)
ours = registry.ATTENTION_BACKENDS["kdtree_mla"](runner)
cap = worker.resolve_ddtree_target_backend_capability(ours, speculative_attention_mode="prefill")
bound = worker.resolve_ddtree_target_backend_capability is utils.resolve_ddtree_target_backend_capability
print(json.dumps({"replaced": replaced, "again": plugin.install(), "bound": bound,
                  "choices": server_args.ATTENTION_BACKEND_CHOICES,
                  "is_base": isinstance(ours, base.AttentionBackend), "fallback": ours.fallback,
                  "cap": [cap.use_visibility, cap.build_attention_mask, cap.supports_full_tree]}))
"""


def base_source(skip: str = "") -> str:
    """The stand-in AttentionBackend's source (the Base class above), without the hook `skip`."""
    import inspect

    source = inspect.getsource(Base).replace("class Base:", "class AttentionBackend:")
    if skip:
        source = source.replace(f"def {skip}(", f"def {skip}_renamed(")
    return source


def make_tree(root: Path, skip_hook: str = "") -> Path:
    """sglang/srt/{speculative,layers/attention} and server_args: the port's real ddtree_utils.py and
    base_attn_backend.py (its two SGLang imports stubbed) when KDTREE_SGLANG_DDTREE names a full
    checkout, else stand-ins."""
    from .test_sglang_plugin import stand_in_utils

    port = os.environ.get(ENV)
    files = {
        "sglang/srt/speculative/ddtree_worker_v2.py": WORKER,
        "sglang/srt/layers/attention/attention_registry.py": REGISTRY,
        "sglang/srt/server_args.py": SERVER_ARGS,
        "sglang/kernel_api_logging.py": "def debug_kernel_api(fn):\n    return fn\n",
        "sglang/srt/utils/common.py": "def is_npu():\n    return False\n",
    }
    real_base = Path(port or "/nonexistent") / BASE_FILE
    if port and real_base.exists() and not skip_hook:
        files["sglang/srt/layers/attention/base_attn_backend.py"] = real_base.read_text()
    else:
        files["sglang/srt/layers/attention/base_attn_backend.py"] = base_source(skip_hook)
    utils = Path(port or "/nonexistent") / "python/sglang/srt/speculative/ddtree_utils.py"
    files["sglang/srt/speculative/ddtree_utils.py"] = (
        utils.read_text() if port and utils.exists() else stand_in_utils() + CAPABILITY
    )
    for rel, text in files.items():
        for parent in reversed(Path(rel).parents[:-1]):  # sglang, sglang/srt, ...: packages
            (root / parent).mkdir(exist_ok=True)
            (root / parent / "__init__.py").touch()
        (root / rel).write_text(text)
    return root


def probe(root: Path) -> dict:
    src = Path(__file__).parents[2] / "src"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(src)]))
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_install_registers_the_backend_and_hands_it_the_tree(tmp_path):
    got = probe(make_tree(tmp_path))
    assert "error" not in got, got
    assert (
        f"sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS['{attention.NAME}']"
        in got["replaced"]
    )
    assert (
        "sglang.srt.speculative.ddtree_worker_v2.resolve_ddtree_target_backend_capability" in got["replaced"]
    )
    assert got["choices"].count(attention.NAME) == 1
    assert not [name for name in got["again"] if "attention" in name or "capability" in name]  # once only
    assert got["is_base"] and got["fallback"] == "triton fallback" and got["bound"]
    assert got["cap"] == [True, False, True]


def test_install_names_a_missing_hook(tmp_path):
    got = probe(make_tree(tmp_path, skip_hook="init_forward_metadata_in_graph"))
    assert "init_forward_metadata_in_graph is missing" in got["error"]
    assert plugin.PORT_CHECKED in got["error"]
