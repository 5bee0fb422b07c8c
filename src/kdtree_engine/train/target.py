"""Training kimi-nano, the shipped target: the Kimi-K2 architecture scaled down, trained with transformers'
`DeepseekV3ForCausalLM` (the field's differentiable reference of this architecture) and written with
`save_pretrained`, so the shipped checkpoint reaches our loader exactly as a user's would.

Recipe: next-token cross-entropy on random windows of the packed corpus (`train.data`), AdamW on float32
master weights of a bfloat16 model (float32 throughout on the CPU), linear warm-up then cosine decay.
Routing is kept balanced the way DeepSeek-V3 does it, without an auxiliary loss: after every step each
expert's correction bias (`e_score_correction_bias`, used only to choose experts, not to weight them)
moves by `bias_update` towards balance, up when the expert got fewer than the mean number of tokens and
down when it got more.

A run stops at its time budget (`minutes`) with a checkpoint and resumes from it (`resume=True`). The
schedule length is `steps`; when it is None, the first run times `calibration_steps` steps (after five
warm-up steps) and sets it so that the schedule fills the time budget, and records it for the resumed
runs. `steps` makes a run repeatable on any machine.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kdtree_engine.model.config import ModelConfig
from kdtree_engine.train.data import load_tokens, read_manifest
from kdtree_engine.train.schedule import pyplot, warmup_cosine

SHARD_SIZE = "15MB"  # the shipped shards stay under 16 MB each


@dataclass(frozen=True)
class TargetShape:
    """The sizes of the target that `train target` takes as options; the defaults are the shipped
    kimi-nano's. intermediate_size is the dense first layer's MLP width, moe_intermediate_size each
    routed (and the shared) expert's; n_routed_experts is a multiple of the 4 expert groups, at least 2
    per group. The head dimensions, the routing groups and the rope stay kimi_nano_config's."""

    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    intermediate_size: int = 768
    moe_intermediate_size: int = 128
    n_routed_experts: int = 16
    num_experts_per_tok: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 64

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise ValueError(f"{name}: expected >= 1, got {value}")


