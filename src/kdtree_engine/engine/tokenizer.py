"""The tokenizer of a checkpoint folder: text <-> token ids for `generate` and its command.

`load_tokenizer(model_dir)` reads the folder's tokenizer files through transformers (AutoTokenizer,
chat templates, tokenizer code shipped with a checkpoint behind `trust_remote_code`) or, when
transformers is not installed, its tokenizer.json through `tokenizers` alone. A folder without
tokenizer files gets the id-only tokenizer: a prompt is space-separated token ids and the text of ids
is the ids joined by spaces. Every failure is a ValueError starting with `tokenizer:` (or the flag it
is about), one line.
"""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HF_EXTRA = 'pip install "kdtree-engine[hf]" (pip install -e ".[hf]" in a checkout)'


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class TokenizerJson:
    """A tokenizer.json read by `tokenizers` alone, with the part of a transformers tokenizer's
    interface that generation uses (no chat template). Used when transformers is not installed."""

    chat_template = None

    def __init__(self, tok) -> None:
        self.tok = tok
        self.all_special_ids = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]

    @classmethod
    def load(cls, path: Path) -> TokenizerJson:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            return cls(RustTokenizer.from_file(str(path)))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception type
            raise ValueError(f"tokenizer: cannot read {path}: {exc}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


def _auto_tokenizer(model_dir: Path, trust_remote_code: bool):
    """transformers' AutoTokenizer for model_dir, every failure one line (ValueError)."""
    from transformers import AutoTokenizer

    try:
        # trust_remote_code is always given: None would make transformers ask on stdin.
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except ModuleNotFoundError as exc:  # e.g. tiktoken or sentencepiece for the tokenizer's own code
        raise ValueError(
            f"tokenizer: the tokenizer in {model_dir} needs the Python module {exc.name!r} (pip install it)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - anything transformers raises is one line here
        if "trust_remote_code" in str(exc) and not trust_remote_code:
            raise ValueError(
                f"tokenizer: the tokenizer in {model_dir} is custom code shipped with the checkpoint; "
                "pass --trust-remote-code to run it"
            ) from None
        raise ValueError(f"tokenizer: cannot load the tokenizer in {model_dir}: {_first_line(exc)}") from None


class Tokenizer:
    """Text <-> token ids: a transformers tokenizer (or tokenizer.json through `tokenizers` when
    transformers is not installed) in `tok`, or None for the id-only tokenizer. `source` is the folder
    it came from (for messages). Anything with `decode(ids, skip_special_tokens=...)` serves
    `generate`'s stop strings and `engine.text`; this class is what `load_tokenizer` returns."""

    def __init__(self, tok=None, source: str = "") -> None:
        self.tok, self.source = tok, source

    @property
    def all_special_ids(self) -> list[int]:
        return list(getattr(self.tok, "all_special_ids", None) or ()) if self.tok is not None else []

    def encode(self, text: str) -> list[int]:
        """The token ids of text (with the special tokens the tokenizer adds, e.g. a BOS token);
        without a tokenizer, text must be token ids separated by spaces."""
        if self.tok is not None:
            return list(self.tok.encode(text))
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            msg = f"--prompt: without a tokenizer a prompt is space-separated token ids, got {text!r}"
            raise ValueError(msg) from None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tok is None:
            return " ".join(map(str, ids))
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. "<|mask|>"); None without a vocabulary (a transformers
        tokenizer may answer its unknown-token id for an entry it lacks)."""
        return None if self.tok is None else self.tok.convert_tokens_to_ids(token)

    def check_chat(self, what: str | None = None) -> None:
        """ValueError naming --chat unless the tokenizer has a chat template; `what` describes a
        tokenizer-less source (e.g. "the demo has no tokenizer")."""
        if self.tok is None:
            where = what or f"{self.source} has no tokenizer files"
            raise ValueError(f"--chat: needs a tokenizer with a chat template, and {where}")
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(
                f"--chat: the tokenizer in {self.source} has no chat template (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja); pass the prompt already formatted"
            )

    def chat(self, text: str) -> list[int]:
        """The chat template applied to one user message, with the generation prompt, as ids (the
        template writes the special tokens, so none are added by the encoding)."""
        messages = [{"role": "user", "content": text}]
        try:
            formatted = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except ImportError as exc:  # transformers renders templates with jinja2
            raise ValueError(f"--chat: applying the chat template needs {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a template that raises (e.g. on a role it rejects)
            raise ValueError(
                f"--chat: the chat template of {self.source} failed: {_first_line(exc)}"
            ) from None
        return list(self.tok.encode(formatted, add_special_tokens=False))


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False) -> Tokenizer:
    """The tokenizer of a checkpoint folder (see the module docstring): transformers' AutoTokenizer when
    transformers is installed, else tokenizer.json through `tokenizers`; the id-only tokenizer when the
    folder has no tokenizer files. trust_remote_code: run tokenizer code shipped in the folder."""
    model_dir = Path(model_dir)
    if not any((model_dir / f).exists() for f in TOKENIZER_FILES):
        return Tokenizer(None, str(model_dir))
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        if (model_dir / "tokenizer.json").is_file() and not trust_remote_code:
            return Tokenizer(TokenizerJson.load(model_dir / "tokenizer.json"), str(model_dir))
        missing = getattr(exc, "name", None) or "transformers"
        raise ValueError(
            f"tokenizer: reading the tokenizer files in {model_dir} needs transformers (cannot import "
            f"{missing!r}); it comes with the [hf] extra: {HF_EXTRA}"
        ) from None
    return Tokenizer(_auto_tokenizer(model_dir, trust_remote_code), str(model_dir))


__all__ = ["TOKENIZER_FILES", "Tokenizer", "TokenizerJson", "load_tokenizer"]
