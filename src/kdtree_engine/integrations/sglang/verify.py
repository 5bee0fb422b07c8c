"""`compile_ddtree_tree` and `follow_verified_tree_gpu` with the SGLang DDTree port's signatures.

compile_ddtree_tree turns the trees in the port's layout (root token, node tokens / depths, visibility,
see ref/sglang_verify.py) into the verify forward's inputs: input ids and positions [bs, q] and, for the
attention backends that take one, the request-packed bool allow-mask; without the mask (the
FlashAttention path) it instead rewrites the visibility rows of the padding slots as self-only rows, in
place, as the port does. follow_verified_tree_gpu walks the target's greedy predictions down each tree
and returns the accepted path.

On CUDA both run our Triton kernels (kernels/sglang_verify.py) without
reading anything back to the host, except where the port's contract needs a host value: the packed
mask's size depends on the past lengths, so they are read when past_lens_cpu is not given. On other
devices the torch reference runs. Outputs go into the caller's buffers where given (rows [:bs]).
"""

from __future__ import annotations

import torch

from kdtree_engine.integrations.sglang._checks import check_budget, check_covers, need
from kdtree_engine.integrations.sglang.replay import replayed
from kdtree_engine.ref import sglang_verify as ref

COMPILE_OUTS = {"build_attention_mask": 12, "_out_verify_input_ids": 13, "_out_verify_position_ids": 14}
FOLLOW_OUTS = ("accepted_indices", "accepted_token_ids", "accepted_lens", "next_tokens")


def _compile_allocates(args, kwargs) -> bool:
    """Whether a compile_ddtree_tree call builds the packed mask (its size changes with the prefix
    lengths) or allocates an output: such calls are not replayed (replay.py)."""
    got = {k: kwargs.get(k, args[i] if len(args) > i else None) for k, i in COMPILE_OUTS.items()}
    mask = got["build_attention_mask"]
    return (
        (mask is None or bool(mask))
        or got["_out_verify_input_ids"] is None
        or (got["_out_verify_position_ids"] is None)
    )


def _follow_allocates(args, kwargs) -> bool:
    return any(kwargs.get(k) is None for k in FOLLOW_OUTS)


