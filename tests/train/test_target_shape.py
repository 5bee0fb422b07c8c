"""The target's sizes as options of `kdtree-engine train target`: the defaults are the shipped kimi-nano,
a bad shape is one line and exit code 2, and a few CPU steps with a small non-default shape, on a tiny
corpus that went through pack and unpack as it does on the way to the device, give a model of that
shape."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from kdtree_engine.assets import KIMI_NANO
from kdtree_engine.cli import build_parser, main
from kdtree_engine.model.config import ModelConfig
from kdtree_engine.train.carry import pack, unpack
from kdtree_engine.train.data import CorpusConfig, prepare_corpus
from kdtree_engine.train.options import config_from_args
from kdtree_engine.train.target import TargetShape, TargetTrainConfig
from tests.train.test_data_target import _fake_stdlib

SMALL = {
    "hidden_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "moe_intermediate_size": 24,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
}


def _options(shape: dict) -> list[str]:
    return [item for name, value in shape.items() for item in ("--" + name.replace("_", "-"), str(value))]


def test_the_default_shape_is_the_shipped_kimi_nano():
    shipped = ModelConfig.from_json(KIMI_NANO / "config.json")
    assert TargetTrainConfig().model_config(shipped.vocab_size, shipped.eos_token_id) == shipped
    assert asdict(TargetShape()) == {name: getattr(shipped, name) for name in asdict(TargetShape())}


def test_the_shape_options_reach_the_config():
    args = build_parser().parse_args(["train", "target", *_options(SMALL)])
    cfg = config_from_args(TargetTrainConfig, args)
    assert cfg.shape == TargetShape(**SMALL)
    model = cfg.model_config(300, 0)
    assert {name: getattr(model, name) for name in SMALL} == SMALL
    default = config_from_args(TargetTrainConfig, build_parser().parse_args(["train", "target"]))
    assert default == TargetTrainConfig()


@pytest.mark.parametrize(
    "options, words",
    [
        (["--hidden-size", "0"], "hidden_size: expected >= 1, got 0"),
        (["--n-routed-experts", "18"], "n_routed_experts=18"),
        (["--n-routed-experts", "4"], "each expert group needs >= 2 experts"),
        (["--num-experts-per-tok", "9"], "num_experts_per_tok=9"),
        (["--kv-lora-rank", "wide"], "invalid int value"),
    ],
)
def test_a_bad_shape_is_one_line_and_exit_code_2(capsys, options, words):
    try:
        rc = main(["train", "target", *options])
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("kdtree-engine train target: ") and words in err, err


def test_a_few_cpu_steps_of_a_small_shape(tmp_path, capsys):
    """The corpus is built, packed and unpacked elsewhere (the device's way), then three steps train a
    model of the SMALL shape given as options; the checkpoint's config.json has that shape."""
    (tmp_path / "stdlib").mkdir()
    stdlib = _fake_stdlib(tmp_path / "stdlib")
    stdlib_corpus = CorpusConfig(out=str(tmp_path / "corpus"), vocab_size=300, heldout_every=3,
                                 num_prompts=2, prompt_lines=3, stdlib=str(stdlib))  # fmt: skip
    prepare_corpus(stdlib_corpus)
    pack(tmp_path / "corpus", tmp_path / "packed", part_size=4096)
    unpack(tmp_path / "packed")
    out = tmp_path / "target"
    argv = ["train", "target", "--data", str(tmp_path / "packed"), "--out", str(out), "--device", "cpu",
            "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1",
            "--eval-every", "3", "--eval-windows", "2", *_options(SMALL)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    shape = "hidden 48, 3 layers, 2 heads, q/kv ranks 16/16, dense MLP 64, 8 experts of width 24 (top 2)"
    assert shape in printed, printed
    config = json.loads((out / "config.json").read_text())
    assert {name: config[name] for name in SMALL} == SMALL
    log = json.loads((out / "train_log.json").read_text())
    assert log["meta"]["step"] == 3 and log["meta"]["config"]["shape"] == SMALL
    assert all(r["loss"] == r["loss"] for r in log["records"] if "loss" in r)  # finite, not NaN
