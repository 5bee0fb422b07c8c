"""A drafter training run's state, its checkpoints in the output folder and its resume.

A checkpoint is the drafter in the published DFlash layout (save_drafter / load_drafter),
trainer_state.pt (step, training time, pool seed, optimizer and RNG states), train_log.json (the config,
the pool, every step's loss and lr, the held-out metrics) and loss.png. Resuming restores all of them,
so a resumed run continues exactly as the run that never stopped.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kdtree_engine.drafter import DFlashDrafter, load_drafter, save_drafter
from kdtree_engine.train.drafter_config import DrafterTrainConfig
from kdtree_engine.train.schedule import pyplot

__all__ = ["LOG_FILE", "PLOT_FILE", "STATE_FILE", "DrafterRun", "checkpoint", "plot_losses", "restore"]

STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.json"
PLOT_FILE = "loss.png"


@dataclass
class DrafterRun:
    """What a run carries between steps and checkpoints."""

    cfg: DrafterTrainConfig
    drafter: DFlashDrafter
    target: object
    optimizer: torch.optim.AdamW
    gen: torch.Generator  # batch rows and anchors (CPU)
    pool_seed: int
    step: int = 0
    seconds: float = 0.0  # training wall time, all runs together
    log: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.log:
            self.log = _new_log(self.cfg, self.drafter)

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    def done(self) -> bool:
        """The step or the time budget is spent."""
        cfg = self.cfg
        by_steps = cfg.max_steps is not None and self.step >= cfg.max_steps
        by_time = cfg.minutes is not None and self.seconds >= 60.0 * cfg.minutes
        return by_steps or by_time


def _new_log(cfg: DrafterTrainConfig, drafter: DFlashDrafter) -> dict:
    """The train_log.json of a new run: its config and drafter, no pool, steps or evaluations yet."""
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        "drafter": drafter.config.to_hf_dict(),
        "pool": {},
        "steps": [],
        "heldout": [],
    }


def _save_state(run: DrafterRun) -> None:
    """trainer_state.pt, replaced atomically."""
    state = {
        "step": run.step,
        "seconds": run.seconds,
        "pool_seed": run.pool_seed,
        "optimizer": run.optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "batch_rng": run.gen.get_state(),
        "drafter": run.drafter.config.to_hf_dict(),
    }
    tmp = run.out / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, run.out / STATE_FILE)


def checkpoint(run: DrafterRun) -> None:
    """The drafter (published layout), trainer_state.pt, train_log.json and loss.png into cfg.out."""
    run.out.mkdir(parents=True, exist_ok=True)
    save_drafter(run.drafter, run.out)
    _save_state(run)
    (run.out / LOG_FILE).write_text(json.dumps(run.log, indent=1))
    plot_losses(run.log, run.out / PLOT_FILE)


def _restore_weights(run: DrafterRun, state: dict) -> None:
    """The saved drafter's weights and the optimizer state; ValueError when the saved drafter has
    another shape or target."""
    if state["drafter"] != run.drafter.config.to_hf_dict():
        raise ValueError(f"DrafterTrainConfig.resume: the drafter in {run.out} has another shape or target")
    saved = load_drafter(run.out, dtype=torch.float32, device=run.drafter.fc.weight.device)
    run.drafter.load_state_dict(saved.state_dict())
    run.optimizer.load_state_dict(state["optimizer"])


def _restore_rngs(run: DrafterRun, state: dict) -> None:
    """The torch (and CUDA) RNG states and the batch generator's."""
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    run.gen.set_state(state["batch_rng"])


def _restore_log(run: DrafterRun) -> None:
    """The saved log's pool and its records up to the saved step (a later, unsaved part is dropped)."""
    if not (run.out / LOG_FILE).is_file():
        return
    log = json.loads((run.out / LOG_FILE).read_text())
    kept = {key: [r for r in log[key] if r["step"] <= run.step] for key in ("steps", "heldout")}
    run.log.update(**kept, pool=log.get("pool", {}))


def restore(run: DrafterRun) -> None:
    """Continues the run saved in cfg.out: weights, optimizer, step, time, RNG states, log, pool seed."""
    state = torch.load(run.out / STATE_FILE, map_location="cpu", weights_only=True)
    _restore_weights(run, state)
    run.step, run.seconds, run.pool_seed = (
        int(state["step"]),
        float(state["seconds"]),
        int(state["pool_seed"]),
    )
    _restore_rngs(run, state)
    _restore_log(run)


def plot_losses(log: dict, path: Path) -> None:
    """loss.png: training loss per step, held-out loss and chain acceptance (skipped without
    matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    fig, (ax, acc) = plt.subplots(1, 2, figsize=(10, 4))
    steps = log["steps"]
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8, label="train")
    held = log["heldout"]
    ax.plot([r["step"] for r in held], [r["loss"] for r in held], "o-", label="held-out")
    ax.set(xlabel="step", ylabel="weighted cross-entropy", title="DFlash drafter loss")
    ax.legend()
    acc.plot([r["step"] for r in held], [r["acceptance"] for r in held], "o-")
    acc.set(xlabel="step", ylabel="tokens per round", title="held-out chain acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
