"""The verify-attention section of `kdtree-engine bench sglang` (issue 31): the attention of one DDTree
target verify at Kimi-K2 shapes per GPU (d = 576, d_v = 512, bf16), our `kdtree_mla` backend against
SGLang's Triton extend kernel with the port's dense custom mask, on the same token pool (page size 1),
`req_to_token` and trees (bench/sglang_extend.py builds the kernel's inputs as the port's Triton backend
does).

Per point (h heads per GPU, t tree nodes, prefix p per request, batch b), four GPU times
(bench/timing.time_graph: CUDA-graph replays, the L2 flushed before each):
- port step: the port's per-forward work for this backend, then one layer's attention: its compile of
  the verify inputs with the packed custom mask (compile_ddtree_tree_triton from its ddtree.py, as its
  worker calls it for the `triton` backend: the mask is rebuilt every verify forward, so it is counted
  here, once per forward), the backend's metadata (qo_indptr, kv_indptr and kv_indices of the prefixes
  from req_to_token, mask_indptr), then extend_attention_fwd;
- port kernel: extend_attention_fwd alone (one layer);
- ours step: the same compile without the mask (the worker's call for a backend that reads the
  visibility, as kdtree_mla does), our backend's init_forward_metadata (block table from req_to_token,
  ancestor bits) and forward_extend (plan, then run);
- ours run: forward_extend with the forward's plan made (one layer).
Not counted on the port's side: the copy of the mask into its Triton backend's CUDA-graph buffer before
each replay (b t (p + t) bytes), which a captured SGLang forward adds. The port's kv_indices are written
by a few torch ops (scatter) in place of its Triton helper, which is not among the files loaded.
"x" is port / ours; "saved/round" is what one decoding round saves on one GPU with `layers` layers:
(port step - port kernel) - (ours step - ours run) + layers x (port kernel - ours run). "max diff": the
largest difference between the two outputs; "mask =": the port's mask equals the one built from the
trees (bench/sglang_extend.dense_custom_mask).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kdtree_engine.bench import flashmla
from kdtree_engine.bench.plot import markdown_table
from kdtree_engine.bench.sglang_extend import (
    ExtendCall,
    TokenPool,
    extend_call,
    make_token_pool,
    mask_indptr,
    prefix_kv_indices,
)

D, D_V = 576, 512
SCALE = 192**-0.5  # Kimi-K2's softmax scale (qk head dim 192)


@dataclass(frozen=True)
class VerifyGrid:
    """The points of the section: heads per GPU, tree sizes t, prefixes, batches; `layers` for the
    saving per round; `rep_ms` per timing; points whose tensors would need more than `max_gb` skipped."""

    heads: tuple[int, ...] = (64, 16, 8)
    tokens: tuple[int, ...] = (9, 17, 33)
    prefixes: tuple[int, ...] = (1024, 4096, 8192, 32768)
    batch: tuple[int, ...] = (1, 16, 64)
    pages: tuple[int, ...] = (1,)  # KV pool page sizes: 1 (the token-level pool), 64 (FlashMLA's)
    layers: int = 61
    rep_ms: float = 50.0
    max_gb: float = 40.0

    def __post_init__(self):
        for name in ("heads", "tokens", "prefixes", "batch", "pages"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name}: expected positive ints, got {values!r}")
        if self.layers < 1 or self.rep_ms <= 0 or self.max_gb <= 0:
            raise ValueError(f"layers, rep_ms, max_gb: expected positive, got {self.layers}, {self.rep_ms}, "
                             f"{self.max_gb}")  # fmt: skip

    def points(self):
        """(h, t, prefix, b, page) in report order."""
        return itertools.product(self.heads, self.tokens, self.prefixes, self.batch, self.pages)


def point_bytes(h: int, t: int, prefix: int, b: int) -> int:
    """A bound on the device bytes of one point: the rows twice (the problem's and the pool's), the
    mask, the index tables, and q, outputs and our split partials (float32, up to 8 splits)."""
    rows = b * (prefix + t)
    return 2 * rows * D * 2 + rows * (1 + 8 + 4 + 4) + b * t * h * (D * 2 + D_V * 4 + 8 * D_V * 4)


class _VerifyMode:
    """ForwardMode's predicates for a target verify (what the backend asks)."""

    def is_idle(self):
        return False

    def is_target_verify(self):
        return True


