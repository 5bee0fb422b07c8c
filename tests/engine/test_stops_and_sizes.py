"""Stop strings end a request's decoding (per request, inside a batch), stats count only what was
committed, and the sizes of a call (engine.memory) cover what a verify forward allocates, checked
before anything is."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.engine import GenerationConfig, generate
from kdtree_engine.engine.text import StopStringMatcher
from kdtree_engine.engine.tokenizer import Tokenizer
from kdtree_engine.model import greedy_generate
from tests.engine.helpers import OracleDrafter, tiny_target

PROMPTS = [[1, 2, 3], [7, 8, 9, 10]]
IDS = Tokenizer(None)  # the id-only tokenizer: the text of [5, 17] is "5 17"


def _oracle(target, n: int):
    return OracleDrafter(target, PROMPTS, n, block_size=6)


def _kept(ids: list[int], stop: str) -> int:
    """Tokens up to and including the one whose text completes stop."""
    return next(k for k in range(1, len(ids) + 1) if stop in IDS.decode(ids[:k]))


@pytest.mark.parametrize("method", ["ddtree", "dflash", "autoregressive"])
def test_a_stop_string_ends_its_request_only(method):
    """Request 0 stops at the token that completes the stop string (kept); request 1, whose text never
    holds it, runs to its limit; the streamed tokens, the output and the stats agree."""
    target, n = tiny_target(0), 24
    full = greedy_generate(target, PROMPTS, n)
    pairs = [" ".join(map(str, full[0][i : i + 2])) for i in range(4, n - 4)]  # after a round or two
    stop = next(s for s in pairs if s not in IDS.decode(full[1]))
    kept = _kept(full[0], stop)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    config = GenerationConfig(max_new_tokens=n, method=method, budget=8, stop_strings=(stop,))
    drafter = _oracle(target, n) if method != "autoregressive" else None
    out = generate(
        target, drafter, PROMPTS, config, tokenizer=IDS, on_tokens=lambda b, t: streamed[b].extend(t)
    )
    assert 5 <= kept < n and out.tokens == [full[0][:kept], full[1]] == [streamed[0], streamed[1]]
    assert out.stats.new_tokens == [kept, n]
    if method != "autoregressive":
        assert sum(out.stats.accept_lengths) == kept + n - 2  # the prefill commits the first tokens


def test_stop_strings_need_a_tokenizer():
    config = GenerationConfig(max_new_tokens=4, method="autoregressive", stop_strings=("x",))
    with pytest.raises(ValueError, match="^tokenizer: config.stop_strings needs the tokenizer"):
        generate(tiny_target(0), None, PROMPTS, config)


def test_matcher_finds_the_completing_token_across_pushes():
    """A stop string split over tokens and over feeds: the count names the completing token."""
    matcher = StopStringMatcher(IDS, ["4 5 6"])
    assert matcher.feed([1, 2, 3, 4]) is None and matcher.feed([5]) is None
    assert matcher.feed([6, 7, 8]) == 1 and matcher.stopped and matcher.feed([4, 5, 6]) is None


def test_stats_count_only_committed_tokens():
    """max_new_tokens 4 with a drafter that gets everything accepted: the one round commits 3 tokens
    (after the prefill's one), not the 6 it accepted."""
    target = tiny_target(0)
    config = GenerationConfig(max_new_tokens=4, method="ddtree", budget=8)
    out = generate(target, _oracle(target, 4), PROMPTS[:1], config)
    assert out.stats.new_tokens == [4] and out.stats.accept_lengths == [3]
    assert out.stats.mean_accept_len == 3.0 and "mean accepted length 3.00" in out.stats.summary()


def test_sizes_include_the_reference_attention_scores():
    """A verify forward of N nodes with the reference attention holds float32 scores [N, h, S] (three
    copies); the kernels do not; the cache grows with the rows."""
    from kdtree_engine.engine.memory import generation_needs

    cfg = tiny_target(0).config
    nodes, rows = 100_001, 100_200
    kw = dict(prompt_lengths=[3], max_len=rows, budget=nodes - 1, block_size=8)
    ref = generation_needs(cfg, torch.float32, reference_attention=True, **kw)
    kernels = generation_needs(cfg, torch.float32, reference_attention=False, **kw)
    scores = 3 * nodes * cfg.num_attention_heads * rows * 4
    assert ref["budget"][1] - kernels["budget"][1] >= scores
    assert kernels["budget"][1] >= nodes * nodes  # the ancestor mask
    assert ref["max_new_tokens"][1] == cfg.num_hidden_layers * rows * cfg.latent_dim * 4


def test_budgets_that_cannot_fit_are_refused_before_allocating(monkeypatch):
    """With 512 MiB free, budget 4096: the mask and logits would fit, the reference scores do not."""
    import time

    from kdtree_engine.engine import checks

    monkeypatch.setattr(checks, "available_memory", lambda device: 2**29)
    target = tiny_target(0)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"^budget: a verify forward needs about \d+"):
        generate(target, _oracle(target, 4), PROMPTS, GenerationConfig(max_new_tokens=4, budget=4096))
    assert time.perf_counter() - t0 < 5
