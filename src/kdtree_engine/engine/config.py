"""GenerationConfig: everything that decides what generate() produces, validated once, at construction.

Checks that need the models (a drafter for the method, token ids inside the vocabulary, prompts inside
the context) happen in generate(). Every failure is a ValueError that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdtree_engine.engine.budget import AUTO_BUCKETS
from kdtree_engine.engine.checks import is_int
from kdtree_engine.engine.sampling import SamplingParams
from kdtree_engine.impl import check_impl

METHODS = ("autoregressive", "dflash", "ddtree")
# A budget past this is no request any implementation could serve: one request's ancestor mask alone
# would take N^2 = 2^40 bytes (1 TiB). generate() checks the rest before it allocates: what the tree
# ops build (tree.validate.check_budget, 4096 nodes today) and the memory.
MAX_BUDGET = 2**20


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """How to generate.

    max_new_tokens: new tokens per request at most (a request also stops after a stop token or a stop
        string and at the target's context length).
    method: "autoregressive" (no drafter), "dflash" (one chain of the drafter's L = block_size - 1
        positions) or "ddtree" (a best-first tree of `budget` nodes).
    budget: DDTree nodes per round, root not counted, at most MAX_BUDGET; None means L. 0 verifies the
        root only (one token per round). "auto": each round picks among engine.budget.auto_buckets
        (AUTO_BUCKETS, 0 an autoregressive step, and the drafter's DFlash chain) the budget with the
        most expected tokens per second. Ignored by
        "autoregressive" and "dflash".
    sampling: temperature 0 is greedy; otherwise the target's token at every node is sampled (tempered,
        top-k, top-p).
    seed: key of the sampled mode's counter-based noise (any int >= -2**63, taken mod 2**64), so a run
        is reproducible.
    stop_tokens: token ids that end a request (the stop token is kept in the output); any iterable of
        ints, stored as a tuple (for a checkpoint, typically its eos_token_id).
    stop_strings: texts that end a request: it stops at the token whose text completes one of them
        (that token is kept in the output; the text after it is never generated). generate() then needs
        a `tokenizer` to read the text (as transformers' stop_strings, vLLM's SamplingParams.stop).
    impl: "ref", "triton", "hopper" or None (the fastest that applies), passed unchanged to the target
        forward and to the tree ops (see kdtree_engine.impl).
    cuda_graphs: capture each stage of a decoding round in a CUDA graph after the first round and
        replay it; None (default) does so on CUDA with a kernel impl, False runs every round eagerly
        (same tokens), True requires a CUDA target and a kernel impl.
    row_invariant: the target computes every token's row with an order that does not depend on the
        rest of its forward (the forward's `row_invariant`; kernel impls only, generate() refuses it on
        the reference ops): greedy DDTree and DFlash then
        give the tokens of greedy autoregressive decoding bit for bit in any dtype, and a request the
        tokens it gets alone. Off by default until its cost is measured (issue 32).
    """

    max_new_tokens: int = 64
    method: str = "ddtree"
    budget: int | str | None = 32
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    impl: str | None = None
    cuda_graphs: bool | None = None
    row_invariant: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.method!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected an int >= 0, got {self.max_new_tokens!r}")
        auto = self.budget == "auto"
        fixed = is_int(self.budget) and 0 <= self.budget <= MAX_BUDGET
        if self.budget is not None and not auto and not fixed:
            raise ValueError(
                f"budget: expected None, 'auto' or an int in [0, {MAX_BUDGET}] for method "
                f"{self.method!r}, got {self.budget!r}"
            )
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling: expected a SamplingParams, got {type(self.sampling).__name__}")
        if not is_int(self.seed) or self.seed < -(2**63):
            raise ValueError(f"seed: expected an int >= -2**63, got {self.seed!r}")
        try:
            stops = tuple(self.stop_tokens)
        except TypeError:
            raise ValueError(f"stop_tokens: expected token ids, got {self.stop_tokens!r}") from None
        if not all(is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_tokens: expected ints >= 0, got {self.stop_tokens!r}")
        strings = _stop_strings(self.stop_strings)
        check_impl(self.impl)
        if self.cuda_graphs not in (None, True, False):
            raise ValueError(f"cuda_graphs: expected None, True or False, got {self.cuda_graphs!r}")
        if not isinstance(self.row_invariant, bool):
            raise ValueError(f"row_invariant: expected True or False, got {self.row_invariant!r}")
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "budget", self.budget if self.budget is None or auto else int(self.budget))
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in stops))
        object.__setattr__(self, "stop_strings", strings)

    @property
    def auto_budget(self) -> bool:
        """Whether each round picks its budget (method "ddtree", budget "auto"; engine.budget)."""
        return self.method == "ddtree" and self.budget == "auto"

    def tree_budget(self, block_size: int) -> int:
        """Nodes verified per round besides the root, for a drafter of `block_size` (bonus + L drafted
        positions): `budget` (default L) for "ddtree" (with "auto": the largest bucket), L for "dflash",
        0 for "autoregressive"."""
        depth = block_size - 1
        if self.method == "autoregressive":
            return 0
        if self.method == "dflash" or self.budget is None:
            return depth
        if self.auto_budget:
            return max(AUTO_BUCKETS)
        return self.budget


def _stop_strings(value) -> tuple[str, ...]:
    """stop_strings as a tuple of non-empty str; one str alone is refused (it would iterate by
    character), as are empty strings (they would stop every request at once)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"stop_strings: expected a tuple or list of strings, got {value!r}")
    if not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"stop_strings: expected non-empty strings, got {value!r}")
    return tuple(value)


__all__ = ["MAX_BUDGET", "METHODS", "GenerationConfig"]