def kimi_nano_config(vocab_size: int, eos_token_id: int, **overrides) -> ModelConfig:
    """Kimi-K2's architecture at ~18M parameters: MLA with a q low-rank and the latent cache, yarn rope,
    sigmoid-routed MoE with group-limited routing (4 groups, 2 chosen), a shared expert, a dense first
    layer. The sizes are TargetShape's defaults; `overrides` changes any ModelConfig field."""
    fields = dict(
        vocab_size=vocab_size,
        **asdict(TargetShape()),
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        rope_type="yarn",
        rope_factor=4.0,
        rope_original_max_position_embeddings=512,
        rope_beta_fast=1.0,
        rope_beta_slow=1.0,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
        max_position_embeddings=2048,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@dataclass(frozen=True)
class TargetTrainConfig:
    """`kdtree-engine train target`. shape: the target's sizes (options of their own, e.g.
    --hidden-size); model_overrides: any other ModelConfig fields changed from kimi_nano_config, applied
    after the shape (tests use a tiny model)."""

    data: str = "data/kimi-nano"
    out: str = "out/kimi-nano"
    seed: int = 0
    minutes: float = 6.0
    steps: int | None = None
    calibration_steps: int = 20
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update: float = 1e-3
    eval_every: int = 250
    eval_windows: int = 64
    checkpoint_every_s: float = 120.0
    resume: bool = False
    device: str | None = None  # default: cuda when available
    shape: TargetShape = TargetShape()
    model_overrides: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        positive = ("batch_size", "seq_len", "calibration_steps", "eval_every", "eval_windows")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps: expected >= 1, got {self.steps}")
        if not self.minutes > 0:
            raise ValueError(f"minutes: expected > 0, got {self.minutes}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        self.model_config(vocab_size=2, eos_token_id=0)  # a shape the architecture refuses fails here

    def model_config(self, vocab_size: int, eos_token_id: int) -> ModelConfig:
        """The target's ModelConfig for a corpus of `vocab_size` tokens: kimi_nano_config with the shape
        and then model_overrides applied."""
        fields = {**asdict(self.shape), **dict(self.model_overrides)}
        return kimi_nano_config(vocab_size, eos_token_id, **fields)


def lr_at(step: int, cfg: TargetTrainConfig, total: int) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr down to lr * min_lr_ratio at `total`."""
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return warmup_cosine(cfg.lr, step, cfg.warmup_steps, progress, cfg.min_lr_ratio)


def batch_windows(tokens: np.ndarray, batch: int, length: int, seed: int, step: int) -> torch.Tensor:
    """`batch` random windows of `length` tokens, drawn from a generator seeded by (seed, step) so a
    resumed run sees the same batches."""
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(tokens) - length, size=batch)
    return torch.from_numpy(np.stack([tokens[s : s + length] for s in starts]).astype(np.int64))


def eval_windows(tokens: np.ndarray, count: int, length: int) -> torch.Tensor:
    """`count` evenly spaced windows of the held-out tokens (fixed for every evaluation)."""
    count = max(1, min(count, len(tokens) // length))
    starts = np.linspace(0, len(tokens) - length, count).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s : s + length] for s in starts]).astype(np.int64))


def hf_model(config: ModelConfig, dtype: torch.dtype, device: str):
    """A freshly initialized transformers DeepseekV3ForCausalLM of `config` (grouped expert matmuls on
    CUDA)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_config = DeepseekV3Config(**config.to_hf_dict())
    kwargs = {"experts_implementation": "grouped_mm"} if device == "cuda" else {}
    model = DeepseekV3ForCausalLM._from_config(hf_config, attn_implementation="sdpa", dtype=dtype, **kwargs)
    return model.to(device)


class RouterBalance:
    """Counts the tokens each routed expert receives (forward hooks on the routers, on the device) and,
    after a step, moves each correction bias by `rate` towards balance (DeepSeek-V3's aux-loss-free
    balancing). `imbalance()` is the max/mean load of the last step, worst layer."""

    def __init__(self, model, rate: float) -> None:
        self.rate = rate
        self.gates = [m.mlp.gate for m in model.model.layers if hasattr(m.mlp, "gate")]
        self.loads = [torch.zeros(g.num_experts, device=g.weight.device) for g in self.gates]
        for gate, load in zip(self.gates, self.loads):
            gate.register_forward_hook(self._hook(load))
        self.last_imbalance = torch.zeros((), device=self.loads[0].device) if self.loads else None

    @staticmethod
    def _hook(load: torch.Tensor):
        def count(module, inputs, output) -> None:
            if module.training:
                load.add_(torch.bincount(output[2].reshape(-1), minlength=load.numel()))

        return count

    @torch.no_grad()
    def update(self) -> None:
        worst = []
        for gate, load in zip(self.gates, self.loads):
            mean = load.mean()
            gate.e_score_correction_bias += self.rate * torch.sign(mean - load)
            worst.append(load.max() / mean.clamp_min(1))
            load.zero_()
        if worst:
            self.last_imbalance = torch.stack(worst).max()


class MasterWeights:
    """AdamW on float32 copies of the parameters of a (bfloat16) model; after each step the copies are
    written back to the model."""

    def __init__(self, model, lr: float, weight_decay: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        decay = [m for m, p in zip(self.master, self.params) if p.ndim >= 2]
        no_decay = [m for m, p in zip(self.master, self.params) if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)

    def step(self, lr: float, clip: float) -> torch.Tensor:
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.master, clip)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)
        return norm

    def state_dict(self) -> dict:
        return {"master": [m.detach() for m in self.master], "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for m, p, saved in zip(self.master, self.params, state["master"]):
                m.copy_(saved)
                p.copy_(saved)
        self.opt.load_state_dict(state["opt"])


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch: int, device: str) -> float:
    """Mean next-token cross-entropy over the held-out windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch].to(device)
        total += float(model(input_ids=x, labels=x).loss) * len(x)
        count += len(x)
    model.train()
    return total / count


def write_tokenizer(data: Path, out: Path, manifest: dict) -> None:
    """The corpus tokenizer beside the weights: tokenizer.json plus a tokenizer_config.json naming the
    special tokens, and a generation_config.json with the end-of-text id."""
    shutil.copyfile(data / "tokenizer.json", out / "tokenizer.json")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1) + "\n")
    prompts = data / "heldout_prompts.json"
    if prompts.is_file():
        shutil.copyfile(prompts, out / "heldout_prompts.json")


class TrainLog:
    """Per-step records kept in train_log.json and drawn in loss.png."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.records = json.loads(path.read_text())["records"] if resume and path.is_file() else []

    def add(self, **record) -> None:
        self.records.append(record)

    def save(self, meta: dict) -> None:
        self.path.write_text(json.dumps({"meta": meta, "records": self.records}) + "\n")
        plot_loss(self.records, self.path.with_name("loss.png"))


def plot_loss(records: list[dict], path: Path) -> None:
    """Train and held-out loss against step (skipped without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    held = [(r["step"], r["heldout_loss"]) for r in records if "heldout_loss" in r]
    if train:
        ax.plot(*zip(*train), lw=0.8, label="train")
    if held:
        ax.plot(*zip(*held), marker="o", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class _Run:
    """What a checkpoint holds besides the weights."""

    step: int = 0
    total_steps: int | None = None
    elapsed_s: float = 0.0


# Config keys SGLang's DeepSeek code still reads and transformers 5 no longer writes; their values are
# what the model computes (every layer past the dense ones MoE, sigmoid scores, no-aux-loss top-k).
SGLANG_CONFIG_KEYS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def add_sglang_keys(folder: Path) -> None:
    """Adds SGLANG_CONFIG_KEYS to folder/config.json where missing, so that SGLang loads the checkpoint."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config = {**config, **{k: v for k, v in SGLANG_CONFIG_KEYS.items() if k not in config}}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_checkpoint(model, opt: MasterWeights, run: _Run, cfg: TargetTrainConfig, log: TrainLog) -> None:
    """The weights as a shippable folder (save_pretrained in shards under 16 MB, bfloat16, config.json
    with the keys SGLang reads), plus trainer_state.json (step and schedule) and, for an exact resume on
    the same machine, trainer_state.pt (float32 master weights and optimizer moments; not shipped)."""
    out = Path(cfg.out)
    model.save_pretrained(out, max_shard_size=SHARD_SIZE)
    add_sglang_keys(out)
    (out / "trainer_state.json").write_text(json.dumps(asdict(run)) + "\n")
    torch.save(opt.state_dict(), out / "trainer_state.pt")
    log.save({"config": asdict(cfg), **asdict(run)})


def _restore(model, opt: MasterWeights, out: Path) -> _Run:
    """Continue from out/: the exact optimizer state when trainer_state.pt is there, else the saved
    weights with fresh moments (a checkpoint that travelled without its optimizer state)."""
    from safetensors.torch import load_file

    state_json = out / "trainer_state.json"
    if not state_json.is_file():
        raise ValueError(f"resume: {out} has no trainer_state.json")
    run = _Run(**json.loads(state_json.read_text()))
    if (out / "trainer_state.pt").is_file():
        opt.load_state_dict(torch.load(out / "trainer_state.pt", map_location=opt.master[0].device))
        return run
    loaded = {}
    for f in sorted(out.glob("*.safetensors")):
        loaded.update(load_file(str(f)))
    missing = model.load_state_dict(loaded, strict=False).missing_keys
    if [k for k in missing if "rotary" not in k]:
        raise ValueError(f"resume: {out} lacks weights {missing[:3]}")
    with torch.no_grad():
        for m, p in zip(opt.master, opt.params):
            m.copy_(p)
    return run


def describe(model, config: ModelConfig) -> str:
    """The model's parameter count and shape in one line (printed when a run starts)."""
    count = sum(p.numel() for p in model.parameters())
    return (
        f"{count:,} parameters: hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads, q/kv ranks {config.q_lora_rank}/{config.kv_lora_rank}, "
        f"dense MLP {config.intermediate_size}, {config.n_routed_experts} experts of width "
        f"{config.moe_intermediate_size} (top {config.num_experts_per_tok})"
    )


def train_target(cfg: TargetTrainConfig) -> Path:
    """Trains (or resumes) kimi-nano; returns the output folder (a Hugging Face model folder)."""
    from tqdm import tqdm

    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    data, out = Path(cfg.data), Path(cfg.out)
    manifest = read_manifest(data)
    train_tokens, held_tokens = load_tokens(data, "train"), load_tokens(data, "heldout")
    config = cfg.model_config(manifest["vocab_size"], manifest["eos_token_id"])
    torch.manual_seed(cfg.seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = hf_model(config, dtype, device)
    print(f"target {describe(model, config)}", flush=True)
    model.train()
    balance = RouterBalance(model, cfg.bias_update)
    opt = MasterWeights(model, cfg.lr, cfg.weight_decay)
    out.mkdir(parents=True, exist_ok=True)
    run = _restore(model, opt, out) if cfg.resume else _Run(total_steps=cfg.steps)
    run.total_steps = cfg.steps or run.total_steps  # --steps lengthens (or fixes) a resumed schedule
    log = TrainLog(out / "train_log.json", cfg.resume)
    write_tokenizer(data, out, manifest)
    held = eval_windows(held_tokens, cfg.eval_windows, cfg.seq_len)
    budget_s, start = cfg.minutes * 60, time.perf_counter()
    last_ckpt = start
    bar = tqdm(total=run.total_steps, initial=run.step, desc="train target", dynamic_ncols=True)
    while run.total_steps is None or run.step < run.total_steps:
        x = batch_windows(train_tokens, cfg.batch_size, cfg.seq_len, cfg.seed, run.step).to(device)
        total = run.total_steps or 10**9
        lr = lr_at(run.step, cfg, total)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        grad_norm = opt.step(lr, cfg.grad_clip)
        balance.update()
        run.step += 1
        now = time.perf_counter()
        if run.total_steps is None and run.step == 5:
            timed_from = now  # the first steps include one-time start-up costs
        if run.total_steps is None and run.step == cfg.calibration_steps + 5:
            per_step = (now - timed_from) / cfg.calibration_steps
            run.total_steps = max(run.step + 1, int(budget_s * 0.97 / per_step))
            bar.total = run.total_steps
        if run.step % 10 == 0 or run.step == run.total_steps:
            record = dict(step=run.step, loss=float(loss.detach()), lr=lr, grad_norm=float(grad_norm))
            record.update(imbalance=float(balance.last_imbalance), time_s=run.elapsed_s + now - start)
            if run.step % cfg.eval_every == 0 or run.step == run.total_steps:
                record["heldout_loss"] = heldout_loss(model, held, cfg.batch_size, device)
            log.add(**record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}", imb=f"{record['imbalance']:.2f}")
        bar.update(1)
        if now - start > budget_s or now - last_ckpt > cfg.checkpoint_every_s:
            run_elapsed = run.elapsed_s + now - start
            save_checkpoint(model, opt, _Run(run.step, run.total_steps, run_elapsed), cfg, log)
            last_ckpt = now
            if now - start > budget_s:
                break
    bar.close()
    run.elapsed_s += time.perf_counter() - start
    if not log.records or "heldout_loss" not in log.records[-1]:
        log.add(step=run.step, heldout_loss=heldout_loss(model, held, cfg.batch_size, device))
    save_checkpoint(model, opt, run, cfg, log)
    return out


HELP = {
    "data": "prepared corpus folder (kdtree-engine train data)",
    "out": "output model folder; checkpoints are written there",
    "minutes": "wall-clock budget of this run; it stops with a checkpoint",
    "steps": "schedule length; default: timed from the first steps to fill --minutes",
    "resume": "continue from the checkpoint in --out",
    "device": "cuda or cpu (default: cuda when available)",
    "hidden_size": "model width (the drafter's too)",
    "num_hidden_layers": "decoder layers, the first dense, the others MoE",
    "num_attention_heads": "MLA heads (head sizes fixed: q/k 32 + 16 rope, v 32)",
    "intermediate_size": "MLP width of the dense first layer",
    "moe_intermediate_size": "width of each routed expert and of the shared expert",
    "n_routed_experts": "routed experts per MoE layer: a multiple of the 4 groups, >= 8",
    "num_experts_per_tok": "routed experts per token, chosen within 2 of the 4 groups",
    "q_lora_rank": "MLA query low rank",
    "kv_lora_rank": "MLA latent cache width (plus the 16 rope values)",
}


def add_arguments(parser) -> None:
    from kdtree_engine.train.options import add_config_arguments

    add_config_arguments(parser, TargetTrainConfig, HELP)


def main(args) -> int:
    from kdtree_engine.train.options import config_from_args

    out = train_target(config_from_args(TargetTrainConfig, args))
    print(f"kimi-nano target written to {out}")
    return 0