class _Pool:
    """SGLang's MLA token pool as the backend reads it: one layer's [slots, 1, 576] rows."""

    def __init__(self, kv: torch.Tensor):
        self.kv = kv

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv


@dataclass
class OursVerify:
    """Our kdtree_mla backend (integrations/sglang/attention.py) on stand-ins for SGLang's model runner,
    forward batch and layer: `step()` is one verify forward's metadata and first layer (plan + run),
    `run()` a later layer's (the plan made)."""

    backend: object
    forward_batch: SimpleNamespace
    layer: SimpleNamespace
    q: torch.Tensor  # [b t, h, d]

    @classmethod
    def make(cls, pool: TokenPool, q: torch.Tensor, visibility: torch.Tensor, scale: float, d_v: int,
             impl: str | None = None) -> OursVerify:  # fmt: skip
        from kdtree_engine.integrations.sglang.attention import BackendConfig, TreeMLABackend

        b, t, h, d = q.shape
        runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=pool.req_to_token),
                                 token_to_kv_pool=_Pool(pool.kv), page_size=pool.page)  # fmt: skip
        batch = SimpleNamespace(
            forward_mode=_VerifyMode(), seq_lens=pool.prefix_lens.long(), seq_lens_cpu=pool.prefix_lens.cpu(),
            req_pool_indices=pool.req_pool_indices, out_cache_loc=None,
            spec_info=SimpleNamespace(draft_token_num=t, visibility=visibility),
        )  # fmt: skip
        layer = SimpleNamespace(tp_q_head_num=h, v_head_dim=d_v, scaling=scale, layer_id=0, logit_cap=0.0)
        backend = TreeMLABackend(runner, config=BackendConfig(impl=impl))
        return cls(backend, batch, layer, q.reshape(b * t, h, d))

    def step(self) -> torch.Tensor:
        self.backend.init_forward_metadata(self.forward_batch)
        return self.run()

    def worker_step(self, port: PortVerify) -> torch.Tensor:
        """step() after the worker's compile (the port's, without the mask our backend does not read):
        the verify step as the worker runs it with our backend."""
        port.compile(with_mask=False)
        return self.step()

    def run(self) -> torch.Tensor:
        """out [b t, h d_v]."""
        fb = self.forward_batch
        return self.backend.forward_extend(self.q, None, None, self.layer, fb, save_kv_cache=False)

    @property
    def kernel(self) -> str:
        plan = self.backend.forward_metadata.plan
        return plan.kernel if plan is not None else "?"


@dataclass
class PortVerify:
    """The port's side: `step()` is its compile with the mask, its Triton backend's metadata and
    extend_attention_fwd; `run()` the kernel alone on the step's inputs."""

    fn: object  # extend_attention_fwd
    compile_fn: object  # compile_ddtree_tree_triton
    call: ExtendCall
    pool: TokenPool
    compile_args: dict
    max_prefix: int
    total_prefix: int

    @classmethod
    def make(cls, fn, compile_fn, pool: TokenPool, q: torch.Tensor, visibility: torch.Tensor, scale: float,
             d_v: int) -> PortVerify:  # fmt: skip
        b, t = q.shape[:2]
        i64 = {"dtype": torch.int64, "device": q.device}
        call = extend_call(pool, q, visibility, scale, d_v)
        prefix = pool.prefix_lens.cpu()
        compile_args = dict(
            root_token_ids=torch.zeros(b, **i64), node_token_ids=torch.zeros(b, max(t - 1, 1), **i64),
            node_depths=torch.ones(b, max(t - 1, 1), **i64), visibility=visibility,
            start_positions=pool.prefix_lens.long(), past_lengths=pool.prefix_lens.long(),
            actual_tree_sizes=torch.full((b,), t, **i64), verify_input_ids=torch.empty(b, t, **i64),
            verify_position_ids=torch.empty(b, t, **i64), q_len=t,
            tree_attention_mask=torch.empty_like(call.custom_mask), max_kv_len=int(prefix.max()) + t,
        )  # fmt: skip
        return cls(fn, compile_fn, call, pool, compile_args, max(int(prefix.max()), 1), int(prefix.sum()))

    def compile(self, with_mask: bool) -> None:
        args = self.compile_args if with_mask else {**self.compile_args, "tree_attention_mask": None}
        self.compile_fn(**args)

    def step(self) -> torch.Tensor:
        self.compile(with_mask=True)
        b, t, device = self.pool.prefix_lens.shape[0], self.call.max_len_extend, self.call.q_extend.device
        kv_indptr, kv_indices = prefix_kv_indices(self.pool, self.max_prefix, self.total_prefix)
        call = dataclasses.replace(
            self.call, kv_indptr=kv_indptr, kv_indices=kv_indices,
            qo_indptr=torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=device),
            custom_mask=self.compile_args["tree_attention_mask"],
            mask_indptr=mask_indptr(self.pool.prefix_lens, t),
        )  # fmt: skip
        return call(self.fn)

    def run(self) -> torch.Tensor:
        return self.call(self.fn)


