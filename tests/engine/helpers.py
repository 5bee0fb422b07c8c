"""Tiny random targets and test drafters for the engine tests (tests only)."""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from kdtree_engine.drafter import random_drafter, tiny_drafter_config
from kdtree_engine.engine.demo import RequestRows
from kdtree_engine.model import greedy_generate, random_model, tiny_config


@lru_cache(maxsize=8)
def tiny_target(seed: int = 0, vocab_size: int = 96, hidden_size: int = 32, layers: int = 3):
    """A seeded random tiny DeepSeek-V3 target (dense + MoE layers), float32 on the CPU."""
    cfg = tiny_config(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers)
    return random_model(cfg, seed=seed)


@lru_cache(maxsize=8)
def tiny_drafter(target_seed: int = 0, seed: int = 100, block_size: int = 8, **target_kw):
    target = tiny_target(target_seed, **target_kw)
    return random_drafter(tiny_drafter_config(target.config, block_size=block_size), seed=seed)


def hf_twin(directory, dtype: torch.dtype = torch.float32, seed: int = 0):
    """(transformers' DeepseekV3ForCausalLM, ours) with the same tiny random weights: the HF model is
    saved with save_pretrained under `directory` and ours is loaded from there by load_model."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from kdtree_engine.model import load_model
    from kdtree_engine.model.testing import randomize_

    d = tiny_config().to_hf_dict()
    d.pop("model_type")
    hf = DeepseekV3ForCausalLM._from_config(
        DeepseekV3Config(**d), attn_implementation="sdpa", experts_implementation="eager"
    )
    randomize_(hf, seed)
    hf = hf.to(dtype).eval()
    hf.save_pretrained(directory)
    return hf, load_model(directory, dtype=dtype)


def random_prompts(seed: int, lengths: list[int], vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


class OracleDrafter:
    """Knows the target's greedy continuation of every prompt and drafts logits that put the true token
    at position `pos` at rank `rank(pos)` (0 = top), on top of seeded random logits. `margin` sets the
    gap between consecutive top ranks; the rest of the vocabulary sits far below."""

    def __init__(
        self,
        target,
        prompts,
        horizon: int,
        block_size: int = 8,
        rank=lambda pos: 0,
        top: int = 2,
        margin: float = 0.1,
        seed: int = 0,
    ) -> None:
        self.block_size, self.target_layer_ids = block_size, (0,)
        self.vocab = target.config.vocab_size
        cont = greedy_generate(target, prompts, horizon + block_size + 1)
        self.sequences = [list(p) + c for p, c in zip(prompts, cont)]
        self.rank, self.top, self.margin = rank, top, margin
        self.gen = torch.Generator().manual_seed(seed)
        self.calls = 0

    def new_cache(self, batch_size: int, max_len: int) -> RequestRows:
        return RequestRows(list(range(batch_size)))

    def _row(self, true_token: int | None, pos: int) -> torch.Tensor:
        logits = torch.randn(self.vocab, generator=self.gen) - 20.0
        order = torch.randperm(self.vocab, generator=self.gen)
        if true_token is not None:  # move the true token to rank r
            r = self.rank(pos)
            order = order[order != true_token]
            order = torch.cat([order[:r], torch.tensor([true_token]), order[r:]])
        for r in range(self.top):
            logits[order[r]] = 5.0 - self.margin * r
        return logits

    def draft(self, target, context, context_lens, bonus, start, cache, impl=None) -> torch.Tensor:
        self.calls += 1
        depth = self.block_size - 1
        rows = []
        for r, s in zip(cache.rows, start.tolist()):
            seq = self.sequences[r]
            for i in range(1, depth + 1):
                pos = s + i
                rows.append(self._row(seq[pos] if pos < len(seq) else None, pos))
        return torch.stack(rows).view(len(cache.rows), depth, self.vocab).to(bonus.device)


def pick_only_at_the_end(bucket: int, before: int = 4):
    """A BudgetPolicy.pick for monkeypatching: the policy's own bookkeeping, then bucket `before`
    except for a call's last round (each round in flight committing one token at least), which gets
    `bucket`."""
    from kdtree_engine.engine.budget import BudgetPolicy

    real_pick = BudgetPolicy.pick

    def pick(self, active, must_draft, remaining=None):
        left = max(r for r, a in zip(remaining, active, strict=True) if a) - len(self.pending)
        real_pick(self, active, must_draft, remaining)
        return bucket if left <= 1 else before

    return pick


def pick_sequence(buckets, stepping_from: int | None = None):
    """A BudgetPolicy.pick for monkeypatching: the policy's own bookkeeping, then `buckets` in turn
    (cycled; a drafting bucket while the drafter must run); from round `stepping_from` on, the call is
    given to steps (plain decoding's step)."""
    from kdtree_engine.engine.budget import BudgetPolicy

    real_pick = BudgetPolicy.pick
    rounds = iter(range(10**6))

    def pick(self, active, must_draft, remaining=None):
        real_pick(self, active, must_draft, remaining)
        i = next(rounds)
        if stepping_from is not None and i >= stepping_from:
            self.stepping = True
            return 0
        bucket = buckets[i % len(buckets)]
        return 4 if bucket == 0 and must_draft else bucket

    return pick


class HostPrefillGraphs:
    """engine.prefill.PrefillGraphs on the CPU: the same bookkeeping (a width captured once, after its
    first eager prefill; static ids and lengths written before each replay; outputs whose tensors keep
    their addresses, zeros until the first replay), a replay that runs the forward on the static inputs
    and copies its outputs in. `captures` counts captures (reset by the tests)."""

    captures = 0

    def __init__(self) -> None:
        self.graphs: dict[int, _HostPrefill] = {}

    def get(self, width: int):
        return self.graphs.get(width)

    def capture(self, run, cache, ids, lens) -> None:
        self.graphs[ids.shape[1]] = _HostPrefill(run, cache, ids.clone(), lens.clone())
        HostPrefillGraphs.captures += 1


class _HostPrefill:
    def __init__(self, run, cache, ids, lens) -> None:
        from kdtree_engine.model.model import ForwardOutput

        self.target, self.cache, self.ids, self.lens = run, cache, ids, lens
        self.replays = 0
        cfg = run.target.config
        b, t = ids.shape
        logits = torch.zeros(b, 1, cfg.vocab_size)
        hidden = torch.zeros(b, t, cfg.hidden_size * len(run.capture)) if run.capture else None
        self.out = ForwardOutput(logits, hidden)

    def run(self, ids, lens):
        from kdtree_engine.engine.prefill import prefill_forward

        self.ids.copy_(ids)
        self.lens.copy_(lens)
        self.replays += 1
        out = prefill_forward(self.target, self.cache, self.ids, self.lens, validate=False)
        self.out.logits.copy_(out.logits)
        if self.out.hidden is not None:
            self.out.hidden.copy_(out.hidden)
        return self.out


def report_line(line: str, name: str = "engine_gpu.txt") -> None:
    """Prints a GPU test's measured line and appends it to $OUT/name where $OUT is set (the device
    call's results folder, scripts/gpu_check.sh)."""
    print(line)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "a") as f:
            f.write(line + "\n")
