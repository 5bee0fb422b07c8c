"""What a decoding round costs on Kimi-K2 over 8 GPUs, projected from one GPU's measured share
(`kdtree-engine bench kimi`; the measurements come from bench/kimi.py, this module only adds them up).

Per batch b, prefix p, routing, and n tokens verified per request (all times one GPU's; every GPU does
the same share, the MoE's being its busiest rank's):

    forward(n)  = L (attention(n) + moe(n)) + plan(n) + lm_head(n)
                  + 2 L all_reduce(b n H 2 bytes) + all_gather(b n V 2 bytes)
    draft       = drafter fixed part + D drafter layers + 2 D all_reduce(b block H 2 bytes)
    AR step     = forward(1)                              commits 1 token per request
    DFlash      = draft + forward(block)                  commits tau_chain
    DDTree(B)   = draft + tree(B) + forward(B + 1)        commits tau(B)
    auto        = the best of AR and DDTree(B) over the budgets (what budget "auto" aims at)

with L = 61 target layers (the one dense layer counted as an MoE layer), D = 6 drafter layers, H = 7168,
V = 163840 (the logits gathered for the target's choice), `tree` our whole greedy tree path (top-k of
the draft logits, build, compile, follow) as the worker calls it. Tokens per second per request =
tokens committed per round / round time.

Collectives follow the alpha-beta model `Collectives`: latency + bytes moved per rank / bus bandwidth
(2 (r - 1) / r of the message for an all-reduce, (r - 1) / r for an all-gather). The defaults are
published figures, not measured here; docs/kimi-scale.md names their sources. SGLang's one-shot custom
all-reduce is faster for small messages, so the defaults err on the slow side.

Accepted lengths (`Acceptance`): kimi-nano's own, measured, and the published Kimi-K2.5-DFlash chain
lengths (MT-Bench, Math500, block 8) with DDTree's gain over the chain at each budget taken from
kimi-nano, capped at the block size (sources: docs/kimi-scale.md).

The SGLang port's round (`port_round_us`) is DDTree(B) with its tree path in place of ours and its verify
attention (SGLang's Triton extend kernel with the port's dense mask, and its per-forward mask compile
and metadata) in place of our kernel's: our measured attention share plus L (port kernel - our kernel)
plus the difference of the per-forward work, all from the same run's `bench sglang` points.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kdtree_engine.bench.plot import markdown_table

BUDGETS = (8, 16, 32, 64)


@dataclass(frozen=True)
class Collectives:
    """alpha-beta cost of one collective over `ranks` GPUs (module docstring)."""

    latency_us: float = 15.0
    bus_gbps: float = 460.0
    ranks: int = 8

    def __post_init__(self) -> None:
        if self.latency_us < 0 or self.bus_gbps <= 0 or self.ranks < 1:
            raise ValueError(f"Collectives: expected latency >= 0, bandwidth > 0, ranks >= 1; got {self}")

    def _moved_us(self, nbytes: float, share: float) -> float:
        return share * nbytes / (self.bus_gbps * 1e3)  # GB/s = 1e3 bytes per microsecond

    def all_reduce_us(self, nbytes: float) -> float:
        r = self.ranks
        return 0.0 if r == 1 else self.latency_us + self._moved_us(nbytes, 2 * (r - 1) / r)

    def all_gather_us(self, nbytes: float) -> float:
        r = self.ranks
        return 0.0 if r == 1 else self.latency_us + self._moved_us(nbytes, (r - 1) / r)


@dataclass(frozen=True)
class Acceptance:
    """Tokens committed per round (the bonus token included): the DFlash chain's and DDTree's per
    budget; `source` says where they come from."""

    name: str
    source: str
    dflash: float
    ddtree: dict[int, float] = field(default_factory=dict)


NANO = Acceptance(
    "kimi-nano",
    "measured: kimi-nano and its DFlash drafter, bf16, batch 1, greedy, block 16 (docs/kimi-nano.md)",
    3.95,
    {8: 4.37, 16: 4.85, 32: 5.27, 64: 5.80},
)


def published(name: str, chain: float, block: int = 8) -> Acceptance:
    """The published DFlash chain length `chain`, and DDTree's at each budget as kimi-nano's gain over
    its chain times `chain`, capped at the block size (a tree is at most block - 1 deep)."""
    ddtree = {b: min(float(block), chain * tau / NANO.dflash) for b, tau in NANO.ddtree.items()}
    source = (
        f"published Kimi-K2.5-DFlash chain {chain} (block {block}); DDTree = chain x kimi-nano's "
        "DDTree / DFlash gain per budget, capped at the block"
    )
    return Acceptance(name, source, chain, ddtree)


PROFILES = (published("Kimi-K2.5-DFlash, MT-Bench", 3.7), published("Kimi-K2.5-DFlash, Math500", 5.5), NANO)


@dataclass(frozen=True)
class ModelCounts:
    """The counts the projection multiplies by: target layers, drafter layers, hidden size, vocabulary,
    the drafter's block."""

    layers: int = 61
    draft_layers: int = 6
    hidden: int = 7168
    vocab: int = 163840
    block: int = 8


