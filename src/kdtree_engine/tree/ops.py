"""Public tree ops: build, compile, accept. Each validates its inputs, then dispatches to ref/ or kernels/."""

from __future__ import annotations

import math

import torch

from kdtree_engine.impl import resolve_impl
from kdtree_engine.ref import sampling as ref_sampling
from kdtree_engine.ref import tree as ref
from kdtree_engine.tree import validate as v
from kdtree_engine.tree_types import AcceptResult, DraftTree, VerifyInputs

# The Triton kernels are imported where an op dispatches to them (lazily: triton is optional).


def _kernel_tree_from_logits(logits: torch.Tensor, budget: int) -> DraftTree:
    """build_tree_from_logits on the kernels (logits validated): the top-k (k = min(budget, V)) with the
    log-softmax normalizer, then the best-first build."""
    from kdtree_engine.kernels.tree_build import build_tree as kernel_build
    from kdtree_engine.kernels.tree_topk import logits_topk as kernel_topk

    b, depth, vocab = logits.shape
    if budget == 0 or b * depth == 0:
        lp = torch.zeros((b, depth, 1), dtype=torch.float32, device=logits.device)
        return kernel_build(lp, lp.long(), budget)
    lp, ids = kernel_topk(logits, min(budget, vocab))
    return kernel_build(lp, ids, budget)


def build_tree(
    top_logprobs,
    top_ids,
    budget: int,
    *,
    vocab_size: int | None = None,
    impl: str | None = None,
    validate: bool = True,
) -> DraftTree:
    """Best-first DDTree build from per-position top-k, exactly as the official builder.

    top_logprobs [B, L, K] float32 log-softmax values, rows sorted descending ([L, K] is taken as B=1);
    top_ids [B, L, K] int64 token ids; budget: nodes, root not counted, an int in [0, 4096]
    (ref.tree.MAX_BUDGET, for every impl: the Triton build packs node indices into 16-bit fields and
    keeps its frontier of next_pow2(budget) slots in registers; a larger budget is a ValueError naming
    `budget`, before anything is allocated). Only the first min(budget, K) columns are used.
    vocab_size, when given, bounds the ids. A -inf log-prob is a masked token (probability 0): it never
    enters the tree (nor its subtree), so the tree may hold fewer than `budget` nodes. NaN and +inf are
    refused when validating.
    Returns a DraftTree with tokens/depths [B, budget], parents [B, budget + 1], num_nodes [B].
    """
    budget = v.check_budget(budget)
    lp, ids = v.check_topk_inputs(top_logprobs, top_ids, vocab_size, validate)
    if resolve_impl(impl, lp.device) == "triton":
        from kdtree_engine.kernels.tree_build import build_tree as kernel_build

        return kernel_build(lp, ids, budget)
    return ref.build_tree(lp, ids, budget)


def _as_logits(draft_logits) -> torch.Tensor:
    """draft_logits as a [B, L, V] float tensor (fp32, bf16 or fp16: other dtypes are converted to
    float32 here, as both impls compute in float32, so the value checks see the values they use)."""
    logits = v.as_tensor(draft_logits, "draft_logits")
    if logits.dim() == 2:
        logits = logits.unsqueeze(0)
    v.check_rank(logits, "draft_logits", 3, "[B, L, V]")
    if not 1 <= logits.shape[-1] <= ref.MAX_VOCAB:
        raise ValueError(
            f"draft_logits: V (last dim) must be in [1, {ref.MAX_VOCAB}], got {logits.shape[-1]}"
        )
    v.require_float(logits, "draft_logits")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits


def logits_topk(draft_logits, k: int, *, impl: str | None = None, validate: bool = True):
    """draft_logits [B, L, V] -> (top_logprobs [B, L, min(k, V)] float32, top_ids int64): the inputs
    build_tree_from_logits gives build_tree (the same values on every device and impl), for a caller
    that also reads them (the engine's auto budget takes each node's log-probability from them)."""
    k = v.check_budget(k)
    logits = _as_logits(draft_logits)
    use_ref = resolve_impl(impl, logits.device) == "ref"
    if (validate or use_ref) and v.can_read(logits):
        v.check_log_values(logits, "draft_logits", empty_rows=False)
    if k == 0:
        raise ValueError("k: expected >= 1, got 0")
    if not use_ref:
        from kdtree_engine.kernels.tree_topk import logits_topk as kernel_topk

        return kernel_topk(logits, min(k, logits.shape[-1]))
    return ref.logits_to_topk(logits, k)


