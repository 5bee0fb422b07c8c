"""Every CLI failure is one line on stderr naming the argument or file, with exit code 2 (1 for a golden
check that finds a difference, 130 on Ctrl-C); never a traceback. Bad checkpoints are built in tmp_path
from a tiny random model (no transformers, no download)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kdtree_engine.cli import build_parser, main

HAS_CUDA = torch.cuda.is_available()
GOLDEN = Path(__file__).parent / "golden"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse: usage errors, --help, --version
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err


def _error_line(err: str) -> str:
    """generate may print progress lines on stderr ("loading target from ..."): the error is then the
    last line, the only one of the form "kdtree-engine generate: ...", and nothing is a traceback."""
    assert "Traceback" not in err and err.endswith("\n"), err
    lines = err.splitlines()
    assert [line for line in lines if line.startswith("kdtree-engine")] == lines[-1:], err
    assert lines[-1].startswith("kdtree-engine generate: "), err
    return lines[-1]


def _truncate(file: Path, keep: int = 200) -> None:
    """A download cut short: the first `keep` bytes of the file."""
    file.write_bytes(file.read_bytes()[:keep])


# --- checkpoints -------------------------------------------------------------------------------------


def _write_target(path: Path, shards: int = 1) -> Path:
    """A tiny random target in the HF layout: config.json + model.safetensors, or `shards` files and an
    index. Per-expert tensor names, as published checkpoints have them."""
    from kdtree_engine.model import random_model, tiny_config
    from kdtree_engine.model.testing import per_expert_tensors

    cfg = tiny_config()
    tensors = {}
    for key, w in random_model(cfg, seed=1).state_dict().items():
        stacked = key.endswith(("experts.gate_up_proj", "experts.down_proj"))
        for k, t in per_expert_tensors(key, w) if stacked else [(key, w)]:
            tensors[k if k.startswith("lm_head") else f"model.{k}"] = t.contiguous()
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: tensors[k] for k in part}, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    from kdtree_engine.drafter import random_drafter, save_drafter, tiny_drafter_config
    from kdtree_engine.model import tiny_config

    root = tmp_path_factory.mktemp("checkpoints")
    drafter = root / "drafter"
    save_drafter(random_drafter(tiny_drafter_config(tiny_config()), seed=2), drafter)
    return {
        "model": _write_target(root / "model"),
        "sharded": _write_target(root / "sharded", 3),
        "drafter": drafter,
    }


def _copy(good, tmp_path, which: str) -> Path:
    return Path(shutil.copytree(good[which], tmp_path / which))


def _generate(capsys, model: Path, drafter: Path | None = None, *extra: str) -> tuple[int, str, str]:
    argv = ["generate", "--model", str(model), "--device", "cpu", "--prompt", "1 2 3"]
    argv += ["--drafter", str(drafter)] if drafter else ["--method", "autoregressive"]
    return _run(capsys, *argv, "--max-new-tokens", "2", "--no-stream", *extra)


def test_good_checkpoints_run(good, capsys):
    for model in (good["model"], good["sharded"]):
        rc, out, err = _generate(capsys, model, good["drafter"])
        assert rc == 0, err
        assert "--- ddtree" in out


def _bad_model(kind: str, good, tmp_path) -> tuple[Path, str]:
    """(a broken target checkpoint dir, what the message must name)."""
    if kind == "no such dir":
        return tmp_path / "mistyped", f"{tmp_path / 'mistyped'} does not exist"
    if kind == "a file":
        (tmp_path / "f.safetensors").write_bytes(b"x")
        return tmp_path / "f.safetensors", "is not a directory"
    if kind == "empty dir":
        return tmp_path, f"no config.json in {tmp_path}"
    path = _copy(good, tmp_path, "sharded" if "shard" in kind or "index" in kind else "model")
    if kind == "no safetensors":
        (path / "model.safetensors").unlink()
        return path, "no model.safetensors or model.safetensors.index.json"
    if kind == "truncated":
        _truncate(path / "model.safetensors")
        return path, f"{path / 'model.safetensors'}: not a readable safetensors file"
    if kind == "garbage":
        (path / "model.safetensors").write_bytes(b"<html>404 not found</html>" * 20)
        return path, f"{path / 'model.safetensors'}: not a readable safetensors file"
    if kind == "bad config json":
        text = (path / "config.json").read_text()
        (path / "config.json").write_text(text[:-1] + ",}")
        return path, f"{path / 'config.json'}: invalid JSON at line 1 column"
    if kind == "config not an object":
        (path / "config.json").write_text("[]")
        return path, f"{path / 'config.json'}: expected a JSON object"
    if kind == "bad index json":
        _truncate(path / "model.safetensors.index.json", 30)
        return path, f"{path / 'model.safetensors.index.json'}: invalid JSON"
    if kind == "index without weight_map":
        (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
        return path, "weight_map"
    if kind == "missing shard":
        (path / "model-00002-of-00003.safetensors").unlink()
        return path, "shard model-00002-of-00003.safetensors named in model.safetensors.index.json is missing"
    if kind == "truncated shard":
        _truncate(path / "model-00003-of-00003.safetensors", 5000)
        return path, "model-00003-of-00003.safetensors: not a readable safetensors file"
    if kind == "bad generation_config json":
        (path / "generation_config.json").write_text('{"eos_token_id": 1,')
        return path, "generation_config.json"
    raise AssertionError(kind)


MODEL_CASES = [
    "no such dir",
    "a file",
    "empty dir",
    "no safetensors",
    "truncated",
    "garbage",
    "bad config json",
    "config not an object",
    "bad index json",
    "index without weight_map",
    "missing shard",
    "truncated shard",
    "bad generation_config json",
]


@pytest.mark.parametrize("kind", MODEL_CASES)
def test_bad_target_checkpoint_is_one_line(good, tmp_path, capsys, kind):
    path, message = _bad_model(kind, good, tmp_path)
    rc, _, err = _generate(capsys, path)
    assert rc == 2
    assert message in _error_line(err)


def _bad_drafter(kind: str, good, tmp_path) -> tuple[Path, str]:
    if kind == "no such dir":
        return tmp_path / "mistyped", f"{tmp_path / 'mistyped'} does not exist"
    path = _copy(good, tmp_path, "drafter")
    if kind == "no safetensors":
        (path / "model.safetensors").unlink()
        return path, f"no *.safetensors file in {path}"
    if kind == "truncated":
        _truncate(path / "model.safetensors", 3000)
        return path, f"{path / 'model.safetensors'}: not a readable safetensors file"
    if kind == "bad config json":
        (path / "config.json").write_text('{"vocab_size": 128,\n  "hidden_size": 64 "block_size": 8}')
        return path, f"{path / 'config.json'}: invalid JSON at line 2 column 21"
    if kind == "config missing a field":
        cfg = json.loads((path / "config.json").read_text())
        del cfg["num_attention_heads"]
        (path / "config.json").write_text(json.dumps(cfg))
        return path, f"{path / 'config.json'}: missing required field 'num_attention_heads'"
    if kind == "missing shard":
        index = {"weight_map": {"fc.weight": "model-00001-of-00002.safetensors"}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        return path, "shard model-00001-of-00002.safetensors named in model.safetensors.index.json is missing"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "no such dir",
        "no safetensors",
        "truncated",
        "bad config json",
        "config missing a field",
        "missing shard",
    ],
)
def test_bad_drafter_checkpoint_is_one_line(good, tmp_path, capsys, kind):
    path, message = _bad_drafter(kind, good, tmp_path)
    rc, _, err = _generate(capsys, good["model"], path)
    assert rc == 2
    assert message in _error_line(err)


def test_paths_are_checked_first_naming_the_flag(good, tmp_path, capsys):
    """A missing or wrong --model / --drafter path is the error, before prompts, tokenizer or weights."""
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x")
    model = str(good["model"])
    for argv, line in [
        (["--model", "/nonexistent", "--prompt", "x"], "--model: /nonexistent does not exist"),
        (["--model", str(file), "--prompt", "x"], f"--model: {file} is not a directory (pass the checkpoint"),
        (["--model", str(tmp_path), "--prompt", "x"], f"--model: no config.json in {tmp_path}"),
        (
            ["--model", model, "--drafter", "/nonexistent", "--prompt", "x"],
            "--drafter: /nonexistent does not",
        ),
        (
            ["--model", model, "--drafter", str(file), "--prompt", "x"],
            f"--drafter: {file} is not a directory",
        ),
        (["--model", model, "--drafter", model, "--prompt", "x"], None),  # a folder of the wrong kind
    ]:
        rc, out, err = _run(capsys, "generate", *argv, "--device", "cpu")
        if line is None:
            assert rc == 2 and "--drafter: " in _one_line(err) and "mask_token_id" in err
            continue
        assert (rc, out) == (2, "") and _one_line(err).startswith(f"kdtree-engine generate: {line}"), err


def test_sizes_are_checked_before_loading(capsys, monkeypatch):
    """A budget whose verify forward cannot fit (1 GiB free: its reference attention scores alone take
    1.6 GiB), or weights that cannot: one line naming the field, before the prompt is printed or the
    weights are read; so is a budget past what a tree op builds, and an absurd one by the config."""
    from kdtree_engine.engine import checks

    monkeypatch.setattr(checks, "available_memory", lambda device: 2**30)
    rc, out, err = _run(capsys, "generate", "--demo", "--budget", "4096", "--device", "cpu")
    assert (rc, out) == (2, "")
    assert "budget: a verify forward needs about" in _one_line(err) and "GiB are free on cpu" in err
    rc, out, err = _run(capsys, "generate", "--demo", "--budget", "100000")
    assert (rc, out) == (2, "") and "budget: expected an int in [0, 4096] (the most nodes a tree op" in err
    assert "loading" not in _one_line(err)
    rc, out, err = _run(capsys, "generate", "--demo", "--budget", str(2**62))
    assert (rc, out) == (2, "") and "budget: expected None, 'auto' or an int in [0, 1048576]" in _one_line(
        err
    )
    monkeypatch.setattr(checks, "available_memory", lambda device: 2**20)
    rc, out, err = _run(capsys, "generate", "--demo", "--device", "cpu")
    assert (rc, out) == (2, "") and "dtype: loading the weights in float32 needs about" in _one_line(err)


def test_tokenizer_without_transformers_names_the_extra(good, tmp_path, capsys, monkeypatch):
    """`pip install -e .` has no transformers: a checkpoint with tokenizer files says which extra to add."""
    path = _copy(good, tmp_path, "model")
    (path / "tokenizer_config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ModuleNotFoundError
    rc, _, err = _generate(capsys, path)
    assert rc == 2
    line = _error_line(err)
    assert "transformers" in line and "[hf]" in line
    (path / "tokenizer.json").write_text("{}")  # read by `tokenizers` alone: a broken one names the file
    rc, _, err = _generate(capsys, path)
    assert rc == 2 and "tokenizer: cannot read" in _error_line(err) and "tokenizer.json" in err


# --- memory, Ctrl-C, bugs ----------------------------------------------------------------------------


def test_out_of_memory_suggests_smaller_sizes(capsys, monkeypatch):
    import kdtree_engine.engine.cli as engine_cli
    import kdtree_engine.tree.demo as tree_demo

    def cuda_oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total ...")

    monkeypatch.setattr(engine_cli, "generate", cuda_oom)
    rc, _, err = _run(capsys, "generate", "--demo", "--max-new-tokens", "4")
    assert rc == 2
    assert "not enough memory (CUDA out of memory. Tried to allocate 20.00 GiB)" in _error_line(err)
    assert "--max-new-tokens" in err and "--budget" in err

    def huge(*args, **kwargs):  # a real allocator failure: 1 PiB is beyond any address space
        return torch.empty(1 << 50, dtype=torch.uint8)

    monkeypatch.setattr(tree_demo, "build_tree_from_logits", huge)
    rc, _, err = _run(capsys, "tree")
    assert rc == 2
    assert "can't allocate memory" in _one_line(err) and "try a smaller --budget" in err
    assert "enforce fail" not in err


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    import kdtree_engine.cli as cli
    import kdtree_engine.tree.demo as tree_demo

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tree_demo, "build_tree_from_logits", interrupted)
    try:
        rc, _, err = _run(capsys, "tree")
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main()")
    assert rc == 130 and _one_line(err) == "kdtree-engine tree: interrupted\n"
    monkeypatch.setattr(cli, "build_parser", interrupted)  # during start-up: importing the subcommands
    rc, _, err = _run(capsys, "generate", "--demo")
    assert rc == 130 and _one_line(err) == "kdtree-engine generate: interrupted\n"


def test_ctrl_c_swallowed_by_an_import_still_stops(capsys, monkeypatch):
    """An extension module's start-up may swallow the KeyboardInterrupt of a Ctrl-C (importing torch
    does at one point): the command still stops, one line, 130."""
    import signal

    import kdtree_engine.cli as cli

    real = cli.build_parser

    def swallowing_import():
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass  # what the extension module did
        return real()

    monkeypatch.setattr(cli, "build_parser", swallowing_import)
    # as in a terminal: a background job of a non-interactive shell starts with SIGINT ignored, and the
    # command then leaves it so (the Ctrl-C handler is installed only over Python's default one)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc, out, err = _run(capsys, "generate", "--demo", "random", "--max-new-tokens", "2")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (rc, out) == (130, "") and _one_line(err) == "kdtree-engine generate: interrupted\n"


def _subprocess(argv: list[str], **popen):
    """kdtree-engine argv in a fresh interpreter (its own stdout): the Popen."""
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1] / "src"), ""]))
    return subprocess.Popen([sys.executable, "-m", "kdtree_engine", *argv], env=env, **popen)


GENERATE_SMALL = ["generate", "--demo", "random", "--max-new-tokens", "200", "--compare"]


def test_closed_stdout_and_a_reader_that_goes_away():
    """`>&-`: the output is discarded, exit 0; a pipe whose reader went away (`| head`): exit 141;
    never a traceback."""
    import os
    import subprocess

    closed = _subprocess(GENERATE_SMALL, stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1))
    _, err = closed.communicate(timeout=300)
    assert closed.returncode == 0 and err.decode() == "", err.decode()[-2000:]
    reader = _subprocess(GENERATE_SMALL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader.stdout.close()  # the reader is gone before the first line (`| head -0`): every write fails
    err = reader.stderr.read().decode()
    assert reader.wait(timeout=300) == 141 and err == "", err[-2000:]


@pytest.mark.parametrize(
    "raised, message",
    [
        (
            ModuleNotFoundError("No module named 'triton'", name="triton"),
            'the [gpu] extra: pip install -e ".[gpu]"',
        ),
        (ModuleNotFoundError("No module named 'tokenizers'", name="tokenizers"), 'pip install -e ".[hf]"'),
        (SystemExit("--thing: expected a thing"), "--thing: expected a thing"),
        (PermissionError(13, "Permission denied", "/ckpt/model.safetensors"), "Permission denied: '/ckpt/"),
        (ValueError("first line\n  second line"), "first line second line"),
    ],
)
def test_expected_errors_anywhere_are_one_line(capsys, monkeypatch, raised, message):
    """The net in cli.main: an optional dependency names its extra; OSError, ValueError and
    SystemExit("message") from any subcommand are one line, exit 2."""
    import kdtree_engine.tree.demo as tree_demo

    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(tree_demo, "build_tree_from_logits", fail)
    rc, _, err = _run(capsys, "tree")
    assert rc == 2
    assert message in _one_line(err) and err.startswith("kdtree-engine tree: ")


def test_closed_pipe_exits_quietly(capsys, monkeypatch):
    import kdtree_engine.tree.demo as tree_demo

    def reader_gone(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(tree_demo, "build_tree_from_logits", reader_gone)
    rc, _, err = _run(capsys, "tree")
    assert rc == 141 and err == ""


def test_bugs_keep_their_traceback(monkeypatch):
    import kdtree_engine.tree.demo as tree_demo

    def bug(*args, **kwargs):
        raise TypeError("a bug")

    monkeypatch.setattr(tree_demo, "build_tree_from_logits", bug)
    with pytest.raises(TypeError, match="a bug"):
        main(["tree"])
    monkeypatch.setenv("KDTREE_ENGINE_TRACEBACK", "1")  # and every error, when asked for
    with pytest.raises(FileNotFoundError, match="nowhere"):
        main(["generate", "--model", "/nowhere", "--method", "autoregressive", "--prompt", "1"])


# --- tree --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--depth", "0"], "--depth: expected >= 1, got 0"),
        (["--vocab", "0"], "--vocab: expected >= 1, got 0"),
        (["--vocab", "1000000000000"], "--vocab: expected <= 4194304"),
        (["--budget", "-1"], "--budget: expected >= 0, got -1"),
        (["--depth", "x"], "argument --depth: invalid int value: 'x'"),
        (["--impl", "cuda"], "argument --impl: invalid choice: 'cuda'"),
    ],
)
def test_tree_bad_arguments_exit_2(capsys, argv, message):
    rc, out, err = _run(capsys, "tree", *argv)
    assert rc == 2 and out == ""
    assert message in _one_line(err) and err.startswith("kdtree-engine tree: ")


@pytest.mark.skipif(HAS_CUDA, reason="the refusal is for machines without a GPU")
@pytest.mark.parametrize("impl", ["triton", "hopper"])
def test_tree_kernels_without_a_gpu_are_refused(capsys, monkeypatch, impl):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc, out, err = _run(capsys, "tree", "--impl", impl)
    assert rc == 2 and out == ""
    assert f"--impl {impl} needs a CUDA GPU here; use --impl ref" in _one_line(err)


def test_tree_kernels_run_through_the_interpreter_when_asked(capsys):
    """With TRITON_INTERPRET=1 (set by conftest without a GPU) the kernels run, as in CI."""
    rc, out, _ = _run(capsys, "tree", "--impl", "triton", "--depth", "2", "--vocab", "5", "--budget", "3")
    assert rc == 0 and "3 nodes" in out


# --- golden ------------------------------------------------------------------------------------------


def _tree_bundles(tmp_path) -> Path:
    for f in GOLDEN.glob("tree_*.safetensors"):
        shutil.copy(f, tmp_path / f.name)
    return tmp_path


def test_golden_bad_arguments_go_to_stderr_with_exit_2(tmp_path, capsys):
    rc, out, err = _run(capsys, "golden", "--check", "--dir", str(tmp_path / "nowhere"))
    assert rc == 2 and out == "" and "--dir" in _one_line(err)
    rc, out, err = _run(capsys, "golden", "--check", "--dir", str(tmp_path))  # a folder without bundles
    assert rc == 2 and out == "" and "holds no bundles" in _one_line(err)
    rc, _, err = _run(capsys, "golden")
    assert rc == 2 and "one of the arguments --regen --check is required" in _one_line(err)


def test_golden_check_reports_each_bundle_and_fails_with_1(tmp_path, capsys):
    directory = _tree_bundles(tmp_path)
    rc, out, err = _run(capsys, "golden", "--check", "--op", "tree", "--dir", str(directory))
    assert rc == 0 and err == ""
    assert "[1/8] tree_random_fp32: ok" in out and "8/8 bundles match" in out
    _truncate(directory / "tree_budget1.safetensors")
    (directory / "tree_depth1.safetensors").unlink()
    rc, out, err = _run(capsys, "golden", "--check", "--op", "tree", "--dir", str(directory))
    assert rc == 1
    assert "tree_budget1: unreadable (Error while deserializing header" in out
    assert "tree_depth1: missing" in out and "6/8 bundles match" in out
    assert "tree_budget1" in _one_line(err) and "tree_depth1" in err and "--regen" in err


# --- --version, --help -------------------------------------------------------------------------------


def test_version(capsys):
    from importlib import metadata

    rc, out, _ = _run(capsys, "--version")
    try:
        expected = metadata.version("kdtree-engine")
    except metadata.PackageNotFoundError:
        from kdtree_engine import __version__ as expected
    assert rc == 0 and out == f"kdtree-engine {expected}\n"


def _subparsers(parser):
    for action in parser._actions:
        if action.choices and hasattr(action, "_name_parser_map"):
            for sub in action._name_parser_map.values():
                yield sub
                yield from _subparsers(sub)


def test_help_shows_every_default(capsys):
    subs = list(_subparsers(build_parser()))
    assert {p.prog for p in subs} >= {"kdtree-engine tree", "kdtree-engine golden", "kdtree-engine generate"}
    for parser in subs:
        for action in parser._actions:
            if action.option_strings and action.nargs != 0 and action.default is not None:
                assert "default" in (action.help or ""), f"{parser.prog} {action.option_strings}"
    for argv, shown in [
        (["tree", "--help"], ["draft block length L (default: 4)", "seed of the random logits (default: 0)"]),
        (
            ["generate", "--help"],
            ["DDTree node budget (root not counted), or auto", "costs (default: 32)", "(default: ddtree)"],
        ),
        (["golden", "--help"], [f"(default: {GOLDEN.resolve()})"]),
    ]:
        rc, out, _ = _run(capsys, *argv)
        out = " ".join(out.split())  # argparse wraps the help
        assert rc == 0 and all(s in out for s in shown), (argv, out)


@pytest.mark.skipif(HAS_CUDA, reason="the error is for machines without CUDA")
def test_bench_sglang_without_cuda_is_one_line(capsys):
    rc, _, err = _run(capsys, "bench", "sglang", "--batch", "1")
    assert rc == 2 and "device" in _one_line(err)


def test_bench_sglang_without_the_port_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rc, _, err = _run(capsys, "bench", "sglang", "--port", str(tmp_path))
    assert rc == 2 and "path" in _one_line(err)