def _is_int(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _check(t, name: str, dims: int, least: tuple[int, ...], dev: torch.device, dtype: str = "int") -> None:
    """ValueError naming `name` unless t is a `dims`-d tensor on dev, at least `least` in each dim, of
    integer dtype (dtype="int") or bool (dtype="bool")."""
    need(isinstance(t, torch.Tensor), name, f"expected a tensor, got {type(t).__name__}")
    need(t.dim() == dims, name, f"expected {dims} dims, got shape {tuple(t.shape)}")
    need(t.device == dev, name, f"on {t.device}, expected {dev}")
    check_covers(t, name, least)
    if dtype == "bool":
        need(t.dtype == torch.bool, name, f"expected a bool tensor, got {t.dtype}")
    else:
        need(_is_int(t), name, f"expected an integer tensor, got {t.dtype}")


def _unit(t: torch.Tensor) -> torch.Tensor:
    """A 1-d tensor with unit stride (the kernels index [B] vectors densely); a device copy if needed."""
    return t if t.stride(0) == 1 else t.contiguous()


def _verify_width(tree_budget, verify_token_num) -> int:
    """q, the verify slots per request: verify_token_num, else tree_budget + 1 (the port's rule)."""
    if verify_token_num is None:
        check_budget(tree_budget)
        return tree_budget + 1
    q = int(verify_token_num)
    need(q > 0, "verify_token_num", f"DDTree verify_token_num must be positive, got {q}.")
    return q


def _flat_out(buf, name: str, bs: int, q: int, dev: torch.device) -> torch.Tensor:
    """The [bs, q] view of the first bs * q elements of a caller's flat buffer (as the port slices it),
    or a fresh int64 tensor when buf is None."""
    if buf is None:
        return torch.empty((bs, q), dtype=torch.long, device=dev)
    need(isinstance(buf, torch.Tensor), name, f"expected a tensor, got {type(buf).__name__}")
    need(buf.device == dev, name, f"on {buf.device}, expected {dev}")
    need(_is_int(buf), name, f"expected an integer tensor, got {buf.dtype}")
    need(
        buf.numel() >= bs * q,
        name,
        f"DDTree output buffer is too small: capacity={buf.numel()}, required={bs * q}.",
    )
    need(buf.is_contiguous(), name, "expected a contiguous buffer (it is written through a flat view)")
    return buf.view(-1)[: bs * q].view(bs, q)


def _mask_out(buf, pasts: list[int], q: int, dev: torch.device) -> torch.Tensor:
    """The packed mask's storage: the first q * sum(past + q) elements of buf, or a fresh bool tensor."""
    numel = sum(q * (p + q) for p in pasts)
    if buf is None:
        return torch.empty(numel, dtype=torch.bool, device=dev)
    name = "_out_attention_mask"
    _check(buf, name, 1, (0,), dev, dtype="bool")
    need(buf.stride(0) == 1, name, "expected unit stride")
    too_small = f"DDTree attention-mask output buffer is too small: capacity={buf.numel()}, required={numel}."
    need(buf.numel() >= numel, name, too_small)
    return buf[:numel]


def _host_past_lengths(past_lens_cpu, past_lengths: torch.Tensor, bs: int) -> list[int]:
    """The past lengths on the host: past_lens_cpu, else read from the device (a host sync, as in the
    port: the packed mask's size depends on them)."""
    if past_lens_cpu is None:
        return [int(x) for x in past_lengths[:bs].tolist()]
    pasts = [int(x) for x in past_lens_cpu]
    need(len(pasts) == bs, "past_lens_cpu", f"expected {bs} entries (one per request), got {len(pasts)}")
    need(all(p >= 0 for p in pasts), "past_lens_cpu", "past lengths must be >= 0")
    if not past_lengths.is_cuda:  # free to compare on the host
        same = past_lengths[:bs].tolist() == pasts
        need(same, "past_lens_cpu", "differs from past_lengths")
    return pasts


def _check_sizes_fit(actual_sizes_cpu, actual_tree_sizes: torch.Tensor, bs: int, q: int) -> None:
    """The port's check that no tree exceeds q slots, from actual_sizes_cpu; on the CPU the sizes are
    read from actual_tree_sizes when the list is absent. On CUDA nothing is read back for it (a tree
    larger than q then acts as its first q slots)."""
    if actual_sizes_cpu is None:
        if actual_tree_sizes.is_cuda:
            return
        actual_sizes_cpu = actual_tree_sizes[:bs].tolist()
    largest = max((int(s) for s in actual_sizes_cpu), default=1)
    msg = "DDTree verify_token_num is smaller than a pruned tree: "
    need(largest <= q, "verify_token_num", msg + f"verify_token_num={q}, max_actual_size={largest}.")


@replayed(device_arg="root_token_ids", bypass=_compile_allocates)
def compile_ddtree_tree(
    root_token_ids: torch.Tensor,
    node_token_ids: torch.Tensor,
    node_depths: torch.Tensor,
    visibility: torch.Tensor,
    start_positions: torch.Tensor,
    past_lengths: torch.Tensor,
    tree_budget: int,
    actual_tree_sizes: torch.Tensor,
    device: torch.device,
    past_lens_cpu: list[int] | None = None,
    actual_sizes_cpu: list[int] | None = None,
    verify_token_num: int | None = None,
    build_attention_mask: bool = True,
    _out_verify_input_ids: torch.Tensor | None = None,
    _out_verify_position_ids: torch.Tensor | None = None,
    _out_attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The verify inputs of bs = root_token_ids.shape[0] trees in q = verify_token_num (default
    tree_budget + 1) slots each.

    Inputs (rows [:bs] are used; views with any strides): root_token_ids [bs], node_token_ids /
    node_depths [>= bs, >= q - 1], visibility [>= bs, >= q, >= q] bool, start_positions / past_lengths /
    actual_tree_sizes [>= bs] (real slots with the root). Returns (verify_input_ids [bs, q]: root token,
    then node tokens; verify_position_ids [bs, q]: start, then start + depth; the packed bool allow-mask
    (request b a [q, past_b + q] block: real rows see the prefix and their visibility row over the real
    slots, padding rows only themselves) or None when build_attention_mask is False; actual_tree_sizes
    as given). Without the mask, visibility rows actual_size..q-1 of each request become self-only in
    place. The `_out_*` buffers, when given, are flat storage whose first elements are written.

    Host reads: with the mask and no past_lens_cpu, the past lengths are read back (a sync, as in the
    port: they size the mask). The tree-size check runs on actual_sizes_cpu when given (on CUDA the
    sizes are never read back for it; the port does). `device` names where fresh outputs go; it must be
    the inputs' device.
    """
    _check(root_token_ids, "root_token_ids", 1, (0,), getattr(root_token_ids, "device", None))
    return _compile(
        root_token_ids, node_token_ids, node_depths, visibility, start_positions, past_lengths, tree_budget,
        actual_tree_sizes, device, past_lens_cpu, actual_sizes_cpu, verify_token_num, build_attention_mask,
        _out_verify_input_ids, _out_verify_position_ids, _out_attention_mask,
        use_kernels=root_token_ids.is_cuda,
    )  # fmt: skip


def _compile(
    root_token_ids, node_token_ids, node_depths, visibility, start_positions, past_lengths, tree_budget,
    actual_tree_sizes, device, past_lens_cpu, actual_sizes_cpu, verify_token_num, build_attention_mask,
    out_ids, out_pos, out_mask, *, use_kernels: bool,
):  # fmt: skip
    """compile_ddtree_tree on the kernels (use_kernels; the tests also run them on the CPU through the
    Triton interpreter) or on the reference."""
    q = _verify_width(tree_budget, verify_token_num)
    bs, dev = root_token_ids.shape[0], root_token_ids.device
    want_dev = torch.device(device)
    same_dev = want_dev.type == dev.type and (want_dev.index is None or want_dev.index == dev.index)
    need(same_dev, "device", f"{want_dev}, but root_token_ids is on {dev}")
    _check(node_token_ids, "node_token_ids", 2, (bs, q - 1), dev)
    _check(node_depths, "node_depths", 2, (bs, q - 1), dev)
    _check(visibility, "visibility", 3, (bs, q, q), dev, dtype="bool")
    _check(start_positions, "start_positions", 1, (bs,), dev)
    _check(actual_tree_sizes, "actual_tree_sizes", 1, (bs,), dev)
    _check_sizes_fit(actual_sizes_cpu, actual_tree_sizes, bs, q)
    ids = _flat_out(out_ids, "_out_verify_input_ids", bs, q, dev)
    pos = _flat_out(out_pos, "_out_verify_position_ids", bs, q, dev)
    roots, starts, sizes = _unit(root_token_ids), _unit(start_positions[:bs]), _unit(actual_tree_sizes[:bs])
    mask = pasts = None
    if build_attention_mask:
        _check(past_lengths, "past_lengths", 1, (bs,), dev)
        pasts = _host_past_lengths(past_lens_cpu, past_lengths, bs)
        mask = _mask_out(out_mask, pasts, q, dev)

    if use_kernels:
        from kdtree_engine.kernels import sglang_verify as K

        K.write_verify_inputs(roots, node_token_ids, node_depths, starts, sizes, visibility, ids, pos,
                              pad_visibility=not build_attention_mask)  # fmt: skip
        if mask is not None:
            max_kv = max(pasts, default=0) + q
            K.write_packed_mask(visibility, sizes, _unit(past_lengths[:bs]), q, max_kv, mask)
    else:
        want_ids, want_pos = ref.verify_inputs(roots, node_token_ids, node_depths, starts, q)
        ids.copy_(want_ids)
        pos.copy_(want_pos)
        if mask is None:
            ref.pad_visibility_(visibility, sizes, q)
        else:
            mask.copy_(ref.packed_tree_mask(visibility, sizes, past_lengths[:bs], q))
    return ids, pos, mask, actual_tree_sizes


def _out_2d(buf, name: str, bs: int, q: int, dev: torch.device) -> torch.Tensor:
    """Rows [:bs], columns [:q] of a caller's [>= bs, >= q] buffer, or a fresh int64 [bs, q]."""
    if buf is None:
        return torch.empty((bs, q), dtype=torch.long, device=dev)
    _check(buf, name, 2, (bs, q), dev)
    return buf[:bs, :q]


def _out_1d(buf, name: str, bs: int, dev: torch.device) -> torch.Tensor:
    """Entries [:bs] of a caller's [>= bs] buffer, or a fresh int64 [bs]."""
    if buf is None:
        return torch.empty(bs, dtype=torch.long, device=dev)
    _check(buf, name, 1, (bs,), dev)
    return buf[:bs]


@replayed(device_arg="draft_tokens", bypass=_follow_allocates)
def follow_verified_tree_gpu(
    *,
    draft_tokens: torch.Tensor,
    target_predict: torch.Tensor,
    parents: torch.Tensor,
    actual_tree_sizes: torch.Tensor | None = None,
    accepted_indices: torch.Tensor | None = None,
    accepted_token_ids: torch.Tensor | None = None,
    accepted_lens: torch.Tensor | None = None,
    next_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The greedy accepted path through each verified tree.

    draft_tokens / target_predict / parents [bs, q] (verify layout: slot 0 the root; any strides),
    actual_tree_sizes [>= bs] (real slots with the root; clamped to [1, q]; default q). From the root,
    the target's prediction at the current node is looked up among the current node's real children and
    the walk moves to the lowest-numbered child drafted with it, until none is. Returns
    (accepted_indices [bs, q]: path nodes from 0, then -1; accepted_token_ids [bs, q]: their draft
    tokens, then 0; accepted_lens [bs] >= 1; next_tokens [bs]: the prediction at the last path node),
    views of the given buffers ([>= bs, >= q] / [>= bs]) or fresh int64 tensors. No host reads.
    """
    shape = getattr(draft_tokens, "shape", None)
    ok = isinstance(draft_tokens, torch.Tensor) and draft_tokens.dim() == 2
    need(ok, "draft_tokens", f"DDTree GPU follow expects [bs, q] draft_tokens, got {shape}")
    return _follow(
        draft_tokens, target_predict, parents, actual_tree_sizes, accepted_indices, accepted_token_ids,
        accepted_lens, next_tokens, use_kernels=draft_tokens.is_cuda,
    )  # fmt: skip


def _follow(
    draft_tokens, target_predict, parents, actual_tree_sizes, out_indices, out_tokens, out_lens, out_next,
    *, use_kernels: bool,
):  # fmt: skip
    """follow_verified_tree_gpu on the kernel (use_kernels; also under the Triton interpreter) or on the
    reference."""
    bs, q = draft_tokens.shape
    dev = draft_tokens.device
    need(q > 0, "draft_tokens", f"DDTree GPU follow q_len must be positive, got {q}.")
    _check(draft_tokens, "draft_tokens", 2, (bs, q), dev)
    for name, t in (("target_predict", target_predict), ("parents", parents)):
        _check(t, name, 2, (bs, q), dev)
        need(
            t.shape == draft_tokens.shape,
            name,
            f"expected shape {tuple(draft_tokens.shape)}, got {tuple(t.shape)}",
        )
    if actual_tree_sizes is None:
        sizes = torch.full((bs,), q, dtype=torch.long, device=dev)
    else:
        _check(actual_tree_sizes, "actual_tree_sizes", 1, (bs,), dev)
        sizes = _unit(actual_tree_sizes[:bs])
    indices = _out_2d(out_indices, "accepted_indices", bs, q, dev)
    tokens = _out_2d(out_tokens, "accepted_token_ids", bs, q, dev)
    lens = _out_1d(out_lens, "accepted_lens", bs, dev)
    nexts = _out_1d(out_next, "next_tokens", bs, dev)

    if use_kernels:
        from kdtree_engine.kernels.sglang_verify import follow_path

        follow_path(draft_tokens, target_predict, parents, sizes, indices, tokens, lens, nexts)
    else:
        for out, want in zip(
            (indices, tokens, lens, nexts),
            ref.follow_verified_path(draft_tokens, target_predict, parents, sizes),
        ):
            out.copy_(want)
    return indices, tokens, lens, nexts