def build_tree_from_logits(
    draft_logits, budget: int, *, impl: str | None = None, validate: bool = True
) -> DraftTree:
    """draft_logits [B, L, V] (any float dtype; [L, V] is taken as B=1; 1 <= V <= 2^22), budget an int
    in [0, 4096] (ref.tree.MAX_BUDGET, as build_tree): top-k with k = min(budget, V) (ties: smaller
    token id first) of the float32 logits minus the log-softmax normalizer (ref.tree.log_normalizer:
    bit-identical on every device and impl), then build_tree.

    -inf logits are masked tokens (probability 0): they never enter the tree, which may then hold
    fewer than `budget` nodes. Refused when validating: NaN, +inf, a row without a finite logit. With
    validate=False the kernel path checks nothing (no sync) and such rows give an undefined tree;
    impl="ref" reads the logits on the host anyway and always checks them."""
    budget = v.check_budget(budget)
    logits = _as_logits(draft_logits)
    use_ref = resolve_impl(impl, logits.device) == "ref"
    if (validate or use_ref) and v.can_read(logits):
        v.check_log_values(logits, "draft_logits", empty_rows=False)
    if not use_ref:
        return _kernel_tree_from_logits(logits, budget)
    if budget == 0:
        empty = logits.new_zeros(*logits.shape[:2], 1)
        return ref.build_tree(empty, empty.long(), 0)
    lp, ids = ref.logits_to_topk(logits, budget)
    return ref.build_tree(lp, ids, budget)


def _check_tree(tree: DraftTree) -> None:
    if not isinstance(tree, DraftTree):
        raise ValueError(f"tree: expected a DraftTree, got {type(tree).__name__}")


def _check_per_request(x, name: str, tree: DraftTree, width: int | None = None) -> torch.Tensor:
    t = v.check_integer_dtype(v.as_tensor(x, name), name)
    shape = (tree.batch_size,) if width is None else (tree.batch_size, width)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    v.check_same_device({"tree": tree.tokens, name: t})
    return t.contiguous()


def _check_vocab_size(vocab_size) -> int | None:
    return None if vocab_size is None else v.check_int(vocab_size, "vocab_size", minimum=1)


def compile_tree(
    tree: DraftTree,
    root_tokens,
    start_positions,
    *,
    vocab_size: int | None = None,
    impl: str | None = None,
    validate: bool = True,
) -> VerifyInputs:
    """root_tokens [B] int64 (the bonus token each tree hangs from), start_positions [B] int64 (the
    root's position) -> VerifyInputs with N = budget + 1 (see its docstring). Value checks (root_tokens
    >= 0 and < vocab_size when given, start_positions >= 0) read the data with one host sync: skipped
    with validate=False and while a CUDA graph is captured."""
    _check_tree(tree)
    vocab_size = _check_vocab_size(vocab_size)
    roots = _check_per_request(root_tokens, "root_tokens", tree)
    starts = _check_per_request(start_positions, "start_positions", tree)
    if validate and v.can_read(starts):
        v.check_ranges({"root_tokens": (roots, vocab_size), "start_positions": (starts, None)})
    if resolve_impl(impl, tree.device) == "triton":
        from kdtree_engine.kernels.tree_compile import compile_tree as kernel_compile

        return kernel_compile(tree, roots, starts)
    return ref.compile_tree(tree, roots, starts)


def accept_greedy(
    tree: DraftTree,
    target_tokens,
    *,
    vocab_size: int | None = None,
    impl: str | None = None,
    validate: bool = True,
) -> AcceptResult:
    """target_tokens [B, N] int64, the target's argmax at every tree node (N = budget + 1) ->
    AcceptResult: accepted [B, L + 1] node indices (root first, -1 padded), accept_len [B], bonus [B].
    The value check (target_tokens >= 0 and < vocab_size when given) reads the data with one host sync:
    skipped with validate=False and while a CUDA graph is captured."""
    _check_tree(tree)
    vocab_size = _check_vocab_size(vocab_size)
    target = _check_per_request(target_tokens, "target_tokens", tree, tree.budget + 1)
    if validate and v.can_read(target):
        v.check_ranges({"target_tokens": (target, vocab_size)})
    if resolve_impl(impl, tree.device) == "triton":
        from kdtree_engine.kernels.tree_accept import accept_greedy as kernel_accept

        return kernel_accept(tree, target)
    return ref.accept_greedy(tree, target)


def _check_sampling_args(temperature, top_p, top_k) -> tuple[float, float, int]:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature: expected a float, got {type(temperature).__name__}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature: expected a finite value > 0, got {temperature}")
    if ref_sampling.float32_temperature(temperature) == 0:
        raise ValueError(f"temperature: {temperature} rounds to 0 in float32")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a float in (0, 1], got {top_p!r}")
    return float(temperature), float(top_p), v.check_int(top_k, "top_k")


def _check_seed(noise, generator, seed, offset) -> ref_sampling.Seeded:
    if seed is None:
        raise ValueError("offset: only used with seed=")
    if noise is not None:
        raise ValueError("noise: give either noise or seed, not both")
    if generator is not None:
        raise ValueError("generator: give either generator or seed, not both")
    seed = v.check_int(seed, "seed")
    offset = v.check_int(0 if offset is None else offset, "offset")
    ref_sampling.check_seed_range(seed, offset)
    return ref_sampling.Seeded(seed, offset)