class Measured:
    """Look-ups into one bench kimi run's rows (bench/kimi.py writes them): each returns microseconds,
    or None where that point was not measured."""

    def __init__(self, results: dict):
        self.rows = results

    def _find(self, section: str, **key) -> dict | None:
        return next(
            (row for row in self.rows.get(section, []) if all(row.get(k) == v for k, v in key.items())), None
        )

    def us(self, section: str, **key) -> float | None:
        row = self._find(section, **key)
        return None if row is None or "us" not in row else float(row["us"])

    def drafter(self, batch: int, prefix: int) -> dict | None:
        return self._find("drafter", batch=batch, prefix=prefix)

    def port(self, batch: int, budget: int, prefix: int) -> dict | None:
        tree = self._find("port_tree", batch=batch, budget=budget)
        attn = next(
            (
                r
                for r in self.rows.get("port_attention", [])
                if (r["batch"], r["t"], r["prefix"]) == (batch, budget + 1, prefix)
            ),
            None,
        )
        return None if tree is None or attn is None else {"tree_us": tree["us"], **attn}


def _sum(*parts: float | None) -> float | None:
    return None if any(p is None for p in parts) else sum(parts)


@dataclass(frozen=True)
class Point:
    """Where a round is projected: batch, prefix and routing."""

    batch: int
    prefix: int
    routing: str


def forward_us(m: Measured, pt: Point, n: int, counts: ModelCounts, comm: Collectives) -> float | None:
    """One target forward of n tokens per request (module docstring)."""
    b, layers = pt.batch, counts.layers
    attn = m.us("attention", batch=b, tokens=n, prefix=pt.prefix)
    moe = m.us("moe", batch=b, tokens=n, routing=pt.routing)
    plan = m.us("plan", batch=b, tokens=n, prefix=pt.prefix)
    head = m.us("lm_head", batch=b, tokens=n)
    if attn is None or moe is None:
        return None
    comms = 2 * layers * comm.all_reduce_us(b * n * counts.hidden * 2) + comm.all_gather_us(
        b * n * counts.vocab * 2
    )
    return _sum(layers * (attn + moe), plan, head, comms)


def draft_us(m: Measured, pt: Point, counts: ModelCounts, comm: Collectives) -> float | None:
    row = m.drafter(pt.batch, pt.prefix)
    if row is None:
        return None
    comms = 2 * counts.draft_layers * comm.all_reduce_us(pt.batch * counts.block * counts.hidden * 2)
    return row["fixed_us"] + counts.draft_layers * row["layer_us"] + comms


@dataclass
class Rounds:
    """Round times (us) at one point: the AR step, the DFlash chain, DDTree per budget, the port's
    DDTree per budget (None where a part was not measured)."""

    ar: float | None
    dflash: float | None
    ddtree: dict[int, float | None]
    port: dict[int, float | None]


