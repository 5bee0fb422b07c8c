"""`kdtree-engine generate` end to end on the demo models (no download)."""

from __future__ import annotations

import re

import pytest

from kdtree_engine.cli import main
from kdtree_engine.model import greedy_generate


def _run(capsys, *argv):
    rc = main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_demo_compare_matches_autoregressive(capsys):
    rc, out, _ = _run(capsys, "--demo", "--compare", "--max-new-tokens", "40")
    assert rc == 0
    assert "ddtree: target forwards" in out and "dflash: target forwards" in out
    assert out.count("output identical: YES") == 2
    streams = re.findall(r"^--- (\w+).*---\n([\d ]+)\n", out, flags=re.M)
    assert [m for m, _ in streams] == ["ddtree", "dflash", "autoregressive"]
    assert len({s.strip() for _, s in streams}) == 1 and len(streams[0][1].split()) == 40
    forwards = dict(re.findall(r"\[(\w+)\] \d+ new tokens \(batch 1\) in (\d+) target forwards", out))
    assert int(forwards["ddtree"]) < int(forwards["dflash"]) < int(forwards["autoregressive"]) == 40


def test_batch_prompts_random_drafter_and_sampling(capsys):
    args = ["--demo", "--demo-drafter", "random", "--prompt", "1 2 3", "--prompt", "9 8 7 6 5 4"]
    rc, out, _ = _run(capsys, *args, "--method", "dflash", "--max-new-tokens", "8", "--compare")
    assert rc == 0 and "output identical: YES" in out and re.search(r"^\[1\] (\d+ ){7}\d+$", out, flags=re.M)
    sampling = ["--temperature", "0.9", "--top-k", "20"]
    rc, out, _ = _run(capsys, *args, *sampling, "--max-new-tokens", "8", "--compare")
    assert rc == 0 and "sampled" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--demo", "--prompt", "hello world"], "space-separated token ids"),
        (["--demo", "--prompt", ""], "prompt 0 is empty"),
        (["--demo", "--budget", "-2"], "budget"),
        (["--drafter", "/nonexistent"], "--model"),
        (["--demo", "--impl", "cuda"], "impl: expected one of ('ref', 'triton', 'hopper') or None"),
        (["--demo", "--method", "beam"], "method: expected one of"),
        (["--demo", "--top-p", "0"], "top_p"),
        (["--demo", "--stop", "-1"], "stop_tokens"),
    ],
)
def test_errors_exit_2(capsys, argv, message):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and message in err
    assert err.count("\n") == 1  # one line


def test_impl_choices_and_config():
    """--impl takes the implementation vocabulary (default None: the fastest that applies), and the
    arguments become one GenerationConfig."""
    from kdtree_engine.cli import build_parser
    from kdtree_engine.engine import GenerationConfig, SamplingParams
    from kdtree_engine.engine.cli import _config

    parse = build_parser().parse_args
    assert parse(["generate"]).impl is None
    for impl in ("ref", "triton", "hopper"):
        assert parse(["generate", "--impl", impl]).impl == impl
    args = parse(["generate", "--method", "dflash", "--budget", "8", "--temperature", "0.5", "--stop", "3"])
    assert _config(args) == GenerationConfig(
        max_new_tokens=64,
        method="dflash",
        budget=8,
        sampling=SamplingParams(temperature=0.5),
        stop_tokens=(3,),
    )


def test_checkpoint_dirs_with_a_tokenizer(capsys, tmp_path):
    """--model / --drafter load HF-format checkpoints; a tokenizer.json in the model dir is used."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kdtree_engine.drafter import random_drafter, save_drafter, tiny_drafter_config
    from tests.engine.helpers import hf_twin

    _, ours = hf_twin(tmp_path / "target")
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "target" / "tokenizer.json"))
    save_drafter(random_drafter(tiny_drafter_config(ours.config)), tmp_path / "drafter")
    argv = ["--model", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--device", "cpu"]
    rc, out, _ = _run(capsys, *argv, "--prompt", "w5 w17 w3 w99", "--max-new-tokens", "10", "--compare")
    assert rc == 0 and out.count("output identical: YES") == 2
    eos = ours.config.eos_token_id  # the default stop token for checkpoints
    expected = " ".join(f"w{t}" for t in greedy_generate(ours, [[5, 17, 3, 99]], 10, eos_token_id=eos)[0])
    assert f"--- ddtree (budget 32) ---\n{expected}\n" in out


def test_no_cuda_graphs_gives_the_same_stream(capsys):
    streams = []
    for extra in ([], ["--no-cuda-graphs"]):
        rc, out, _ = _run(capsys, "--demo", "--max-new-tokens", "12", *extra)
        assert rc == 0 and "(CUDA graphs)" not in out  # the CPU never captures
        streams.append(re.findall(r"^--- ddtree.*---\n([\d ]+)\n", out, flags=re.M))
    assert streams[0] == streams[1] and streams[0]