def _check_noise(noise, generator, seed, offset, logits: torch.Tensor):
    if seed is not None or offset is not None:
        return _check_seed(noise, generator, seed, offset)
    if noise is None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
        if generator is not None and generator.device.type != logits.device.type:
            raise ValueError(f"generator: on {generator.device}, target_logits on {logits.device}")
        return ref_sampling.gumbel_noise(logits.shape, generator=generator, device=logits.device)
    if generator is not None:
        raise ValueError("noise: give either noise or generator, not both")
    noise = v.as_tensor(noise, "noise")
    if tuple(noise.shape) != tuple(logits.shape):
        raise ValueError(f"noise: expected shape {tuple(logits.shape)}, got {tuple(noise.shape)}")
    v.check_same_device({"target_logits": logits, "noise": noise})
    return v.check_float(noise, "noise").contiguous()


def _check_stream_keys(keys, noise, generator, seed, offset, logits, impl) -> torch.Tensor:
    if noise is not None or generator is not None or seed is not None or offset is not None:
        raise ValueError("stream_keys: give stream_keys alone, without noise, generator, seed or offset")
    if not isinstance(keys, torch.Tensor) or keys.shape != (2,) or keys.dtype != torch.int32:
        raise ValueError("stream_keys: expected a [2] int32 tensor (a row of ref.sampling.stream_key_table)")
    v.check_same_device({"target_logits": logits, "stream_keys": keys})
    if logits.device.type != "cuda" or resolve_impl(impl, logits.device) != "triton":
        raise ValueError("stream_keys: needs CUDA tensors and a kernel impl (use seed and offset otherwise)")
    return keys.contiguous()


def accept_sampled(
    tree: DraftTree,
    target_logits,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    noise=None,
    seed: int | None = None,
    offset: int | None = None,
    stream_keys: torch.Tensor | None = None,
    impl: str | None = None,
    validate: bool = True,
) -> tuple[AcceptResult, torch.Tensor]:
    """Sampled verification: draw the target's token at every node, then walk as accept_greedy.

    target_logits [B, N, V] float (N = budget + 1); temperature > 0; top_p in (0, 1]; top_k >= 0
    (0: off). Randomness, one of:
    - `seed` (int in [0, 2^64)) and `offset` (int in [0, 2^64), default 0): counter-based noise, a
      pure function of (seed, offset, b, n, v), computed inside the kernel (no [B, N, V] tensor). A
      caller drawing several times from one seed advances `offset` (e.g. once per verify round);
    - `noise` [B, N, V] float32 standard Gumbel noise;
    - drawn from `generator` (else torch's default generator) on the logits' device ([B, N, V] float32
      memory, like `noise`).
    - `stream_keys` [2] int32 on the logits' device: the keys of (seed, offset) computed beforehand
      (a row of ref.sampling.stream_key_table), so that a CUDA graph can pick the offset of each draw
      on the device; kernel impls on CUDA only. The same tokens as that (seed, offset).
    Given the same noise, or the same (seed, offset), the reference and the kernel return identical
    results (see ref/sampling.py for the exact rule).
    validate: refuse target_logits holding NaN or +inf, or a row that is not a distribution (all -inf,
    also after dividing by the temperature; the top-k / top-p filter always keeps a row's largest
    logit), with one host sync (check_sampling_logits); skipped with validate=False and while a CUDA
    graph is captured (such rows then sample an undefined token).
    Returns (AcceptResult, sampled [B, N] int64 target tokens).
    """
    _check_tree(tree)
    temperature, top_p, top_k = _check_sampling_args(temperature, top_p, top_k)
    logits = v.as_tensor(target_logits, "target_logits")
    v.check_rank(logits, "target_logits", 3, "[B, N, V]")
    shape = (tree.batch_size, tree.budget + 1)
    if tuple(logits.shape[:2]) != shape or logits.shape[-1] == 0:
        raise ValueError(f"target_logits: expected shape {shape + ('V>=1',)}, got {tuple(logits.shape)}")
    v.require_float(logits, "target_logits")
    v.check_same_device({"tree": tree.tokens, "target_logits": logits})
    use_kernels = resolve_impl(impl, tree.device) == "triton"
    if stream_keys is not None:
        noise = _check_stream_keys(stream_keys, noise, generator, seed, offset, logits, impl)
    else:
        noise = _check_noise(noise, generator, seed, offset, logits)
    t32 = ref_sampling.float32_temperature(temperature)
    if validate and v.can_read(logits):
        v.check_sampling_logits(logits, "target_logits", t32)
    cutoffs = ref_sampling.sampling_cutoffs(logits, temperature, top_k, top_p)
    if use_kernels:
        from kdtree_engine.kernels.tree_accept import accept_greedy as kernel_accept
        from kdtree_engine.kernels.tree_sample import sample_tokens

        sampled = sample_tokens(logits.contiguous(), noise, cutoffs, t32)
        return kernel_accept(tree, sampled), sampled
    return ref_sampling.accept_sampled(tree, logits, noise, cutoffs, t32)
