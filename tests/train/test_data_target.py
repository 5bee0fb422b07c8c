"""The kimi-nano corpus command and the target training loop, on a tiny corpus and a tiny model (CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kdtree_engine.train.data import CorpusConfig, is_heldout, load_tokens, prepare_corpus, read_manifest
from kdtree_engine.train.target import RouterBalance, TargetTrainConfig, hf_model, kimi_nano_config, lr_at

TINY = (("hidden_size", 32), ("intermediate_size", 48), ("moe_intermediate_size", 16),
        ("num_hidden_layers", 2), ("num_attention_heads", 2), ("q_lora_rank", 16), ("kv_lora_rank", 16),
        ("qk_nope_head_dim", 8), ("qk_rope_head_dim", 8), ("v_head_dim", 8))  # fmt: skip


def _fake_stdlib(root):
    """Twelve small modules, a package, an installed package (excluded) and a non-UTF-8 file (skipped)."""
    for i in range(12):
        body = "".join(f"\n\ndef f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(14))
        (root / f"mod{i}.py").write_text(f'"""Module {i}."""\nimport os{body}')
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("VALUE = 'café'\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "third.py").write_text("THIRD_PARTY = 1\n")
    (root / "latin1.py").write_bytes(b"x = '\xe9'\n")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = _fake_stdlib(tmp_path_factory.mktemp("stdlib"))
    cfg = CorpusConfig(out=str(tmp_path_factory.mktemp("data")), vocab_size=300, heldout_every=3,
                       num_prompts=4, prompt_lines=3, stdlib=str(root))  # fmt: skip
    return cfg, prepare_corpus(cfg)


def test_corpus_round_trips_and_splits_by_file(corpus):
    from tokenizers import Tokenizer

    cfg, out = corpus
    m = read_manifest(out)
    files = m["files"]["train"] + m["files"]["heldout"]
    assert "site-packages/third.py" not in files and "latin1.py" not in files and "pkg/__init__.py" in files
    assert all(is_heldout(f, 3) for f in m["files"]["heldout"]) and m["files"]["heldout"]
    assert not any(is_heldout(f, 3) for f in m["files"]["train"])
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert (m["eos_token_id"], m["mask_token_id"], m["vocab_size"]) == (0, 1, tok.get_vocab_size())
    root = cfg.stdlib
    for split in ("train", "heldout"):
        ids = np.asarray(load_tokens(out, split))
        assert m["tokens"][split] == ids.size and ids[-1] == 0
        docs = np.split(ids, np.flatnonzero(ids == 0) + 1)[:-1]  # each file's ids, then <|endoftext|>
        texts = [open(f"{root}/{f}", encoding="utf-8").read() for f in m["files"][split]]
        assert [tok.decode(d[:-1].tolist()) for d in docs] == texts


def test_prompts_end_on_a_def_line_without_its_newline(corpus):
    _, out = corpus
    prompts = json.loads((out / "heldout_prompts.json").read_text())["prompts"]
    assert len(prompts) == 4
    held = set(read_manifest(out)["files"]["heldout"])
    for p in prompts:
        assert p["source"] in held and p["text"].count("\n") == 2
        assert p["text"].rsplit("\n", 1)[1].startswith("def ") and p["text"].endswith(":")


def test_corpus_is_reproducible(corpus, tmp_path):
    cfg, out = corpus
    again = prepare_corpus(CorpusConfig(**{**cfg.__dict__, "out": str(tmp_path)}))
    for name in ("train.bin", "heldout.bin", "tokenizer.json", "heldout_prompts.json"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"vocab_size": 100}, "vocab_size"),
        ({"heldout_every": 1}, "heldout_every"),
        ({"stdlib": "/nope"}, "stdlib"),
    ],
)
def test_corpus_bad_arguments(kwargs, field, tmp_path):
    with pytest.raises(ValueError, match=field):
        prepare_corpus(CorpusConfig(out=str(tmp_path), **kwargs))


def test_missing_corpus_names_the_command(tmp_path):
    with pytest.raises(ValueError, match="kdtree-engine train data"):
        read_manifest(tmp_path)
    with pytest.raises(ValueError, match="split"):
        load_tokens(tmp_path, "test")


def test_lr_schedule():
    cfg = TargetTrainConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1) and lr_at(9, cfg, 100) == pytest.approx(1.0)
    assert lr_at(10, cfg, 100) == pytest.approx(1.0) and lr_at(100, cfg, 100) == pytest.approx(0.1)
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"steps": 0}, {"minutes": 0}, {"lr": -1.0}])
def test_target_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        TargetTrainConfig(**kwargs)


def test_router_balance_moves_the_bias_towards_the_mean_load():
    torch.manual_seed(0)
    model = hf_model(kimi_nano_config(64, 0, **dict(TINY)), torch.float32, "cpu")
    balance = RouterBalance(model, rate=0.01)
    gate = balance.gates[0]
    model.train()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (2, 16)))
    load = balance.loads[0].clone()
    assert load.sum() == 2 * 16 * gate.top_k  # every token counted k times
    balance.update()
    expected = 0.01 * torch.sign(load.mean() - load)
    assert torch.equal(gate.e_score_correction_bias, expected) and balance.loads[0].sum() == 0
    assert float(balance.last_imbalance) == pytest.approx(float(load.max() / load.mean()))


def test_train_target_writes_a_checkpoint_our_loader_reads_and_resumes(corpus, tmp_path):
    from transformers import DeepseekV3ForCausalLM

    from kdtree_engine.model import load_model
    from kdtree_engine.train.target import train_target

    _, data = corpus
    base = dict(data=str(data), out=str(tmp_path / "m"), batch_size=2, seq_len=32, warmup_steps=2,
                eval_every=3, eval_windows=2, device="cpu", model_overrides=TINY)  # fmt: skip
    out = train_target(TargetTrainConfig(steps=3, **base))
    log = json.loads((out / "train_log.json").read_text())
    assert log["meta"]["step"] == 3 and "heldout_loss" in log["records"][-1]
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "heldout_prompts.json",
        "loss.png",
    ):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())  # the keys SGLang's DeepSeek code reads
    keys = ("moe_layer_freq", "topk_method", "scoring_func")
    assert [config[k] for k in keys] == [1, "noaux_tc", "sigmoid"]
    ours, hf = load_model(out), DeepseekV3ForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(x, ours.new_cache(2, 16)).logits, hf(x).logits, rtol=1e-4, atol=1e-4)
    biases = [layer.mlp.gate.e_score_correction_bias for layer in hf.model.layers[1:]]
    assert any(b.abs().sum() > 0 for b in biases)  # balancing moved them and they were saved
    train_target(TargetTrainConfig(steps=5, resume=True, **base))
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 5
