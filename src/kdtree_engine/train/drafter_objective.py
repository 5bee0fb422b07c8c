"""The DFlash drafter's training objective: the parallel training forward over many blocks, the block
labels, the position-weighted cross-entropy and the chain acceptance it stands for.

Training forward. For a sequence x[0..S) and an anchor a (prompt_len - 1 <= a <= S - 1 - L, L =
block_size - 1), the block [x_a, MASK x L] at positions a..a+L attends to the context rows r < a
(hidden_norm(fc(X_r)) roped at r, X the pooled target features, see drafter_pool) and bidirectionally
to its own rows, as DFlashDrafter.forward does at a round whose bonus token is x_a. Its L outputs
predict x[a+1..a+L]; the cross-entropy of position k is weighted by exp(-(k - 1) / gamma): the early
positions decide how much of a chain is accepted. All the blocks of a batch run together: one attention
call per layer over keys [S context rows | all block rows] with a boolean mask, through the drafter's
own submodules, so the parameters trained are exactly those inference uses (`training_logits` equals
`DFlashDrafter.draft`, checked by the tests).

Dimension names: B sequences, S rows per sequence, A anchors per sequence, T = block_size = L + 1,
H target hidden, F = len(target_layer_ids) * H, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdtree_engine.drafter import DFlashDrafter

__all__ = ["block_labels", "chain_acceptance", "dflash_loss", "loss_weights", "training_logits"]


def _block_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """anchors [B, A] -> [B, A*T, S + A*T] bool: a row of block j sees the context rows r < anchors[j]
    and every row of block j (bidirectional), nothing of the other blocks."""
    b, a = anchors.shape
    dev = anchors.device
    ctx = torch.arange(seq_len, device=dev)[None, None, :] < anchors[:, :, None]  # [B, A, S]
    ctx = ctx[:, :, None, :].expand(b, a, block_size, seq_len).reshape(b, a * block_size, seq_len)
    block_of = torch.arange(a * block_size, device=dev) // block_size
    same = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)  # [B, A*T, A*T]
    return torch.cat([ctx, same], dim=2)


def _masked_layer(layer, x, ctx, block_rope, ctx_rope, mask) -> torch.Tensor:
    """DFlashLayer.forward for many blocks at once, without a cache: keys [context rows | block rows]."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q = attn.queries(h, *block_rope)
    k_blk, v_blk = attn.keys_values(h, *block_rope)
    k_ctx, v_ctx = attn.keys_values(ctx, *ctx_rope)
    k, v = torch.cat([k_ctx, k_blk], dim=1), torch.cat([v_ctx, v_blk], dim=1)
    x = x + attn.attend(q, k, v, mask)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int) -> torch.Tensor:
    """[B, A, T] int64: [x_a, MASK x L] per anchor."""
    block = anchors.new_full((*anchors.shape, block_size), mask_id)
    block[..., 0] = tokens.gather(1, anchors)
    return block


def _ropes(drafter: DFlashDrafter, anchors: torch.Tensor, seq_len: int, dtype: torch.dtype):
    """The rope tables of the block rows (positions a .. a + L per anchor, [B, A*T]) and of the context
    rows (0 .. S - 1)."""
    b, a = anchors.shape
    t, dev = drafter.config.block_size, anchors.device
    blk_pos = (anchors[:, :, None] + torch.arange(t, device=dev)).view(b, a * t)
    ctx_pos = torch.arange(seq_len, device=dev).expand(b, seq_len)
    return drafter._rope(blk_pos, dtype), drafter._rope(ctx_pos, dtype)


def training_logits(
    drafter: DFlashDrafter, target, tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """tokens [B, S] int64, features [B, S, F] (target_features), anchors [B, A] int64 in
    [0, S - 1 - L] -> draft logits [B, A, L, V] float32 of positions a + 1 .. a + L, with gradients to
    the drafter's parameters. Block j equals DFlashDrafter.draft with context rows < anchors[:, j],
    bonus x[anchors[:, j]] at start anchors[:, j]. The target's embed_tokens / lm_head are used as
    they are (freeze them with requires_grad_(False))."""
    cfg = drafter.config
    b, s = tokens.shape
    a, t = anchors.shape[1], cfg.block_size
    dtype = drafter.fc.weight.dtype
    ctx = drafter.hidden_norm(drafter.fc(features.to(dtype)))  # [B, S, H]
    block = _blocks(tokens, anchors, t, cfg.mask_token_id).view(b, a * t)
    x = target.embed_tokens(block).to(dtype)  # [B, A*T, H]
    block_rope, ctx_rope = _ropes(drafter, anchors, s, dtype)
    mask = _block_mask(anchors, s, t)
    for layer in drafter.layers:
        x = _masked_layer(layer, x, ctx, block_rope, ctx_rope, mask)
    hidden = drafter.norm(x).view(b, a, t, -1)[:, :, 1:]  # [B, A, L, H]
    lm_head = target.lm_head
    return lm_head(hidden.to(lm_head.weight.dtype)).float()


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, draft_len: int) -> torch.Tensor:
    """tokens [B, S], anchors [B, A] -> the targets x[a + 1 .. a + L] of every block [B, A, L]."""
    b, a = anchors.shape
    idx = anchors[:, :, None] + torch.arange(1, draft_len + 1, device=anchors.device)
    return tokens.gather(1, idx.view(b, a * draft_len)).view(b, a, draft_len)


def loss_weights(draft_len: int, gamma: float, device=None) -> torch.Tensor:
    """[L] float32: w_k = exp(-(k - 1) / gamma) for block positions k = 1 .. L (not normalized)."""
    k = torch.arange(draft_len, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, gamma: float) -> torch.Tensor:
    """logits [B, A, L, V], labels [B, A, L] -> sum_k w_k * mean cross-entropy at position k / sum_k w_k
    (a float32 scalar)."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none")
    per_position = ce.view(labels.shape).flatten(0, -2).mean(0)  # [L]
    w = loss_weights(labels.shape[-1], gamma, device=logits.device)
    return (per_position * w).sum() / w.sum()


def chain_acceptance(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, A] float32: 1 + the number of leading block positions whose argmax is the label, i.e. the
    tokens a greedy DFlash chain would commit per round on this block (the bonus token included)."""
    hits = (logits.argmax(-1) == labels).long()  # [B, A, L]
    return 1.0 + hits.cumprod(dim=-1).sum(-1).float()