def make_point(h: int, t: int, prefix: int, b: int, device, seed: int = 0, page: int = 1):
    """(pool, q [b, t, h, d], visibility [b, t, t]): random bf16 rows of every request's prefix and
    tree in a pool of scattered pages of `page` slots, random trees (bench attention's)."""
    from kdtree_engine.bench.attention import _tree_visibility

    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(b, prefix + t, D, device=device, dtype=torch.bfloat16)
    prefix_lens = torch.full((b,), prefix, dtype=torch.int32)
    pool = make_token_pool(kv, prefix_lens, t, page=page, gen=gen)
    del kv
    q = torch.randn(b, t, h, D, device=device, dtype=torch.bfloat16)
    return pool, q, _tree_visibility(b, t, gen).to(device)


def time_point(
    fn, compile_fn, h: int, t: int, prefix: int, b: int, grid: VerifyGrid, device, page: int = 1, flash=None
) -> dict:
    """One row: the four times, the ratios, the saving per round, the max difference and the mask check;
    on 64-slot pages with flash (the flash_mla module), also FlashMLA's cascade (cascade_us and its
    difference from the port's output, cascade_diff)."""
    from kdtree_engine.bench.timing import time_graph

    pool, q, vis = make_point(h, t, prefix, b, device, page=page)
    port = PortVerify.make(fn, compile_fn, pool, q, vis, SCALE, D_V)
    ours = OursVerify.make(pool, q, vis, SCALE, D_V)
    want = port.step().float().reshape(b * t, -1)
    got = ours.step().float()
    row = {"h": h, "t": t, "prefix": prefix, "batch": b, "page": page, "kernel": ours.kernel}
    row["max_diff"] = float((want - got).abs().max())
    row["mask_equal"] = bool(torch.equal(port.compile_args["tree_attention_mask"], port.call.custom_mask))

    def timed(f) -> float:
        return time_graph(f, rep_ms=grid.rep_ms, warmup=2).median_us

    row.update(port_step_us=timed(port.step), port_kernel_us=timed(port.run))

    row["ours_step_us"] = timed(lambda: ours.worker_step(port))
    ours.step()  # eager metadata and plan again: the captured step's lived in its graph's memory
    row["ours_run_us"] = timed(ours.run)
    if flash is not None and page == flashmla.PAGE:
        cascade = flashmla_cascade(flash, pool, q, vis)
        row["cascade_diff"] = float((want - cascade()[0].float().reshape(b * t, -1)).abs().max())
        row["cascade_us"] = timed(lambda: cascade()[0])
    return with_derived(row, grid.layers)


