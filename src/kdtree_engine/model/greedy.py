"""Plain greedy autoregressive decoding on the latent cache: the baseline that greedy DDTree must equal
token for token. The speculative engine is kdtree_engine.engine.generate."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kdtree_engine.model.model import DeepseekV3ForCausalLM


def pad_prompts(
    prompts: Sequence[Sequence[int]], device, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged prompts -> input_ids [b, t] int64 (padded with 0; t = width, default the longest prompt's
    length) and lengths [b] int64."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("input_ids: expected a non-empty prompt per request")
    longest = max(len(p) for p in prompts)
    if width is not None and width < longest:
        raise ValueError(f"width: expected >= the longest prompt ({longest}), got {width}")
    t = longest if width is None else width
    ids = torch.zeros(len(prompts), t, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
    return ids.to(device), torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)


@torch.no_grad()
def greedy_generate(
    model: DeepseekV3ForCausalLM,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    impl: str | None = None,
) -> list[list[int]]:
    """Greedy decoding. input_ids: [b, t] int64 or a list of b ragged prompts; impl: as for the model
    forward ("ref", "triton", "hopper" or None). Returns per request the new tokens only (at most
    max_new_tokens; stops after eos_token_id when given)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected >= 0, got {max_new_tokens}")
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.tolist()
    ids, lengths = pad_prompts(input_ids, model.device)
    b = ids.shape[0]
    cache = model.new_cache(b, ids.shape[1] + max_new_tokens)
    out: list[list[int]] = [[] for _ in range(b)]
    done = [max_new_tokens == 0] * b
    if max_new_tokens == 0:
        return out
    logits = model(ids, cache, lengths=lengths, impl=impl, logits_rows=lengths - 1).logits  # [b, 1, V]
    nxt = logits[:, 0].argmax(-1)  # [b]
    for _ in range(max_new_tokens):
        for i, tok in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(tok)
                done[i] = len(out[i]) == max_new_tokens or tok == eos_token_id
        if all(done):
            break
        nxt = model(nxt[:, None], cache, impl=impl).logits[:, -1].argmax(-1)
    return out
