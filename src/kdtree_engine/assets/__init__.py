"""The shipped default models: kimi-nano (a trained Kimi-K2-architecture target, ~18M parameters) and
its trained DFlash drafter, as Hugging Face-style folders read by the same loaders as any checkpoint.
`train/` holds the commands that reproduce them; docs/kimi-nano.md how they were trained."""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
KIMI_NANO = ASSETS / "kimi-nano"
KIMI_NANO_DFLASH = ASSETS / "kimi-nano-dflash"


def heldout_prompts(model_dir: Path = KIMI_NANO) -> list[dict]:
    """The code-completion prompts cut from held-out files of the corpus: [{"source", "text"}]."""
    path = Path(model_dir) / "heldout_prompts.json"
    if not path.is_file():
        raise ValueError(f"prompts: {path} is missing")
    return json.loads(path.read_text())["prompts"]


def load_tokenizer(model_dir: Path = KIMI_NANO):
    """The model folder's tokenizer.json through `tokenizers` (no transformers needed)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
