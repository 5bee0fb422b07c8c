"""SGLang's Triton extend-attention kernel as the peer of our tree-verify attention (issue 31).

Inside SGLang, a Kimi (MLA) target on the `triton` attention backend verifies its DDTree tree with
`extend_attention_fwd` (the port's `python/sglang/kernels/ops/attention/extend_attention.py`, which
imports `_extract_kv_strides` from `decode_attention.py`, `context_attention_fwd` from
`prefill_attention.py` and is_cuda / is_hip / is_gfx95_supported from `sglang.srt.utils`).
`load_extend_attention(path)` runs those three files from a checkout of the port (or `.peers/sglang`, as
scripts/fetch_peers.sh writes it) under their own module names, with empty parent packages and a stub
`sglang.srt.utils` standing in for SGLang, and returns the function; nothing of SGLang is copied here.

`ExtendCall` holds what the port's Triton backend passes it for one target-verify forward
(triton_backend.py: init_forward_metadata's target-verify branch, then forward_extend), built from one of
our problems by `extend_call`:
- the pool: SGLang's token-level MLA KV pool with page size 1, `k_buffer` [slots, 1, 576] (latent then
  rope) and `v_buffer` its first 512 columns (a view of the same buffer, as MLATokenToKVPool's
  get_value_buffer returns it); rows addressed through `req_to_token` [requests, context] by
  `req_pool_indices`;
- the prefix (the `seq_lens` of a verify batch, the tree not counted): `kv_indptr` (int32, cumulative
  prefix lengths) and `kv_indices` (int64, the prefix's slots, request after request);
- the tree: `q_extend` [b t, h, 576], `k_extend` [b t, 1, 576] and `v_extend` [b t, 1, 512] (the model's
  k and k_nope for the tree's tokens, saved to the pool before the call; contiguous, as forward_extend
  makes them), `qo_indptr` (int32, t per request), `max_len_extend` = t;
- the mask: the dense custom mask of `t x (prefix + t)` bools per request, request after request (row i:
  every prefix column allowed, tree column j iff node j is i's ancestor or i), and `mask_indptr` (int64,
  cumulative t (prefix + t)), the layout of the port's compile (`_compile_ddtree_tree_torch`);
- `is_causal=True` (the backend passes causal for every decoder layer: the kernel then stops each query
  block's tree pass at its own block, which the tree's parent-before-child order allows), k_scale =
  v_scale = 1.0, `sm_scale` the layer's scaling, logit_cap 0, no sliding window, sinks or xai
  temperature, page_size 1. The port skips the custom mask over the prefix (skip_prefix_custom_mask's
  default True): its prefix columns are built but not read.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kdtree_engine.bench.peers import _exec_file, _stub_module

ATTENTION_PACKAGE = "sglang.kernels.ops.attention"
_ATTENTION_DIR = Path("python", *ATTENTION_PACKAGE.split("."))
EXTEND_FILE = _ATTENTION_DIR / "extend_attention.py"
DECODE_FILE = _ATTENTION_DIR / "decode_attention.py"
PREFILL_FILE = _ATTENTION_DIR / "prefill_attention.py"
PEER_FILES = (EXTEND_FILE, DECODE_FILE, PREFILL_FILE)

# extend_attention_fwd's parameters that the port's Triton backend passes by position, in order, then
# those it passes by keyword (triton_backend.py, forward_extend).
POSITIONAL = (
    "q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr",
    "kv_indices", "custom_mask", "is_causal", "mask_indptr", "max_len_extend", "k_scale", "v_scale",
    "sm_scale",
)  # fmt: skip
KEYWORDS = (
    "logit_cap", "sliding_window_size", "sinks", "window_kv_offsets", "xai_temperature_len", "page_size",
)  # fmt: skip


def _srt_utils_stub() -> types.ModuleType:
    """`sglang.srt.utils` as far as the three kernel files import it: what SGLang answers on this machine
    (an NVIDIA GPU: is_cuda True; a ROCm torch: is_hip True; gfx95 never; the CPU: all False)."""
    return _stub_module(
        "sglang.srt.utils",
        is_cuda=lambda: torch.cuda.is_available() and torch.version.cuda is not None,
        is_hip=lambda: torch.version.hip is not None,
        is_gfx95_supported=lambda: False,
    )


def _package(name: str) -> types.ModuleType:
    """An empty package standing in for one of SGLang's (nothing of its __init__ runs)."""
    return _stub_module(name, __path__=[])


