"""Training a DFlash drafter for a target model on the target's own predictions (our recipe: no
official DFlash training code is published): `kdtree-engine train drafter`.

The stages, one module each:
- drafter_config: DrafterTrainConfig, the run's settings, checked when made;
- drafter_pool: the pool the drafter trains on, target continuations of seeded windows of the corpus
  with the target features the engine would hand the drafter;
- drafter_objective: the parallel training forward over many blocks and the position-weighted loss;
- drafter_step: batches of blocks from a pool, one optimizer step, the held-out metrics;
- drafter_checkpoint: the run's state, its checkpoints and its resume;
- this module: the run (inputs, drafter, optimizer, pools, the step loop, the schedule) and the command.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kdtree_engine.drafter import DFlashConfig, DFlashDrafter, build_target_layer_ids
from kdtree_engine.train.data import load_tokens, read_manifest
from kdtree_engine.train.drafter_checkpoint import STATE_FILE, DrafterRun, checkpoint, restore
from kdtree_engine.train.drafter_config import DrafterTrainConfig, require
from kdtree_engine.train.drafter_pool import Pool, build_pool
from kdtree_engine.train.drafter_step import (
    HeldoutMetrics,
    anchor_range,
    evaluate,
    random_batch,
    sample_anchors,
    train_step,
)
from kdtree_engine.train.schedule import warmup_cosine

__all__ = [
    "DrafterTrainConfig",
    "add_arguments",
    "check_inputs",
    "learning_rate",
    "main",
    "new_drafter",
    "train_drafter",
]

MANIFEST_KEYS = ("eos_token_id", "mask_token_id", "vocab_size")


def learning_rate(cfg: DrafterTrainConfig, step: int, seconds: float = 0.0) -> float:
    """The lr of optimizer step `step` (0-based): linear warmup over cfg.warmup_steps, then cosine from
    cfg.lr to min_lr_ratio * cfg.lr over the rest of the budget: the steps after warmup up to
    max_steps, or the fraction of `minutes` spent (`seconds` of training), whichever is further."""
    progress = 0.0
    if cfg.max_steps is not None:
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    if cfg.minutes is not None:
        progress = max(progress, seconds / (60.0 * cfg.minutes))
    return warmup_cosine(cfg.lr, step, cfg.warmup_steps, progress, cfg.min_lr_ratio)


# ------------------------------------------------------------------------------------------ the inputs


def _read_manifest(data: Path) -> dict:
    """manifest.json of the data folder; ValueError naming the field when a needed key is missing."""
    path = data / "manifest.json"
    try:
        manifest = read_manifest(data)
    except (ValueError, OSError) as exc:  # missing, or broken JSON (json's error is a ValueError)
        raise ValueError(f"DrafterTrainConfig.data: cannot read {path} ({exc})") from None
    missing = [k for k in MANIFEST_KEYS if not isinstance(manifest.get(k), int)]
    require(not missing, "data", f"{path} has no integer {missing}")
    return manifest


def check_inputs(cfg: DrafterTrainConfig) -> dict:
    """The file-system checks (before anything is loaded); returns the manifest."""
    data, target = Path(cfg.data), Path(cfg.target)
    require(data.is_dir(), "data", f"{data} is not a folder")
    for name in ("train.bin", "heldout.bin"):
        size = (data / name).stat().st_size if (data / name).is_file() else 0
        require(size >= 2 * cfg.prompt_len, "data", f"{data / name} is missing or shorter than prompt_len")
    require((target / "config.json").is_file(), "target", f"no config.json in {target}")
    if cfg.resume:
        require((Path(cfg.out) / STATE_FILE).is_file(), "resume", f"no {STATE_FILE} in {cfg.out}")
    require(cfg.device != "cuda" or torch.cuda.is_available(), "device", "cuda is not available")
    return _read_manifest(data)


def new_drafter(cfg: DrafterTrainConfig, target_config, mask_token_id: int) -> DFlashDrafter:
    """A freshly initialized float32 drafter of cfg's shape for a target of `target_config` (hidden and
    vocabulary sizes, layer count); ValueError naming the field for ids outside the target."""
    n = int(target_config.num_hidden_layers)
    ids = cfg.target_layer_ids or build_target_layer_ids(n, cfg.num_hidden_layers)
    require(max(ids) < n, "target_layer_ids", f"{ids} outside the target's {n} layers")
    vocab = int(target_config.vocab_size)
    require(0 <= mask_token_id < vocab, "data", f"mask_token_id {mask_token_id} outside vocab {vocab}")
    config = DFlashConfig(
        vocab_size=vocab,
        hidden_size=int(target_config.hidden_size),
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        block_size=cfg.block_size,
        target_layer_ids=tuple(ids),
        mask_token_id=mask_token_id,
        num_target_layers=n,
        rms_norm_eps=float(target_config.rms_norm_eps),
        max_position_embeddings=int(target_config.max_position_embeddings),
    )
    return DFlashDrafter(config).float()


# --------------------------------------------------------------------------------------------- the run


def _optimizer(drafter: DFlashDrafter, cfg: DrafterTrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on the matrices only (not on the norm weights)."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _new_run(cfg: DrafterTrainConfig, manifest: dict) -> DrafterRun:
    """The target (frozen; bfloat16 on CUDA) and a fresh drafter with its optimizer, on cfg.device."""
    device = torch.device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from kdtree_engine.model import load_model

    target = load_model(cfg.target, dtype=dtype, device=device).requires_grad_(False)
    drafter = new_drafter(cfg, target.config, int(manifest["mask_token_id"])).to(device)
    return DrafterRun(
        cfg=cfg,
        drafter=drafter,
        target=target,
        optimizer=_optimizer(drafter, cfg),
        gen=torch.Generator().manual_seed(cfg.seed),
        pool_seed=cfg.seed,
    )


@dataclass
class _Pools:
    train: Pool
    heldout: Pool
    heldout_anchors: torch.Tensor  # [N, A] fixed, so evaluations compare


def _build_pools(run: DrafterRun, data: Path) -> _Pools:
    """The train and held-out pools (seeds pool_seed and pool_seed + 1) and the held-out anchors (seed
    pool_seed + 2); their sizes and build time go to the log."""
    cfg, layers = run.cfg, run.drafter.target_layer_ids
    t0 = time.monotonic()
    train = build_pool(run.target, load_tokens(data, "train"), cfg.pool_spec(), layers, run.pool_seed)
    held_spec = cfg.pool_spec(cfg.heldout_sequences)
    heldout = build_pool(run.target, load_tokens(data, "heldout"), held_spec, layers, run.pool_seed + 1)
    lo, hi = anchor_range(heldout, cfg.block_size)
    gen = torch.Generator().manual_seed(run.pool_seed + 2)
    anchors = sample_anchors(len(heldout), cfg.anchors_per_seq, lo, hi, gen).to(heldout.tokens.device)
    run.log["pool"] = {
        "seed": run.pool_seed,
        "sequences": len(train),
        "heldout_sequences": len(heldout),
        "seq_len": train.seq_len,
        "seconds": round(time.monotonic() - t0, 3),
    }
    return _Pools(train, heldout, anchors)


def _evaluate(run: DrafterRun, pools: _Pools) -> HeldoutMetrics:
    """The held-out metrics (in eval mode), logged at the current step."""
    run.drafter.eval()
    m = evaluate(
        run.drafter, run.target, pools.heldout, pools.heldout_anchors, run.cfg.gamma, run.cfg.batch_size
    )
    run.drafter.train()
    run.log["heldout"].append(
        {"step": run.step, "loss": m.loss, "acceptance": m.acceptance, "time": round(run.seconds, 3)}
    )
    return m


def _report(run: DrafterRun, m: HeldoutMetrics) -> str:
    return f"step {run.step}: held-out loss {m.loss:.4f}, chain acceptance {m.acceptance:.3f}"


def _optimizer_step(run: DrafterRun, pools: _Pools) -> tuple[float, float]:
    """One step on a random batch at the scheduled lr; returns (loss, lr)."""
    cfg = run.cfg
    lr = learning_rate(cfg, run.step, run.seconds)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    batch = random_batch(pools.train, cfg.batch_size, cfg.anchors_per_seq, cfg.block_size, run.gen)
    loss = float(train_step(run.drafter, run.target, batch, run.optimizer, cfg.gamma, cfg.grad_clip))
    run.step += 1
    return loss, lr


def _train(run: DrafterRun, pools: _Pools) -> None:
    """The step loop: stops at the step or time budget; evaluates every eval_every steps and
    checkpoints every checkpoint_every_s (both left to the end when the budget is spent)."""
    from tqdm import tqdm

    cfg = run.cfg
    positions = cfg.batch_size * cfg.anchors_per_seq * run.drafter.config.draft_len
    bar = tqdm(total=cfg.max_steps, initial=run.step, desc="train drafter", dynamic_ncols=True)
    start, start_seconds, start_step = time.monotonic(), run.seconds, run.step
    last_checkpoint = start
    run.drafter.train()
    while not run.done():
        loss, lr = _optimizer_step(run, pools)
        now = time.monotonic()
        run.seconds = start_seconds + now - start
        run.log["steps"].append({"step": run.step, "loss": loss, "lr": lr, "time": round(run.seconds, 3)})
        speed = positions * (run.step - start_step) / max(now - start, 1e-9)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{speed:.0f}")
        if run.step % cfg.eval_every == 0 and not run.done():
            bar.write(_report(run, _evaluate(run, pools)))
        if now - last_checkpoint >= cfg.checkpoint_every_s and not run.done():
            checkpoint(run)
            last_checkpoint = time.monotonic()
    bar.close()


def train_drafter(cfg: DrafterTrainConfig) -> Path:
    """Trains a DFlash drafter for cfg.target (see drafter_pool and drafter_objective) and returns
    cfg.out, which then holds the drafter (load_drafter), trainer_state.pt, train_log.json and loss.png.
    With cfg.resume the run saved in cfg.out continues (same pool, optimizer and RNG states) up to cfg's
    budget."""
    manifest = check_inputs(cfg)
    _seed_everything(cfg.seed)
    run = _new_run(cfg, manifest)
    if cfg.resume:
        restore(run)
    pools = _build_pools(run, Path(cfg.data))
    _train(run, pools)
    print(_report(run, _evaluate(run, pools)))
    checkpoint(run)
    return run.out


# ----------------------------------------------------------------------------------------- the command

HELP = {
    "target": "target model folder (kdtree-engine train target)",
    "data": "prepared corpus folder (kdtree-engine train data)",
    "out": "output drafter folder; checkpoints, train_log.json and loss.png are written there",
    "minutes": "wall-clock training budget (all resumed runs together); it stops with a checkpoint",
    "max_steps": "optimizer steps (the cosine schedule's length)",
    "batch_size": "pooled sequences per step",
    "anchors_per_seq": "blocks trained per sequence",
    "gamma": "loss weight of block position k: exp(-(k - 1) / gamma)",
    "pool_sequences": "target continuations in the training pool",
    "sampled_fraction": "fraction of the pool sampled at temperature 1 (the rest greedy)",
    "pool_batch": "rows per target forward while building the pool",
    "eval_every": "held-out evaluation every N steps",
    "resume": "continue from the checkpoint in --out",
    "device": "cuda or cpu (default: cuda when available)",
}


def add_arguments(parser) -> None:
    """The `kdtree-engine train drafter` options: one per scalar field of DrafterTrainConfig."""
    from kdtree_engine.train.options import add_config_arguments

    add_config_arguments(parser, DrafterTrainConfig, HELP)


def main(args) -> int:
    from kdtree_engine.train.options import config_from_args

    out = train_drafter(config_from_args(DrafterTrainConfig, args))
    print(f"DFlash drafter written to {out}")
    return 0
