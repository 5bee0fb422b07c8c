"""What SGLang's DDTree port (Rancy-Wang/sglang ddtree-v2 at 433c58ed) needs changed to run on the CPU,
applied at run time in every SGLang process, never by editing SGLang's files; and counters that prove
which of our functions ran.

SGLang loads this module as a plug-in: scripts/sglang_live.sh registers `load` in SGLang's
`sglang.srt.plugins` entry-point group (as `kdtree_sglang_live`), and the live test sets
SGLANG_PLUGINS=kdtree_sglang_live so that SGLang loads it alone. `load()` then
- applies PATCHES (each named, with its reason; docs/sglang.md has them as a table for the port);
- wraps our drop-in's functions and our attention backend's forward with counters;
- with KDTREE_ENGINE_SGLANG=1, calls our own plug-in hook (kdtree_engine.integrations.sglang.plugin.load:
  the tree path and the `kdtree_mla` backend); otherwise registers the `kdtree_mla` backend alone, so
  that the port's own tree path runs with our attention.
Counts are written after each call to KDTREE_SGLANG_LIVE_COUNTS/counts-<pid>.json (the scheduler is
another process) for the test to read.

Test-only: nothing in kdtree_engine imports it.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

ENV_COUNTS = "KDTREE_SGLANG_LIVE_COUNTS"
COUNTS: Counter = Counter()
APPLIED: list[str] = []
STATE: dict = {}


@dataclass(frozen=True)
class Patch:
    name: str
    where: str  # the port's file and function that needs it
    reason: str
    apply: Callable[[], None]
    only_with_drop_in: bool = False


# ---- the patches ---------------------------------------------------------------------------------------
def _replace_once(owner, name: str, make: Callable[[Callable], Callable], flag: str = "_kdtree_live"):
    """owner.<name> = make(original), dressed as the original and marked with `flag`, unless it already
    is such a replacement (a patch applied twice in one process). Returns (original, replacement), or
    None when it was already replaced."""
    original = getattr(owner, name)
    if getattr(original, flag, False):
        return None
    new = functools.wraps(original)(make(original))
    setattr(new, flag, True)
    setattr(owner, name, new)
    return original, new


def _record_stream_off_cuda() -> None:
    import torch

    def make(original):
        def record_stream(self, stream):
            if self.device.type == "cuda":
                return original(self, stream)
            return None  # the caching allocator this informs is CUDA's: nothing to do on the CPU

        return record_stream

    _replace_once(torch.Tensor, "record_stream", make)


def _dflash_on_cpu() -> None:
    hook = importlib.import_module("sglang.srt.arg_groups.speculative_hook")

    def make(original):
        def _handle_dflash(server_args):
            if server_args.device != "cpu":
                return original(server_args)
            server_args.device = "cuda"  # the check's only use of the device: the rest is device-free
            server_args._kdtree_live_cpu = True  # for draft_backend_on_cpu, which runs inside
            try:
                return original(server_args)
            finally:
                server_args.device = "cpu"

        return _handle_dflash

    _replace_once(hook, "_handle_dflash", make)


def _draft_backend_on_cpu() -> None:
    hook = importlib.import_module("sglang.srt.arg_groups.speculative_hook")

    def make(original):
        def _resolve_dflash_draft_attention_backend(server_args):
            original(server_args)
            if _on_cpu(server_args):
                server_args.speculative_draft_attention_backend = "torch_native"

        return _resolve_dflash_draft_attention_backend

    _replace_once(hook, "_resolve_dflash_draft_attention_backend", make)
    common = importlib.import_module("sglang.srt.speculative.draft_worker_common")  # the worker's own check
    if "torch_native" not in common._SUPPORTED_DRAFT_BACKENDS:
        common._SUPPORTED_DRAFT_BACKENDS = (*common._SUPPORTED_DRAFT_BACKENDS, "torch_native")


def _absorbed_mla_on_cpu() -> None:
    handler = importlib.import_module("sglang.srt.models.deepseek_common.attention_backend_handler")

    def handle_attention_absorbed(attn, forward_batch):
        return handler._dispatch_mla_subtype(attn, forward_batch)  # MLA, or its fused-rope CPU form (AMX)

    for name in ("torch_native", "kdtree_mla"):
        handler.AttentionBackendRegistry.register(name, handle_attention_absorbed)


def _gpu_builder_off_cuda() -> None:
    worker = importlib.import_module("sglang.srt.speculative.ddtree_worker_v2")
    utils = importlib.import_module("sglang.srt.speculative.ddtree_utils")
    original = worker.build_ddtree_tree  # the port's builder (counted)
    if getattr(original, "_kdtree_live_router", False):
        return
    import torch

    @functools.wraps(original)
    def build_ddtree_tree(draft_logits=None, tree_budget=None, device=None, _out_node_token_ids=None,
                          _out_node_depths=None, _out_parents=None, _out_visibility=None,
                          draft_top_log_probs=None, draft_top_token_ids=None,
                          prune_to_deepest_chains=False, profiler=None):  # fmt: skip
        gpu_builder = utils.build_ddtree_tree_gpu
        if draft_top_log_probs is None or not gpu_builder.__module__.startswith("kdtree_engine"):
            return original(draft_logits, tree_budget, device, _out_node_token_ids, _out_node_depths,
                            _out_parents, _out_visibility, draft_top_log_probs, draft_top_token_ids,
                            prune_to_deepest_chains, profiler)  # fmt: skip
        bs = draft_top_log_probs.shape[0]
        sizes = torch.zeros(bs, dtype=torch.long, device=draft_top_log_probs.device)
        return gpu_builder(
            draft_top_log_probs=draft_top_log_probs, draft_top_token_ids=draft_top_token_ids,
            tree_budget=tree_budget, device=device, _out_node_token_ids=_out_node_token_ids,
            _out_node_depths=_out_node_depths, _out_parents=_out_parents, _out_visibility=_out_visibility,
            _out_actual_tree_sizes=sizes, _heap_scores=None, _heap_parents=None, _heap_depths=None,
            _heap_ranks=None, prune_to_deepest_chains=prune_to_deepest_chains,
        )  # fmt: skip

    build_ddtree_tree._kdtree_live_router = True
    worker.build_ddtree_tree = build_ddtree_tree


def _triton_helpers_off_cpu() -> None:
    common = importlib.import_module("sglang.srt.utils.common")
    args = importlib.import_module("sglang.srt.runtime_context")

    def make(original):
        def support_triton(backend: str) -> bool:
            return original(backend) and not _on_cpu(args.get_server_args())

        return support_triton

    replaced = _replace_once(common, "support_triton", make)
    if replaced is None:
        return
    original, support_triton = replaced
    for name in SUPPORT_TRITON_USERS:  # modules that imported the function by name
        module = importlib.import_module(name)
        if getattr(module, "support_triton", None) is original:
            module.support_triton = support_triton


SUPPORT_TRITON_USERS = ("sglang.srt.utils", "sglang.srt.mem_cache.allocation",
                        "sglang.srt.model_executor.forward_batch_info")  # fmt: skip


def hide_amx() -> None:
    """Run before SGLang is imported, in every process: scripts/sglang_live.sh's .pth line calls it when
    KDTREE_SGLANG_LIVE_AMX_OFF=1 (SGLang picks its CPU kernels at import time, before plug-ins load)."""
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False


def _amx_off() -> None:
    """Where SGLang was imported before hide_amx (the test's own process, which runs no model): as far
    as it goes now; STATE["amx_at_import"] tells the test which process had AMX on at import."""
    common = importlib.import_module("sglang.srt.utils.common")
    STATE["amx_at_import"] = bool(common.cpu_has_amx_support())
    hide_amx()
    common.is_amx_tile_supported = False
    for name, module in list(sys.modules.items()):
        if name.startswith("sglang.") and getattr(module, "_is_cpu_amx_available", False) is True:
            module._is_cpu_amx_available = False


def _torch_native_target_verify() -> None:
    import copy

    import torch

    native = importlib.import_module("sglang.srt.layers.attention.torch_native_backend")

    def make(original):
        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            verify = forward_batch.forward_mode.is_target_verify()
            if not verify or forward_batch.extend_prefix_lens is not None:
                return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            block = copy.copy(forward_batch)  # seq_lens: the prefix; the block of t tokens after it
            t = q.shape[0] // forward_batch.batch_size
            block.extend_prefix_lens = forward_batch.seq_lens
            block.extend_seq_lens = torch.full_like(forward_batch.seq_lens, t)
            block.seq_lens = forward_batch.seq_lens + t
            return original(self, q, k, v, layer, block, save_kv_cache, **kwargs)

        return forward_extend

    _replace_once(native.TorchNativeAttnBackend, "forward_extend", make)


def _input_embeds_in_model_dtype() -> None:
    runner = importlib.import_module("sglang.srt.model_executor.model_runner")

    def make(original):
        def _extend_forward_kwargs(self, forward_batch, pp_proxy_tensors):
            kwargs = original(self, forward_batch, pp_proxy_tensors)
            embeds = kwargs.get("input_embeds")
            if embeds is not None and embeds.dtype != self.dtype:
                kwargs["input_embeds"] = embeds.to(self.dtype)  # the model's dtype, not always bf16
            return kwargs

        return _extend_forward_kwargs

    _replace_once(runner.ModelRunner, "_extend_forward_kwargs", make)


def _on_cpu(server_args) -> bool:
    return str(server_args.device).startswith("cpu") or getattr(server_args, "_kdtree_live_cpu", False)


PATCHES = (
    Patch("amx_off", "utils/common.py cpu_has_amx_support (and each module's _is_cpu_amx_available)",
          "on a CPU with AMX, SGLang runs sgl-kernel's CPU kernels, which fit DeepSeek's own sizes only: "
          "qkv_proj_with_rope_fused_weight aborts ('double free or corruption') on kimi-nano (kv_lora_rank "
          "64, rope dim 16), and rmsnorm_cpu refuses float32; with AMX reported absent SGLang takes its "
          "torch-native CPU paths (torch.cpu._is_amx_tile_supported answers False in every process, "
          "set before SGLang's import by hide_amx)", _amx_off),
    Patch("record_stream_off_cuda", "speculative/ddtree_worker_v2.py DDTreeWorkerV2.forward_batch_generation",
          "calls batch.seq_lens.record_stream(current_stream) on CPU tensors, which raises; made a no-op "
          "for non-CUDA tensors", _record_stream_off_cuda),
    Patch("dflash_on_cpu", "arg_groups/speculative_hook.py _handle_dflash",
          "raises 'DFLASH speculative decoding only supports CUDA device' (DDTree reuses it); nothing "
          "else in it depends on the device", _dflash_on_cpu),
    Patch("draft_backend_on_cpu", "arg_groups/speculative_hook.py _resolve_dflash_draft_attention_backend; "
          "speculative/draft_worker_common.py _SUPPORTED_DRAFT_BACKENDS",
          "the DFlash draft worker's backends (flashinfer, fa3, fa4, triton, ascend) lack torch_native, "
          "the one that runs on the CPU: both checks fall back to flashinfer; torch_native when the device "
          "is the CPU, and added to the worker's list",
          _draft_backend_on_cpu),
    Patch("absorbed_mla_on_cpu",
          "models/deepseek_common/attention_backend_handler.py AttentionBackendRegistry",
          "unregistered backend names get the triton handler, whose prefill takes the MHA path; "
          "torch_native reads K and V from the MLA pool as stored, so it needs the absorbed (MLA) path "
          "in every forward; registered for torch_native and kdtree_mla (whose prefill is torch_native's)",
          _absorbed_mla_on_cpu),
    Patch("torch_native_target_verify", "layers/attention/torch_native_backend.py forward_extend",
          "reads extend_prefix_lens / extend_seq_lens, which a TARGET_VERIFY batch does not carry (the "
          "DFlash draft's block forward is one: seq_lens the prefix, block_size tokens after it); given "
          "prefix = seq_lens and extend = the block, the drafter's non-causal block (ENCODER_ONLY "
          "layers) runs on torch_native", _torch_native_target_verify),
    Patch("input_embeds_in_model_dtype", "model_executor/model_runner.py ModelRunner._extend_forward_kwargs",
          "casts every input_embeds to bf16 (`.bfloat16()`): in a float32 run the DFlash draft's block "
          "(embedded by the target) meets float32 weights ('expected m1 and m2 to have the same dtype'); "
          "cast to the runner's dtype instead", _input_embeds_in_model_dtype),
    Patch("triton_helpers_off_cpu", "utils/common.py support_triton (allocation.py, forward_batch_info.py)",
          "answers by backend name only (all but torch_native and intel_amx): the KV-index writers then "
          "launch Triton kernels on the CPU ('0 active drivers'); False when the device is the CPU",
          _triton_helpers_off_cpu),
    Patch("gpu_builder_off_cuda", "speculative/ddtree_worker_v2.py DDTreeWorkerV2 (tree build)",
          "the worker takes build_ddtree_tree_gpu only when the top-k is on CUDA, so a builder that runs "
          "on any device (ours) is never called on the CPU; the CPU builder's call is routed to it when "
          "the drop-in is installed", _gpu_builder_off_cuda, only_with_drop_in=True),
)  # fmt: skip


# ---- counters ------------------------------------------------------------------------------------------
def _dump() -> None:
    folder = os.environ.get(ENV_COUNTS)
    if folder:
        path = os.path.join(folder, f"counts-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "applied": APPLIED, "counts": dict(COUNTS), **STATE}, f)
        os.replace(path + ".tmp", path)


def _counted(key: Callable[..., str] | str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        out = fn(*args, **kwargs)
        COUNTS[key(*args, **kwargs) if callable(key) else key] += 1
        _dump()
        return out

    counted._kdtree_live = True
    return counted


def _install_counters() -> None:
    """Before our plug-in installs: it reads these module attributes, so SGLang gets the counted ones."""
    from kdtree_engine.integrations import sglang as ours
    from kdtree_engine.integrations.sglang import attention, plugin, topk

    for name in plugin.FUNCTIONS:
        fn = getattr(ours, name)
        if not getattr(fn, "_kdtree_live", False):
            setattr(ours, name, _counted(name, fn))
    method = topk.compute_draft_topk_log_probs_and_token_ids
    if not getattr(method, "_kdtree_live", False):
        topk.compute_draft_topk_log_probs_and_token_ids = _counted(plugin.METHOD, method)
    backend = attention.TreeMLABackend
    if not getattr(backend._attend, "_kdtree_live", False):
        kind = lambda self, *a, **k: f"attend:{self.forward_metadata.kind}"  # noqa: E731
        backend._attend = _counted(kind, backend._attend)
        backend._plan = _counted(lambda self, q, kv, meta, layer: f"plan:{meta.kind}", backend._plan)
        backend._delegate = _counted(lambda self, hook, *a, **k: f"fallback:{hook}", backend._delegate)


def _count_port_builders() -> None:
    """The port's own CPU builder and follow, counted where the worker calls them (to show which ran)."""
    worker = importlib.import_module("sglang.srt.speculative.ddtree_worker_v2")
    for name in ("build_ddtree_tree", "follow_verified_tree"):
        fn = getattr(worker, name)
        if not getattr(fn, "_kdtree_live_port", False):
            wrapped = _counted(f"port:{name}", fn)
            wrapped._kdtree_live_port = True
            setattr(worker, name, wrapped)


# ---- the plug-in hook ----------------------------------------------------------------------------------
def load() -> None:
    """SGLang's plug-in hook (see the module docstring)."""
    drop_in = os.environ.get("KDTREE_ENGINE_SGLANG") == "1"
    _install_counters()
    from kdtree_engine.integrations.sglang import plugin

    if drop_in:
        plugin.load()
    else:  # the kdtree_mla backend alone: the port's own tree path verifies through it
        plugin._import_workers()
        plugin._install_attention(importlib.import_module(plugin.UTILS))
    _count_port_builders()  # before the patches, so that a call routed past the port's builder is not counted
    for patch in PATCHES:
        if patch.only_with_drop_in and not drop_in:
            continue
        patch.apply()
        if patch.name not in APPLIED:
            APPLIED.append(patch.name)
    _dump()
    print(f"kdtree-engine live harness: {APPLIED} (pid {os.getpid()})", file=sys.stderr)