def flashmla_cascade(flash, pool: TokenPool, q: torch.Tensor, vis: torch.Tensor) -> flashmla.Cascade:
    """FlashMLA over each request's prefix in the pool's 64-slot pages (its block table from
    req_to_token), our kernel over the tree rows with the tree mask, merged by lse (bench/flashmla.py):
    the verify a serving engine could build on FlashMLA. One layer, no per-forward metadata counted."""
    from kdtree_engine.ref.sglang_attention import block_table

    lengths = pool.prefix_lens + pool.t
    cols = -(-int(lengths.max()) // flashmla.PAGE)
    table = block_table(pool.req_to_token, pool.req_pool_indices, flashmla.PAGE, cols)
    pages = pool.kv.view(-1, flashmla.PAGE, pool.kv.shape[-1])
    return flashmla.cascade_call(flash, q, pages, lengths, table, vis, SCALE, D_V)


def with_derived(row: dict, layers: int) -> dict:
    """row with its ratios and the saving of one round of `layers` layers (ms)."""
    port_meta = max(row["port_step_us"] - row["port_kernel_us"], 0.0)
    ours_meta = max(row["ours_step_us"] - row["ours_run_us"], 0.0)
    saved_us = port_meta - ours_meta + layers * (row["port_kernel_us"] - row["ours_run_us"])
    return {
        **row,
        "step_x": row["port_step_us"] / row["ours_step_us"],
        "layer_x": row["port_kernel_us"] / row["ours_run_us"],
        "layers": layers,
        "saved_round_ms": saved_us / 1e3,
    }


def run_section(fn, compile_fn, grid: VerifyGrid, device, on_row=print, flash=None) -> list[dict]:
    """Every point of the grid (those over grid.max_gb skipped, with a printed line); on_row(row) after
    each, so that a run cut short keeps what it measured. flash: the flash_mla module, for the cascade
    on 64-slot pages."""
    rows = []
    for h, t, prefix, b, page in grid.points():
        need = point_bytes(h, t, prefix, b)
        if need > grid.max_gb * 2**30:
            print(f"verify attention: h={h} t={t} prefix={prefix} b={b} page={page} skipped: about "
                  f"{need / 2**30:.0f} GB over --verify-max-gb {grid.max_gb:g}", flush=True)  # fmt: skip
            continue
        rows.append(time_point(fn, compile_fn, h, t, prefix, b, grid, device, page, flash))
        on_row(rows[-1])
        torch.cuda.empty_cache()
    return rows


def drop_in_saving_ms(tree_rows: list[dict], batch: int, budget: int) -> float | None:
    """The drop-in's saving per round (port greedy path - ours, ms) at (batch, budget), where measured."""
    for r in tree_rows:
        if r.get("batch") == batch and r.get("budget") == budget and "port greedy path" in r:
            return (r["port greedy path"] - r["ours greedy path"]) / 1e3
    return None


def report(rows: list[dict], tree_rows: list[dict]) -> str:
    """The section's markdown: the table (with the drop-in's saving per round at budget t - 1 next to
    ours where the tree path was measured at that batch and budget) and the issue's goal, checked."""
    if not rows:
        return "## Verify attention\n\nNo point measured.\n"
    layers = rows[0]["layers"]
    heads = ["h", "t", "prefix", "B", "page", "kernel", "step port / ours us (x)",
             "per layer port / ours us (x)", f"attention saved/round ms ({layers} layers)",
             "drop-in saved/round ms (budget t-1)", "verify step saved/round ms", "max diff",
             "mask =", "FlashMLA cascade us (/ ours per layer)"]  # fmt: skip
    table = []
    for r in rows:
        drop_in = drop_in_saving_ms(tree_rows, r["batch"], r["t"] - 1)
        total = None if drop_in is None else r["saved_round_ms"] + drop_in
        table.append([
            r["h"], r["t"], r["prefix"], r["batch"], r.get("page", 1), r["kernel"],
            f"{r['port_step_us']:.1f} / {r['ours_step_us']:.1f} ({r['step_x']:.1f}x)",
            f"{r['port_kernel_us']:.1f} / {r['ours_run_us']:.1f} ({r['layer_x']:.1f}x)",
            f"{r['saved_round_ms']:.2f}", None if drop_in is None else f"{drop_in:.2f}",
            None if total is None else f"{total:.2f}", f"{r['max_diff']:.2g}",
            "yes" if r["mask_equal"] else "NO", _cascade_cell(r),
        ])  # fmt: skip
    return "## Verify attention\n\n" + markdown_table(heads, table) + "\n\n" + goal_line(rows) + "\n"


def _cascade_cell(row: dict) -> str | None:
    """FlashMLA's cascade time and its ratio to our per-layer time (above 1: ours faster), where timed."""
    if "cascade_us" not in row:
        return None
    return f"{row['cascade_us']:.1f} ({row['cascade_us'] / row['ours_run_us']:.2f}x)"


def goal_line(rows: list[dict]) -> str:
    """Issue 31's goal on the step times: >= 5x at every point, >= 10x at prefixes of 4k and more."""
    five = sum(r["step_x"] >= 5 for r in rows)
    long_rows = [r for r in rows if r["prefix"] >= 4096]
    ten = sum(r["step_x"] >= 10 for r in long_rows)
    worst = min(rows, key=lambda r: r["step_x"])
    return (
        f"Goal (issue 31, step times): >= 5x at {five}/{len(rows)} points, >= 10x at {ten}/{len(long_rows)} "
        f"points with prefix >= 4096; lowest {worst['step_x']:.1f}x (h={worst['h']} t={worst['t']} "
        f"prefix={worst['prefix']} B={worst['batch']} page={worst.get('page', 1)})."
    )