def load_extend_attention(path: str | Path) -> Callable:
    """extend_attention_fwd from `path`: a checkout of the SGLang DDTree port, or `.peers/sglang`.
    ValueError naming `path` when a file is missing, a file imports something the stubs do not provide,
    or the function's parameters are not the ones the port's Triton backend passes."""
    from kdtree_engine.kernels import _interpreter  # noqa: F401 - imported here: triton is optional

    root = Path(path)
    for f in PEER_FILES:
        if not (root / f).is_file():
            raise ValueError(f"path: no {f} under {path} (scripts/fetch_peers.sh puts the SGLang DDTree "
                             "port's attention files there)")  # fmt: skip
    parents = ("sglang", "sglang.srt", "sglang.kernels", "sglang.kernels.ops", ATTENTION_PACKAGE)
    stubs = {name: _package(name) for name in parents}
    stubs["sglang.srt.utils"] = _srt_utils_stub()
    for f in (DECODE_FILE, PREFILL_FILE):  # registered under their own names for extend_attention's imports
        name = f"{ATTENTION_PACKAGE}.{f.stem}"
        stubs[name] = _exec_file(root / f, name, stubs, stable_topk=False)
    module = _exec_file(root / EXTEND_FILE, "_sglang_extend_attention", stubs, stable_topk=False)
    fn = getattr(module, "extend_attention_fwd", None)
    check_extend_signature(fn, root / EXTEND_FILE)
    return fn


def check_extend_signature(fn, source: Path) -> None:
    """ValueError naming `path` unless fn takes POSITIONAL first, in order, and every one of KEYWORDS."""
    if not callable(fn):
        raise ValueError(f"path: {source} has no extend_attention_fwd")
    params = list(inspect.signature(fn).parameters)
    head, missing = params[: len(POSITIONAL)], [k for k in KEYWORDS if k not in params]
    if tuple(head) != POSITIONAL or missing:
        raise ValueError(
            f"path: {source}: extend_attention_fwd takes {params}; expected {list(POSITIONAL)} first "
            f"and the keywords {list(KEYWORDS)} (not the SGLang DDTree port this was checked against)"
        )


@dataclass
class TokenPool:
    """SGLang's MLA KV pool for one verify batch: `kv` [slots, 1, d] rows in pages of `page` slots (1:
    the token-level pool; page 0 is the pool's padding, never handed out), `req_to_token` [requests,
    context] int32 slots,
    `req_pool_indices` [b] int64 (the batch's rows of req_to_token), `prefix_lens` [b] int32 (seq_lens of
    the verify batch) and the tree's `t` tokens per request after each prefix."""

    kv: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    t: int
    page: int = 1

    def rows(self, max_len: int) -> torch.Tensor:
        """[b, max_len] int32: each request's first max_len slots (prefix, then tree)."""
        return self.req_to_token[self.req_pool_indices, :max_len]

    def tree_slots(self) -> torch.Tensor:
        """[b t] int64: the tree tokens' slots, request after request."""
        cols = self.prefix_lens.long()[:, None] + torch.arange(self.t, device=self.kv.device)
        return self.req_to_token[self.req_pool_indices[:, None], cols].reshape(-1).long()


