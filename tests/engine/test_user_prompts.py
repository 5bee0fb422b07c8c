"""The hand-written prompts (assets/user_prompts.json, issue 30): at least 16, of the six kinds a user
types, each ending at a line's end as training text goes on, none copied from the corpus's sources (the
standard library and the pinned packages installed here); and greedy DDTree on them equals
autoregressive decoding with the shipped kimi-nano pair."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH, user_prompts

KINDS = {"function from docstring", "class method", "import block", "loop", "test function", "CLI main"}


def test_prompts_cover_the_kinds_and_end_as_training_text_does():
    prompts = user_prompts()
    assert len(prompts) >= 16 and {p["kind"] for p in prompts} == KINDS
    assert len({p["text"] for p in prompts}) == len(prompts)
    for p in prompts:
        assert p["text"].strip() and not p["text"].endswith(("\n", " "))


def _corpus_texts():
    """(path, text) of the shipped corpus's sources on this machine: the standard library and each
    pinned package that is installed (kdtree-engine train data --packages pinned)."""
    from kdtree_engine.train.corpus_sources import PINNED_PACKAGES, package_source, stdlib_source

    _, files = stdlib_source(Path(sysconfig.get_paths()["stdlib"]))
    yield from ((f.rel, f.text) for f in files)
    for name in PINNED_PACKAGES:
        try:
            _, files = package_source(name, None)
        except ValueError:  # not installed here
            continue
        yield from ((f.rel, f.text) for f in files)


def test_no_prompt_is_in_the_corpus_sources():
    texts = [p["text"] for p in user_prompts()]
    seen = 0
    for where, source in _corpus_texts():
        seen += 1
        assert not any(t in source for t in texts), where
    assert seen > 1000


def test_shipped_pair_on_the_hand_written_prompts_meets_issue_30():
    """Issue 30's bar, as scripts/acceptance_user_prompts.py measures it (CPU float32, greedy, budget 32,
    64 new tokens, one batch): DDTree accepts >= 4.0 tokens per round and >= 1.3x the DFlash chain,
    every output equal to autoregressive decoding (docs/kimi-nano.md has the shipped pair's figures)."""
    from kdtree_engine.drafter import load_drafter
    from kdtree_engine.engine import GenerationConfig, generate, load_tokenizer
    from kdtree_engine.model import load_model

    target = load_model(KIMI_NANO, dtype=torch.float32, device=torch.device("cpu"))
    drafter = load_drafter(KIMI_NANO_DFLASH, dtype=torch.float32, device=torch.device("cpu"))
    tokenizer = load_tokenizer(KIMI_NANO)
    ids = [tokenizer.encode(p["text"]) for p in user_prompts()]
    base = generate(target, None, ids, GenerationConfig(method="autoregressive", max_new_tokens=64))
    tree = generate(target, drafter, ids, GenerationConfig(method="ddtree", budget=32, max_new_tokens=64))
    chain = generate(target, drafter, ids, GenerationConfig(method="dflash", max_new_tokens=64))
    assert tree.tokens == base.tokens and chain.tokens == base.tokens
    assert tree.stats.mean_accept_len >= 4.0
    assert tree.stats.mean_accept_len >= 1.3 * chain.stats.mean_accept_len
