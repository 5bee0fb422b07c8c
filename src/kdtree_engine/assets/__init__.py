"""The shipped default models: kimi-nano (a trained Kimi-K2-architecture target, ~18M parameters) and
its trained DFlash drafter, as Hugging Face-style folders read by the same loaders as any checkpoint.
`train/` holds the commands that reproduce them; docs/kimi-nano.md how they were trained. Load them with
`kdtree_engine.model.load_model(KIMI_NANO)`, `kdtree_engine.drafter.load_drafter(KIMI_NANO_DFLASH)` and
`kdtree_engine.engine.load_tokenizer(KIMI_NANO)`."""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
KIMI_NANO = ASSETS / "kimi-nano"
KIMI_NANO_DFLASH = ASSETS / "kimi-nano-dflash"


def heldout_prompts(model_dir: Path = KIMI_NANO) -> list[dict]:
    """The code-completion prompts cut from held-out files of the corpus: [{"source", "text"}]. Each ends
    with a `def` line before its newline, as training text goes on (the BPE merges a newline with the
    next line's indentation): the model writes the body. A prompt ending in a bare newline is unlike
    any training text, and the model then skips the body."""
    path = Path(model_dir) / "heldout_prompts.json"
    if not path.is_file():
        raise ValueError(f"prompts: {path} is missing")
    return json.loads(path.read_text())["prompts"]


def user_prompts() -> list[dict]:
    """Hand-written code prompts in no corpus, of the kinds a user types (a function from its
    docstring, a class method, an import block, a loop, a test function, a CLI main): [{"kind",
    "text"}]. Each ends at the end of a line without its newline, as training text goes on."""
    return json.loads((ASSETS / "user_prompts.json").read_text())["prompts"]
