"""Our tree-verify MLA attention as an attention backend of SGLang's DDTree port (Rancy-Wang/sglang,
branch ddtree-v2; `python/sglang/srt/layers/attention/base_attn_backend.py`).

The backend serves the absorbed-MLA forwards of a speculative target through `plan_attention`:
- decode: one new token per request, `seq_lens` counting it;
- target verify (DDTree): `draft_token_num` tree nodes per request after a prefix of `seq_lens`
  tokens, the tree taken from the worker's verify input as visibility `[bs, t, t]` and handed to the
  kernel as ancestor bits (t <= 64) or as that visibility; never a dense prefix mask;
- draft extend (DRAFT_EXTEND_V2): a causal block of the same width per request, `seq_lens` counting it.
Every other forward (prefill, ragged extend, idle) goes to a fallback SGLang backend ("triton" unless
configured): those carry ragged lengths or the non-absorbed MHA layer, which our op does not take.

SGLang's MLA KV pool (`[slots, 1, 576]` per layer) and its `req_to_token` table are read in place: the
pool is our paged cache with the pool's page size, and the block table is `req_to_token`'s rows of the
batch, one entry per page. One plan per forward, built by the forward's first attention layer (inside
a captured CUDA graph too, so that its device-side schedule is replayed) and reused by every layer;
no host read inside a captured forward.

Nothing here imports SGLang: `bind(base)` makes the backend class on the port's `AttentionBackend` and
`install(...)` registers it (called by kdtree_engine.integrations.sglang.plugin.install).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass

import torch

from kdtree_engine.attention import AttentionPlan, plan_attention
from kdtree_engine.impl import IMPLS
from kdtree_engine.integrations.sglang._checks import check_params, need
from kdtree_engine.ref import sglang_attention as ref_meta
from kdtree_engine.ref.sglang_attention import MAX_BITS

NAME = "kdtree_mla"
ENV_IMPL = "KDTREE_ENGINE_SGLANG_ATTENTION_IMPL"
ENV_FALLBACK = "KDTREE_ENGINE_SGLANG_ATTENTION_FALLBACK"
ENV_VALIDATE = "KDTREE_ENGINE_SGLANG_ATTENTION_VALIDATE"
DECODE, VERIFY, DRAFT_EXTEND = "decode", "target_verify", "draft_extend"

# The port's hooks we override or call, with the leading parameters ours take (checked at install).
HOOKS = {
    "init_forward_metadata": ["self", "forward_batch"],
    "init_forward_metadata_out_graph": ["self", "forward_batch", "in_capture"],
    "init_forward_metadata_in_graph": ["self", "forward_batch"],
    "init_cuda_graph_state": ["self", "max_bs", "max_num_tokens"],
    "get_cuda_graph_seq_len_fill_value": ["self"],
    "forward": ["self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"],
    "forward_decode": ["self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"],
    "forward_extend": ["self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"],
}


@dataclass(frozen=True)
class BackendConfig:
    """impl: kdtree_engine.impl's vocabulary (None: the fastest that runs). validate: check the lengths,
    tree diagonal and block table once per eager forward (one host sync; never while capturing).
    fallback: the SGLang backend name that serves the forwards we do not."""

    impl: str | None = None
    validate: bool = False
    fallback: str = "triton"

    def __post_init__(self):
        need(
            self.impl is None or self.impl in IMPLS,
            "impl",
            f"expected None or one of {IMPLS}, got {self.impl!r}",
        )
        need(self.fallback != NAME, "fallback", f"must be another SGLang backend than {NAME!r}")

    @classmethod
    def from_env(cls) -> BackendConfig:
        """KDTREE_ENGINE_SGLANG_ATTENTION_IMPL, _FALLBACK and _VALIDATE (=1), where set."""
        return cls(
            impl=os.environ.get(ENV_IMPL) or None,
            validate=os.environ.get(ENV_VALIDATE) == "1",
            fallback=os.environ.get(ENV_FALLBACK) or "triton",
        )


@dataclass
class ForwardMetadata:
    """One forward's attention inputs, shared by every layer. seqlens [bs] int32: cache slots per request,
    the new tokens (tree) being the last; block_table [bs, pages] int32 (page ids of the pool); bits
    [bs, t] int64 or visibility [bs, t, t] bool for a tree, neither for a causal block; max_seqlen: a
    host bound on seqlens when one is known without a sync; plan: built by the first layer."""

    kind: str
    seqlens: torch.Tensor
    block_table: torch.Tensor
    bits: torch.Tensor | None = None
    visibility: torch.Tensor | None = None
    max_seqlen: int | None = None
    graph: bool = False  # in the static graph buffers: planned without reading their values
    plan: AttentionPlan | None = None


class TreeMLABackend:
    """The backend's methods; `bind(base)` mixes them into a subclass of the port's AttentionBackend,
    whose `forward` dispatches to forward_decode / forward_extend."""

    def __init__(self, model_runner, fallback=None, config: BackendConfig | None = None):
        self.config = config or BackendConfig()
        self.fallback = fallback
        # SGLang's forward context reads these two off the running backend (forward_context.py)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token = self.req_to_token_pool.req_to_token  # [reqs, max_context] int32
        self.pool = self.token_to_kv_pool
        self.page_size = int(getattr(model_runner, "page_size", 1) or 1)
        self.device = self.req_to_token.device
        need(self.page_size >= 1, "page_size", f"expected >= 1, got {self.page_size}")
        self.forward_metadata: ForwardMetadata | None = None
        self.graph: dict[str, torch.Tensor] | None = None

    # ---- forward metadata -------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        """Eager: this forward's metadata in fresh tensors (ours), or the fallback's."""
        kind = forward_kind(forward_batch)
        if kind is None:
            self._delegate("init_forward_metadata", forward_batch)
            return
        self.forward_metadata = self._metadata(forward_batch, kind, graph=None)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Before a capture or a replay: this forward's metadata written into the static graph buffers,
        so that the captured kernels read the new lengths, pages and tree."""
        kind = forward_kind(forward_batch)
        if kind is None:
            self._delegate("init_forward_metadata_out_graph", forward_batch, in_capture)
            return
        need(self.graph is not None, "init_cuda_graph_state", "was not called before a graph forward")
        self.forward_metadata = self._metadata(forward_batch, kind, graph=self.graph)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Inside the capture: drop the plan, so that the captured forward's first layer plans again and
        its device-side schedule (read from the static lengths) is recorded with it."""
        if forward_kind(forward_batch) is None:
            self._delegate("init_forward_metadata_in_graph", forward_batch)
        elif self.forward_metadata is not None:
            self.forward_metadata.plan = None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static buffers for every captured batch size: lengths, block table, tree (bits and visibility;
        bs * t <= max_num_tokens)."""
        width = max(1, max_num_tokens // max(max_bs, 1))
        pages = -(-self.req_to_token.shape[1] // self.page_size)
        dev = self.device
        self.graph = {
            "seqlens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "block_table": torch.zeros(max_bs, pages, dtype=torch.int32, device=dev),
            "bits": torch.zeros(max_num_tokens, dtype=torch.int64, device=dev),
            "visibility": torch.zeros(max_num_tokens * width, dtype=torch.bool, device=dev),
        }

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Padded requests of a replayed batch get one prefix token (slot of req_to_token row entry 0)."""
        return 1

    def get_verify_buffers_to_fill_after_draft(self):
        return [None, None]

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Nothing: the tree is read from the verify input by init_forward_metadata_out_graph."""

    # ---- forwards ---------------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """One token per request: see _attend."""
        if forward_kind(forward_batch) is None:
            return self._delegate("forward_decode", q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """Target verify and draft extend are ours; any other extend is the fallback's."""
        if forward_kind(forward_batch) is None:
            return self._delegate("forward_extend", q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    @torch.compiler.disable  # as SGLang's own backends wrap their kernels: planning is Python
    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache, q_rope=None, k_rope=None, **kwargs):
        """The model's absorbed-MLA call, in either of DeepSeek-V2's forms: q [n, h * d] or [n, h, d]
        with k [n, 1, d] (latent then rope) and v [n, 1, d_v]; or q [n, h, d_v] with q_rope [n, h, d_r],
        k [n, 1, d_v] and k_rope [n, 1, d_r]. Writes the new tokens' cache rows (save_kv_cache), then
        returns out [n, h * d_v] in q's dtype (n = bs * t tokens, request-major)."""
        need(kwargs.get("sinks") is None and not getattr(layer, "logit_cap", 0), "layer",
             "attention sinks and logit capping are not supported by this backend")  # fmt: skip
        if save_kv_cache and k is not None:
            self._save(layer, forward_batch.out_cache_loc, k, v, k_rope)
        h, d_v = layer.tp_q_head_num, layer.v_head_dim
        q = q.reshape(q.shape[0], h, -1)
        if q_rope is not None:
            q = torch.cat([q, q_rope.reshape(q.shape[0], h, -1)], dim=-1)
        meta = self.forward_metadata
        need(meta is not None, "forward_batch", "no forward metadata: init_forward_metadata was not called")
        b = meta.seqlens.shape[0]
        need(q.shape[0] % b == 0, "q", f"{q.shape[0]} tokens do not split into {b} requests")
        q = q.view(b, q.shape[0] // b, h, q.shape[-1])  # [b, t, h, d]
        kv = self._layer_cache(layer, q.shape[-1])
        if meta.plan is None:
            meta.plan = self._plan(q, kv, meta, layer)
        out, _ = meta.plan.run(q, kv)  # [b, t, h, d_v]
        return out.reshape(b * q.shape[1], h * d_v)

    # ---- helpers ----------------------------------------------------------------------------------
    def _delegate(self, hook: str, *args, **kwargs):
        need(
            self.fallback is not None,
            "fallback",
            f"no fallback backend for a forward that {NAME} does not serve",
        )
        return getattr(self.fallback, hook)(*args, **kwargs)

    def _metadata(self, forward_batch, kind: str, graph: dict | None) -> ForwardMetadata:
        """Lengths with the new tokens, the block table from req_to_token, and the tree (verify only):
        one launch (kernels/sglang_attention.py) where the kernels run, else the torch reference;
        written into the static buffers for a graph forward."""
        seq_lens = forward_batch.seq_lens
        bs = seq_lens.shape[0]
        t = verify_width(forward_batch.spec_info) if kind == VERIFY else 0
        bound = None if graph is not None else host_bound(forward_batch, t)
        pages = -(-self.req_to_token.shape[1] // self.page_size)
        cols = pages if bound is None else min(pages, -(-bound // self.page_size))
        vis = tree_visibility(forward_batch.spec_info, t) if kind == VERIFY else None
        as_bits = vis is not None and t <= MAX_BITS and self.config.impl != "ref"  # ref plans copy bits
        inputs = (seq_lens, forward_batch.req_pool_indices, self.req_to_token)
        if self._metadata_kernel(vis):
            from kdtree_engine.kernels import sglang_attention as meta_kernel  # Triton is optional

            seqlens, table, bits = self._metadata_buffers(bs, cols, t if as_bits else 0, graph)
            meta_kernel.verify_metadata(
                *inputs, vis if as_bits else None, t, self.page_size, seqlens, table, bits
            )
        else:
            seqlens, table, bits = ref_meta.verify_metadata(
                *inputs, vis if as_bits else None, t, self.page_size, cols
            )
            if graph is not None:
                seqlens, table = _into(graph["seqlens"], seqlens), _into(graph["block_table"], table)
                bits = None if bits is None else _into(graph["bits"], bits)
        meta = ForwardMetadata(kind, seqlens, table, max_seqlen=bound, graph=graph is not None)
        if as_bits:
            meta.bits = bits
        elif vis is not None:
            padded = ref_meta.padded_visibility(vis, bs, t).to(self.device)
            meta.visibility = padded if graph is None else _into(graph["visibility"], padded)
        return meta

    def _metadata_kernel(self, vis: torch.Tensor | None) -> bool:
        """Whether the metadata kernel runs: where the attention kernels do (CUDA unless impl="ref"; the
        CPU only with impl="triton", through the interpreter), on a bool visibility of unit column stride
        on the same device."""
        on = self.config.impl != "ref" and (self.device.type == "cuda" or self.config.impl == "triton")
        fits = vis is None or (vis.dtype == torch.bool and vis.stride(-1) == 1 and vis.device == self.device)
        return on and fits and self.req_to_token.dtype == torch.int32 and self.req_to_token.stride(1) == 1

    def _metadata_buffers(self, bs: int, cols: int, t: int, graph: dict | None):
        """(seqlens [bs], block table [bs, cols], bits [bs, t] or None): fresh, or heads of the static
        graph buffers (whose block table is as wide as req_to_token's pages)."""
        if graph is None:
            dev = self.device
            seqlens = torch.empty(bs, dtype=torch.int32, device=dev)
            table = torch.empty(bs, cols, dtype=torch.int32, device=dev)
            bits = torch.empty(bs, t, dtype=torch.int64, device=dev) if t else None
            return seqlens, table, bits
        need(bs <= graph["seqlens"].shape[0] and bs * t <= graph["bits"].numel(), "init_cuda_graph_state",
             f"graph buffers too small for {bs} requests of {t} nodes")  # fmt: skip
        bits = graph["bits"][: bs * t].view(bs, t) if t else None
        return graph["seqlens"][:bs], graph["block_table"][:bs, :cols], bits

    def _layer_cache(self, layer, d: int) -> torch.Tensor:
        """The layer's pool buffer [slots, 1, d] seen as pages [slots / page, page, d] (no copy)."""
        kv = self.pool.get_key_buffer(layer.layer_id)
        need(kv.shape[-1] == d, "layer", f"query head dim {d} differs from the KV pool's {kv.shape[-1]}")
        slots = kv.shape[0] * (kv.shape[1] if kv.dim() == 3 else 1)
        need(
            slots % self.page_size == 0, "page_size", f"pool of {slots} slots is not a whole number of pages"
        )
        return kv.view(slots // self.page_size, self.page_size, d)

    def _plan(self, q: torch.Tensor, kv: torch.Tensor, meta: ForwardMetadata, layer) -> AttentionPlan:
        """The forward's one plan (see the module docstring)."""
        return plan_attention(
            q, kv, meta.seqlens, softmax_scale=float(layer.scaling), d_v=int(layer.v_head_dim),
            visibility=meta.visibility, ancestor_bits=meta.bits, block_table=meta.block_table,
            impl=self.config.impl, max_seqlen=meta.max_seqlen,
            validate=self.config.validate and not meta.graph,
        )  # fmt: skip

    def _save(self, layer, loc, k, v, k_rope) -> None:
        """The new tokens' rows of the layer's cache, through the pool's own writers (divided by the
        layer's k_scale where it has one, as SGLang's Triton backend stores MLA rows)."""
        scale = getattr(layer, "k_scale", None)
        if scale is not None:
            k, k_rope = k / scale, (None if k_rope is None else k_rope / scale)
        if k_rope is not None:
            self.pool.set_mla_kv_buffer(layer, loc, k, k_rope)
        else:
            self.pool.set_kv_buffer(layer, loc, k, v)


def forward_kind(forward_batch) -> str | None:
    """DECODE, VERIFY or DRAFT_EXTEND when this backend serves the forward, else None (the fallback's)."""
    mode = forward_batch.forward_mode
    if mode.is_idle():
        return None
    if mode.is_target_verify():
        return VERIFY
    if _is(mode, "is_draft_extend_v2"):
        return DRAFT_EXTEND
    if mode.is_decode() and getattr(forward_batch.spec_info, "kv_indptr", None) is None:
        return DECODE
    return None


def verify_width(spec_info) -> int:
    """Tree nodes per request of a verify input (DDTree: its draft_token_num)."""
    need(spec_info is not None, "spec_info", "target verify without a verify input")
    return int(spec_info.draft_token_num)


def tree_visibility(spec_info, t: int) -> torch.Tensor:
    """The verify input's visibility [>= bs or fewer, >= t, >= t] (ref_meta.padded_visibility pads it)."""
    vis = getattr(spec_info, "visibility", None)
    need(vis is not None, "spec_info.visibility", "the verify input carries no tree (did install() run?)")
    need(vis.dim() == 3 and vis.shape[1] >= t and vis.shape[2] >= t, "spec_info.visibility",
         f"expected [bs, >= {t}, >= {t}], got {tuple(vis.shape)}")  # fmt: skip
    return vis


def host_bound(forward_batch, t: int) -> int | None:
    """max(seq_lens) + t from the batch's host mirror, without a sync; None when it has none."""
    cpu = getattr(forward_batch, "seq_lens_cpu", None)
    if cpu is None or len(cpu) == 0:
        return None
    return int(max(cpu)) + t


def _is(mode, name: str) -> bool:
    check = getattr(mode, name, None)
    return bool(check()) if callable(check) else False


def _into(buffer: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value copied into the head of a static buffer (the same address every forward); returns that
    view. A 2-D buffer (the block table) takes value's rows; a 1-D one its elements."""
    if buffer.dim() == 2:
        need(value.shape[0] <= buffer.shape[0] and value.shape[1] == buffer.shape[1], "init_cuda_graph_state",
             f"graph buffer {tuple(buffer.shape)} does not take {tuple(value.shape)}")  # fmt: skip
        view = buffer[: value.shape[0]]
    else:
        need(value.numel() <= buffer.numel(), "init_cuda_graph_state",
             f"graph buffer of {buffer.numel()} too small for {tuple(value.shape)}")  # fmt: skip
        view = buffer[: value.numel()].view(value.shape)
    view.copy_(value)
    return view


# ---- binding to the port ---------------------------------------------------------------------------
def bind(base: type) -> type:
    """Our backend as a subclass of the port's AttentionBackend (ValueError naming a missing or changed
    hook)."""
    check_params(base, HOOKS, f"{base.__module__}.{base.__name__}")
    return type("TreeMLAAttnBackend", (TreeMLABackend, base), {"__module__": __name__})


def make_factory(cls: type, backends: dict, config: BackendConfig | None = None):
    """SGLang's backend factory: (model_runner) -> our backend over the fallback from `backends`."""

    def create_kdtree_mla_backend(runner):
        cfg = config or BackendConfig.from_env()
        need(getattr(runner, "use_mla_backend", True), "attention_backend", f"{NAME} serves MLA models only")
        need(cfg.fallback in backends, "fallback", f"{cfg.fallback!r} is not a registered SGLang backend")
        return cls(runner, fallback=backends[cfg.fallback](runner), config=cfg)

    return create_kdtree_mla_backend


def capability_with_ours(original, cls: type):
    """The port's resolve_ddtree_target_backend_capability, extended: our backend takes the full tree as
    visibility (no packed mask). Any other backend: the port's answer."""
    ours = f"{cls.__module__}.{cls.__name__}"

    def resolve_ddtree_target_backend_capability(attn_backend, speculative_attention_mode: str = "prefill"):
        found = original(attn_backend, speculative_attention_mode)
        if found.backend_name != ours:
            return found
        return dataclasses.replace(found, build_attention_mask=False, use_visibility=True,
                                   supports_full_tree=True, unsupported_reason="")  # fmt: skip

    resolve_ddtree_target_backend_capability.original = original
    return resolve_ddtree_target_backend_capability


REGISTRY = "sglang.srt.layers.attention.attention_registry"
BASE = "sglang.srt.layers.attention.base_attn_backend"
SERVER_ARGS = "sglang.srt.server_args"
CAPABILITY = "resolve_ddtree_target_backend_capability"
CAPABILITY_FIELDS = ("backend_name", "build_attention_mask", "use_visibility", "supports_full_tree")


def install(utils, config: BackendConfig | None = None) -> tuple[list[str], dict]:
    """Registers the backend as NAME with the port (and as a choice of --attention-backend) and wraps
    the port's capability check in `utils` (its ddtree_utils module). Returns the dotted names it
    changed and {original: replacement} of the capability check, for rebinding imported names.
    ValueError naming whatever the port lacks."""
    registry, base = _import(REGISTRY), _import(BASE)
    for name in ("register_attention_backend", "ATTENTION_BACKENDS"):
        need(hasattr(registry, name), f"{REGISTRY}.{name}", "missing (not the port this was checked against)")
    need(hasattr(base, "AttentionBackend"), f"{BASE}.AttentionBackend", "missing")
    original = getattr(utils, CAPABILITY, None)
    need(callable(original), f"{utils.__name__}.{CAPABILITY}", "missing")
    check_params(utils, {CAPABILITY: ["attn_backend", "speculative_attention_mode"]}, utils.__name__)
    fields = getattr(getattr(utils, "DDTreeTargetBackendCapability", None), "__dataclass_fields__", {})
    missing = [f for f in CAPABILITY_FIELDS if f not in fields]
    need(not missing, f"{utils.__name__}.DDTreeTargetBackendCapability", f"lacks the fields {missing}")
    if getattr(original, "__module__", "") == __name__:  # installed already
        return [], {}
    cls = bind(base.AttentionBackend)
    registry.register_attention_backend(NAME)(make_factory(cls, registry.ATTENTION_BACKENDS, config))
    changed = [f"{REGISTRY}.ATTENTION_BACKENDS[{NAME!r}]"] + _add_choice()
    wrapped = capability_with_ours(original, cls)
    setattr(utils, CAPABILITY, wrapped)
    return changed + [f"{utils.__name__}.{CAPABILITY}"], {CAPABILITY: (original, wrapped)}


def _add_choice() -> list[str]:
    """NAME among --attention-backend's choices (SGLang loads plug-ins before it parses arguments)."""
    server_args = _import(SERVER_ARGS)
    add = getattr(server_args, "add_attention_backend_choices", None)
    need(callable(add), f"{SERVER_ARGS}.add_attention_backend_choices", "missing")
    if NAME not in getattr(server_args, "ATTENTION_BACKEND_CHOICES", []):
        add([NAME])
    return [f"{SERVER_ARGS}.ATTENTION_BACKEND_CHOICES"]


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(f"{name}: cannot import it from the SGLang DDTree port: {exc}") from exc