def port_round_us(
    m: Measured, pt: Point, budget: int, ours: float | None, counts: ModelCounts
) -> float | None:
    """The port's DDTree round: ours with its tree path and verify attention swapped in (module
    docstring)."""
    p = m.port(pt.batch, budget, pt.prefix)
    tree = m.us("tree", batch=pt.batch, budget=budget)
    if p is None or ours is None or tree is None:
        return None
    kernel = counts.layers * (p["port_kernel_us"] - p["ours_run_us"])
    per_forward = (p["port_step_us"] - p["port_kernel_us"]) - (p["ours_step_us"] - p["ours_run_us"])
    return ours - tree + p["tree_us"] + kernel + per_forward


def rounds(m: Measured, pt: Point, budgets, counts: ModelCounts, comm: Collectives) -> Rounds:
    draft = draft_us(m, pt, counts, comm)
    ddtree, port = {}, {}
    for budget in budgets:
        tree = m.us("tree", batch=pt.batch, budget=budget)
        ddtree[budget] = _sum(draft, tree, forward_us(m, pt, budget + 1, counts, comm))
        port[budget] = port_round_us(m, pt, budget, ddtree[budget], counts)
    dflash = _sum(draft, forward_us(m, pt, counts.block, counts, comm))
    return Rounds(forward_us(m, pt, 1, counts, comm), dflash, ddtree, port)


def tokens_per_s(tokens: float, round_us: float | None) -> float | None:
    return None if round_us is None else tokens / round_us * 1e6


def project(m: Measured, pt: Point, tau: Acceptance, budgets, counts: ModelCounts, comm: Collectives) -> dict:
    """Tokens per second per request at one point under one acceptance profile: "ar", "dflash",
    "ddtree" {budget: ...}, "auto" (the best of AR and the budgets, with its choice), "port" {budget}."""
    r = rounds(m, pt, budgets, counts, comm)
    ddtree = {b: tokens_per_s(tau.ddtree[b], r.ddtree[b]) for b in budgets if b in tau.ddtree}
    port = {b: tokens_per_s(tau.ddtree[b], r.port[b]) for b in budgets if b in tau.ddtree}
    options = {"AR": tokens_per_s(1.0, r.ar), **{f"B{b}": v for b, v in ddtree.items()}}
    known = {k: v for k, v in options.items() if v is not None}
    best = max(known, key=known.get) if known else None
    return {
        "point": pt,
        "ar": options["AR"],
        "dflash": tokens_per_s(tau.dflash, r.dflash),
        "ddtree": ddtree,
        "auto": known.get(best),
        "auto_choice": best,
        "port": port,
        "rounds": r,
    }


def _cell(value: float | None, base: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if base is None else f"{value:.0f} ({value / base:.2f}x)"


def table(projections: list[dict], budgets) -> str:
    """One profile's projections: tokens/s per request and the ratio to autoregressive decoding."""
    heads = ["routing", "prefix", "batch", "AR", "DFlash"] + [f"DDTree {b}" for b in budgets]
    heads += ["auto (choice)"] + [f"port DDTree {b}" for b in budgets]
    body = []
    for p in projections:
        pt, ar = p["point"], p["ar"]
        cells = [pt.routing, pt.prefix, pt.batch, _cell(ar, None), _cell(p["dflash"], ar)]
        cells += [_cell(p["ddtree"].get(b), ar) for b in budgets]
        cells += [f"{_cell(p['auto'], ar)} {p['auto_choice'] or ''}".strip()]
        cells += [_cell(p["port"].get(b), ar) for b in budgets]
        body.append(cells)
    return markdown_table(heads, body)


def report(
    results: dict,
    points: list[Point],
    budgets=BUDGETS,
    counts: ModelCounts = ModelCounts(),
    comm: Collectives = Collectives(),
    profiles=PROFILES,
) -> str:
    """The projection tables, one per acceptance profile, each under its source line."""
    m = Measured(results)
    parts = [
        f"Collectives: {comm.latency_us:g} us + bytes / {comm.bus_gbps:g} GB/s bus bandwidth over "
        f"{comm.ranks} GPUs; {counts.layers} target layers, {counts.draft_layers} drafter layers."
    ]
    for tau in profiles:
        rows = [project(m, pt, tau, budgets, counts, comm) for pt in points]
        parts.append(f"### {tau.name}\n\nAccepted lengths: {tau.source}.\n\n{table(rows, budgets)}")
    return "\n\n".join(parts) + "\n"
