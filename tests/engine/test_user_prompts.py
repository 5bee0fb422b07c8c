"""The hand-written prompts (assets/user_prompts.json, issue 30): at least 16, of the six kinds a user
types, each ending at a line's end as training text goes on, none copied from the standard-library
corpus; and greedy DDTree on them equals autoregressive decoding with the shipped kimi-nano pair."""

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


def test_no_prompt_is_in_the_standard_library_corpus():
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [p["text"] for p in user_prompts()]
    for path in root.rglob("*.py"):
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        assert not any(t in source for t in texts), path


def test_greedy_ddtree_equals_autoregressive_on_the_hand_written_prompts():
    from kdtree_engine.drafter import load_drafter
    from kdtree_engine.engine import GenerationConfig, generate, load_tokenizer
    from kdtree_engine.model import load_model

    target = load_model(KIMI_NANO, dtype=torch.float32, device=torch.device("cpu"))
    drafter = load_drafter(KIMI_NANO_DFLASH, dtype=torch.float32, device=torch.device("cpu"))
    tokenizer = load_tokenizer(KIMI_NANO)
    ids = [tokenizer.encode(p["text"]) for p in user_prompts()]
    base = generate(target, None, ids, GenerationConfig(method="autoregressive", max_new_tokens=24))
    tree = generate(target, drafter, ids, GenerationConfig(method="ddtree", budget=32, max_new_tokens=24))
    assert tree.tokens == base.tokens
    assert tree.stats.mean_accept_len > 1.5  # the pair drafts something on them (3.8 at 64 tokens)