def make_token_pool(
    kv: torch.Tensor, prefix_lens: torch.Tensor, t: int, *, page: int = 1, spare_requests: int = 2, gen=None
) -> TokenPool:
    """The rows of a problem as SGLang's allocator leaves them after a while: kv [b, s_max, d] holds
    request r's prefix + t rows first (the rest unused); they go to randomly permuted pages of `page`
    slots (page 0 kept as the padding; a request's rows fill its pages in order, as SGLang's paged
    allocator hands them out) of a pool with `spare_requests` unused req_to_token rows, the batch's
    rows in a random order."""
    b, s_max, d = kv.shape
    device = kv.device
    if page < 1:
        raise ValueError(f"page: expected >= 1, got {page}")
    lengths = prefix_lens.long().cpu() + t
    if int(lengths.max()) > s_max:
        raise ValueError(f"prefix_lens: prefix + t up to {int(lengths.max())} exceeds kv's {s_max} rows")
    counts = [-(-n // page) for n in lengths.tolist()]
    pages = (torch.randperm(sum(counts), generator=gen) + 1).to(device)
    pool = torch.zeros((sum(counts) + 1) * page, 1, d, dtype=kv.dtype, device=device)
    req_pool_indices = torch.randperm(b + spare_requests, generator=gen)[:b].to(device)
    req_to_token = torch.zeros(b + spare_requests, s_max, dtype=torch.int32, device=device)
    start = 0
    for r, (n, count) in enumerate(zip(lengths.tolist(), counts)):
        mine = (pages[start : start + count, None] * page + torch.arange(page, device=device)).reshape(-1)[:n]
        pool[mine, 0] = kv[r, :n]
        req_to_token[req_pool_indices[r], :n] = mine.int()
        start += count
    prefix_lens = prefix_lens.to(device=device, dtype=torch.int32)
    return TokenPool(pool, req_to_token, req_pool_indices, prefix_lens, t, page)


def dense_custom_mask(visibility: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
    """The port's custom mask for full trees: flat bool, request after request a [t, prefix + t] block
    whose prefix columns are all True and whose tree columns are visibility [b, t, t]."""
    blocks = []
    for vis, prefix in zip(visibility, prefix_lens.tolist()):
        block = torch.ones(vis.shape[0], prefix + vis.shape[0], dtype=torch.bool, device=vis.device)
        block[:, prefix:] = vis
        blocks.append(block.reshape(-1))
    return torch.cat(blocks)


def mask_indptr(prefix_lens: torch.Tensor, t: int) -> torch.Tensor:
    """[b + 1] int64: where each request's mask block starts (t (prefix + t) bools per request)."""
    out = torch.zeros(prefix_lens.shape[0] + 1, dtype=torch.int64, device=prefix_lens.device)
    out[1:] = torch.cumsum(t * (prefix_lens.long() + t), dim=0)
    return out


def prefix_kv_indices(pool: TokenPool, max_prefix: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [b + 1] int32, kv_indices [total] int64): the prefix slots, request after request, as
    the backend's create_flashinfer_kv_indices_triton writes them. max_prefix (>= every prefix) and total
    (>= their sum) are host bounds, so no host read (capturable): each request's row is scattered to its
    offset, the columns past its prefix to a dump entry past the end."""
    b, device = pool.prefix_lens.shape[0], pool.kv.device
    max_prefix = min(max_prefix, pool.req_to_token.shape[1])
    kv_indptr = torch.zeros(b + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(pool.prefix_lens, dim=0)
    cols = torch.arange(max_prefix, device=device)
    valid = cols < pool.prefix_lens[:, None]
    dest = torch.where(valid, kv_indptr[:-1, None].long() + cols, total)
    kv_indices = torch.zeros(total + 1, dtype=torch.int64, device=device)
    kv_indices.scatter_(0, dest.reshape(-1), pool.rows(max_prefix).long().reshape(-1))
    return kv_indptr, kv_indices[:total]


@dataclass
class ExtendCall:
    """extend_attention_fwd's inputs for one DDTree target verify, as the port's Triton backend passes
    them (the module docstring); `__call__(fn)` makes the call and returns o_extend [b t, h, d_v]."""

    q_extend: torch.Tensor
    k_extend: torch.Tensor
    v_extend: torch.Tensor
    o_extend: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor
    max_len_extend: int
    sm_scale: float
    is_causal: bool = True

    def __call__(self, fn: Callable) -> torch.Tensor:
        fn(
            self.q_extend, self.k_extend, self.v_extend, self.o_extend, self.k_buffer, self.v_buffer,
            self.qo_indptr, self.kv_indptr, self.kv_indices, self.custom_mask, self.is_causal,
            self.mask_indptr, self.max_len_extend, 1.0, 1.0, self.sm_scale,
            logit_cap=0.0, sliding_window_size=-1, sinks=None, window_kv_offsets=None,
            xai_temperature_len=-1, page_size=1,
        )  # fmt: skip
        return self.o_extend


def extend_call(
    pool: TokenPool, q: torch.Tensor, visibility: torch.Tensor, sm_scale: float, d_v: int
) -> ExtendCall:
    """ExtendCall for queries q [b, t, h, d] of the tree whose rows `pool` holds after each prefix, the
    tree given as visibility [b, t, t] bool (ancestor-or-self)."""
    b, t, h, d = q.shape
    if pool.kv.shape[-1] != d or visibility.shape != (b, t, t) or pool.t != t:
        raise ValueError(f"q: [b, t, h, d] = {tuple(q.shape)} does not match the pool's rows "
                         f"{tuple(pool.kv.shape)}, its t = {pool.t} or the visibility "
                         f"{tuple(visibility.shape)}")  # fmt: skip
    device = q.device
    prefix_cpu = pool.prefix_lens.cpu()
    kv_indptr, kv_indices = prefix_kv_indices(pool, max(int(prefix_cpu.max()), 1), int(prefix_cpu.sum()))
    k_extend = pool.kv[pool.tree_slots()].contiguous()  # [b t, 1, d]: the rows the model saved
    return ExtendCall(
        q_extend=q.reshape(b * t, h, d).contiguous(),
        k_extend=k_extend,
        v_extend=k_extend[..., :d_v].contiguous(),
        o_extend=q.new_empty(b * t, h, d_v),
        k_buffer=pool.kv,
        v_buffer=pool.kv[..., :d_v],
        qo_indptr=torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=device),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        custom_mask=dense_custom_mask(visibility, prefix_cpu).to(device),
        mask_indptr=mask_indptr(pool.prefix_lens, t),
        max_len_extend=t,
        sm_scale=sm_scale,
    )
