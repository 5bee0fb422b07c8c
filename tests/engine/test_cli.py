"""`kdtree-engine generate` end to end on the demo models (no download)."""

from __future__ import annotations

import re
import shutil

import pytest

from kdtree_engine.cli import main
from kdtree_engine.model import greedy_generate


def _run(capsys, *argv):
    rc = main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_demo_compare_matches_autoregressive(capsys):
    rc, out, _ = _run(capsys, "--demo", "random", "--compare", "--max-new-tokens", "40")
    assert rc == 0
    assert "ddtree: target forwards" in out and "dflash: target forwards" in out
    assert out.count("output identical: YES") == 2
    streams = re.findall(r"^--- (\w+).*---\n([\d ]+)\n", out, flags=re.M)
    assert [m for m, _ in streams] == ["ddtree", "dflash", "autoregressive"]
    assert len({s.strip() for _, s in streams}) == 1 and len(streams[0][1].split()) == 40
    forwards = dict(re.findall(r"\[(\w+)\] \d+ new tokens \(batch 1\) in (\d+) target forwards", out))
    assert int(forwards["ddtree"]) < int(forwards["dflash"]) < int(forwards["autoregressive"]) == 40


def test_kimi_nano_demo_completes_held_out_code(capsys):
    """The main job: the shipped kimi-nano target and its trained drafter complete a held-out prompt as
    text, DDTree equals autoregressive decoding, and the trained drafter gets drafts accepted (an
    untrained one accepts about 1 token per round, the bonus only)."""
    from kdtree_engine.assets import heldout_prompts

    rc, out, _ = _run(capsys, "--demo", "--compare", "--device", "cpu", "--max-new-tokens", "32")
    assert rc == 0 and out.count("output identical: YES") == 2
    assert heldout_prompts()[0]["text"] in out
    streams = re.findall(r"^--- (\w+)[^\n]*---\n(.*?)\n\[\1\]", out, flags=re.M | re.S)
    assert [m for m, _ in streams] == ["ddtree", "dflash", "autoregressive"]
    assert len({t for _, t in streams}) == 1 and re.search(r"[A-Za-z_]{3}", streams[0][1])
    tau = {
        m: float(v)
        for m, v in re.findall(r"^ *(\w+): target forwards.*mean accepted length ([\d.]+)", out, re.M)
    }
    assert tau["ddtree"] >= 2.5 and tau["ddtree"] > tau["dflash"] > 1.5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--demo", "--demo-drafter", "oracle"], "--demo-drafter: only with --demo random"),
        (["--demo", "--model", "x"], "--demo: the demo brings its own model and drafter"),
    ],
)
def test_kimi_nano_demo_errors(capsys, argv, message):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == "" and message in err


def _requests(out: str, method: str) -> dict[int, str]:
    """A batch's streamed text per request: the "[b] piece" lines under the method's header, joined."""
    block = out.split(f"--- {method}", 1)[1].split("\n", 1)[1].split(f"\n[{method}] ", 1)[0]
    texts: dict[int, str] = {}
    for line in block.splitlines():
        b, piece = re.fullmatch(r"\[(\d+)\] (.*)", line).groups()
        texts[int(b)] = texts.get(int(b), "") + piece
    return texts


def test_batch_prompts_random_drafter_and_sampling(capsys):
    args = [
        "--demo",
        "random",
        "--demo-drafter",
        "random",
        "--prompt",
        "1 2 3",
        "--prompt-ids",
        "9 8 7 6 5 4",
    ]
    rc, out, _ = _run(capsys, *args, "--method", "dflash", "--max-new-tokens", "8", "--compare")
    assert rc == 0 and "output identical: YES" in out
    texts = _requests(out, "dflash")  # batch > 1 streams too: "[b] piece" lines, interleaved
    assert sorted(texts) == [0, 1] and all(re.fullmatch(r"(\d+ ){7}\d+", t) for t in texts.values())
    assert texts == _requests(out, "autoregressive")
    assert re.search(r"^\[0\] \d+\n\[1\] \d+\n\[0\]  \d+", out, flags=re.M)  # as the tokens come
    rc, out, _ = _run(capsys, *args, "--method", "dflash", "--max-new-tokens", "8", "--no-stream")
    assert rc == 0 and re.search(r"^\[1\] (\d+ ){7}\d+$", out, flags=re.M)
    sampling = ["--temperature", "0.9", "--top-k", "20"]
    rc, out, _ = _run(capsys, *args, *sampling, "--max-new-tokens", "8", "--compare")
    assert rc == 0 and "sampled" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--demo", "random", "--prompt", "hello world"], "space-separated token ids"),
        (["--demo", "random", "--prompt", ""], "prompt 0 is empty"),
        (["--demo", "random", "--budget", "-2"], "budget"),
        (["--drafter", "/nonexistent"], "--model"),
        (["--demo", "random", "--impl", "cuda"], "impl: expected one of ('ref', 'triton', 'hopper') or None"),
        (["--demo", "random", "--method", "beam"], "method: expected one of"),
        (["--demo", "random", "--top-p", "0"], "top_p"),
        (["--demo", "random", "--stop", "-1"], "stop_tokens"),
        (
            ["--demo", "random", "--prompt-ids", "1 two"],
            "--prompt-ids: expected token ids separated by spaces",
        ),
        (["--demo", "random", "--stop-string", ""], "stop_strings: expected non-empty strings"),
        (["--demo", "random", "--device", "mps"], "--device mps: kdtree-engine runs on cpu or cuda (cuda:N)"),
        (["--demo", "random", "--device", "meta"], "--device meta: kdtree-engine runs on cpu or cuda"),
        (["--model", "/nonexistent", "--prompt", "x"], "--model: /nonexistent does not exist"),
        (["--model", "/nonexistent", "--method", "autoregressive", "--prompt", "x"], "--model: /nonexistent"),
        (
            ["--demo", "random", "--chat"],
            "--chat: needs a tokenizer with a chat template, and the demo has no tokenizer",
        ),
        (["--demo", "random", "--device", "gpu"], "--device: 'gpu' is not a device (cpu, cuda, cuda:N)"),
        (["--demo", "random", "--device", "cpu", "--max-new-tokens", "-1"], "max_new_tokens"),
    ],
)
def test_errors_exit_2(capsys, argv, message):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and message in err
    assert err.count("\n") == 1  # one line


def test_impl_choices_and_config():
    """--impl takes the implementation vocabulary (default None: the fastest that applies), and the
    arguments become one GenerationConfig: one flag per field, derived from it (train.options)."""
    import dataclasses

    from kdtree_engine.cli import build_parser
    from kdtree_engine.engine import GenerationConfig, SamplingParams
    from kdtree_engine.engine.cli import _config

    parse = build_parser().parse_args
    assert parse(["generate"]).impl is None
    for impl in ("ref", "triton", "hopper"):
        assert parse(["generate", "--impl", impl]).impl == impl
    assert _config(parse(["generate"])) == GenerationConfig()  # the flags' defaults are the config's
    dests = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions}
    fields = {f.name for f in dataclasses.fields(GenerationConfig) if f.name != "sampling"}
    assert fields | {f.name for f in dataclasses.fields(SamplingParams)} <= dests  # one flag per field
    off = parse(["generate", "--no-cuda-graphs", "--stop-string", "a", "--stop-string", "b", "--stop", "1"])
    assert _config(off) == GenerationConfig(cuda_graphs=False, stop_strings=("a", "b"), stop_tokens=(1,))
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
        rc, out, _ = _run(capsys, "--demo", "random", "--device", "cpu", "--max-new-tokens", "12", *extra)
        assert rc == 0 and "(CUDA graphs)" not in out  # the CPU never captures
        streams.append(re.findall(r"^--- ddtree.*---\n([\d ]+)\n", out, flags=re.M))
    assert streams[0] == streams[1] and streams[0]


# --- checkpoints with tokenizers -------------------------------------------------------------------

SOURCE = "Café 日本語 ok 👍🏽 e\u0301 — 𝄞 done"  # its bytes, cut into 2-byte tokens, spell the output
PROMPT = "hello"
NEW = 16


def _byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable character map, as a list indexed by byte."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        out.append(chr(b) if b in keep else chr(256 + extra))
        extra += b not in keep
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random checkpoint (target + drafter) and a byte-level tokenizer made for it: PROMPT
    encodes to ids inside the model's vocabulary, and the ids of the target's greedy continuation
    decode to 2-byte pieces of SOURCE (multi-byte characters cut across tokens), one of them a
    special token. Returns a namespace with the dirs, the continuation and its expected text."""
    from types import SimpleNamespace

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from kdtree_engine.drafter import random_drafter, save_drafter, tiny_drafter_config
    from tests.engine.helpers import hf_twin

    root = tmp_path_factory.mktemp("ckpt")
    _, ours = hf_twin(root / "target")
    save_drafter(random_drafter(tiny_drafter_config(ours.config)), root / "drafter")
    chars = _byte_level_chars()
    vocab = {c: i for i, c in enumerate(sorted(chars))}  # "!".."~" first: PROMPT's ids are < 128
    prompt = [vocab[c] for c in PROMPT]
    cont = greedy_generate(ours, [prompt], NEW)[0]
    raw = SOURCE.encode()
    pieces = iter(dict.fromkeys("".join(chars[b] for b in raw[i : i + 2]) for i in range(0, len(raw), 2)))
    by_id = {i: c for c, i in vocab.items()}
    fresh = [t for t in dict.fromkeys(cont) if t not in prompt]
    special = fresh[3]
    for t in fresh:
        by_id[t] = "<|sp|>" if t == special else next(pieces)
    displaced = [c for c in chars if c not in set(by_id.values())]
    by_id.update({256 + k: c for k, c in enumerate(displaced)})
    tok = Tokenizer(models.BPE({c: i for i, c in by_id.items()}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|sp|>", special=True)])
    assert tok.encode(PROMPT).ids == prompt and tok.token_to_id("<|sp|>") == special
    text = tok.decode(cont)
    assert "Café 日本語" in text and any("\ufffd" in tok.decode([t]) for t in cont[:4])  # cut, made whole
    tok.save(str(root / "target" / "tokenizer.json"))
    return SimpleNamespace(
        root=root, model=root / "target", drafter=root / "drafter", ours=ours, tok=tok, prompt=prompt,
        cont=cont, text=text, special=special,
    )  # fmt: skip


def _variant(ckpt, name: str, **files) -> str:
    """A copy of the checkpoint dir with extra or replaced files (name -> text; None removes)."""
    path = ckpt.root / name
    if not path.exists():
        shutil.copytree(ckpt.model, path)
        for file, text in files.items():
            target = path / file.replace("__", ".")
            target.unlink(missing_ok=True)
            if text is not None:
                target.write_text(text)
    return str(path)


def _ckpt_args(ckpt, model=None, *extra):
    return ["--model", str(model or ckpt.model), "--drafter", str(ckpt.drafter), "--device", "cpu", *extra]


def _stream_of(out: str, method: str) -> str:
    return out.split(f"--- {method}", 1)[1].split("---\n", 1)[1].split(f"\n[{method}] ", 1)[0]


def test_streamed_text_is_the_full_decode(capsys, ckpt):
    """Characters cut across tokens print once, whole: the stream is the decode of all the tokens
    (special tokens skipped), with one token per push (autoregressive) and several (DDTree)."""
    gen = ["--max-new-tokens", str(NEW), "--ignore-eos", "--prompt", PROMPT]
    rc, out, err = _run(capsys, *_ckpt_args(ckpt, None, *gen, "--method", "autoregressive", "--compare"))
    assert rc == 0
    assert _stream_of(out, "autoregressive") == ckpt.text
    rc, out, err = _run(capsys, *_ckpt_args(ckpt, None, *gen, "--compare"))
    assert rc == 0 and out.count("output identical: YES") == 2
    for method in ("ddtree", "dflash", "autoregressive"):
        assert _stream_of(out, method) == ckpt.text
    assert f"loading target from {ckpt.model} ...\n" in err and f"loading drafter from {ckpt.drafter}" in err
    rc, out, _ = _run(capsys, *_ckpt_args(ckpt, None, *gen, "--no-stream"))
    assert rc == 0 and f"---\n[0] {ckpt.text}\n" in out
    rc, out, _ = _run(capsys, *_ckpt_args(ckpt, None, *gen, "--show-special-tokens"))
    full = ckpt.tok.decode(ckpt.cont, skip_special_tokens=False)
    assert rc == 0 and "<|sp|>" in full and _stream_of(out, "ddtree") == full


def test_prompt_ids_with_a_tokenizer_and_batches(capsys, ckpt):
    """--prompt-ids takes ids even when the model dir has a tokenizer; mixed with --prompt in order; a
    batch streams "[b] piece" lines whose pieces join to each request's text."""
    ids = " ".join(map(str, ckpt.prompt))
    other = [7, 3, 9, 60, 2]
    argv = _ckpt_args(ckpt, None, "--prompt-ids", " ".join(map(str, other)), "--prompt", PROMPT,
                      "--prompt-ids", ids, "--max-new-tokens", str(NEW), "--ignore-eos")  # fmt: skip
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0
    texts = _requests(out, "ddtree")
    conts = greedy_generate(ckpt.ours, [other], NEW)
    assert texts == {0: ckpt.tok.decode(conts[0]), 1: ckpt.text, 2: ckpt.text}
    assert "(batch 3)" in out


def _completing_token(tok, ids: list[int], stop: str) -> int:
    """How many of ids the request keeps: up to and including the token whose text completes stop."""
    return next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))


def test_stop_strings(capsys, ckpt):
    """--stop-string stops the request at the token that completes it (the stats count tokens up to
    and including that one) and cuts the printed text before it (streamed or not, any batch)."""
    text = ckpt.text
    stop = text[text.index("é") : text.index("é") + 2]
    expected = text[: text.index(stop)]
    kept = _completing_token(ckpt.tok, ckpt.cont, stop)
    assert kept < NEW
    gen = ["--max-new-tokens", str(NEW), "--ignore-eos", "--stop-string", stop, "--stop-string", "never"]
    rc, out, _ = _run(capsys, *_ckpt_args(ckpt, None, *gen, "--prompt", PROMPT, "--compare"))
    assert rc == 0 and _stream_of(out, "ddtree") == expected and out.count("output identical: YES") == 2
    for method in ("ddtree", "dflash", "autoregressive"):
        assert f"[{method}] {kept} new tokens (batch 1)" in out  # decoding stopped there
    rc, out, _ = _run(capsys, *_ckpt_args(ckpt, None, *gen, "--prompt", PROMPT, "--prompt-ids", "5 6"))
    assert rc == 0 and _requests(out, "ddtree")[0] == expected
    other = greedy_generate(ckpt.ours, [[5, 6]], NEW)[0]  # per request: the other one runs on
    kept_other = _completing_token(ckpt.tok, other, stop) if stop in ckpt.tok.decode(other) else NEW
    assert f"[ddtree] {kept + kept_other} new tokens (batch 2)" in out and kept_other > kept
    rc, out, _ = _run(capsys, *_ckpt_args(ckpt, None, *gen, "--prompt", PROMPT, "--no-stream"))
    assert rc == 0 and f"---\n[0] {expected}\n[ddtree] {kept} new tokens" in out
    # In the demo (the text is the ids): stop at the 4th token, print up to the 3rd.
    rc, out, _ = _run(capsys, "--demo", "random", "--max-new-tokens", "8")
    text = _stream_of(out, "ddtree")
    stop = " " + " ".join(text.split()[2:4])
    rc, out, _ = _run(capsys, "--demo", "random", "--max-new-tokens", "8", "--stop-string", stop)
    assert rc == 0 and _stream_of(out, "ddtree") == text[: text.index(stop)]
    assert "[ddtree] 4 new tokens" in out


def test_generation_config_defaults(capsys, ckpt):
    """generation_config.json gives the defaults of max_new_tokens, the stop tokens and (do_sample)
    the sampling settings; flags win."""
    import json

    from kdtree_engine.cli import build_parser
    from kdtree_engine.engine.checkpoint import generation_defaults
    from kdtree_engine.engine.cli import _config

    eos = ckpt.cont[5]
    n = ckpt.cont.index(eos) + 1
    gen = json.dumps({"max_new_tokens": 12, "eos_token_id": [eos], "temperature": 0.3})  # no do_sample
    model = _variant(ckpt, "genconf", generation_config__json=gen)
    rc, out, err = _run(capsys, *_ckpt_args(ckpt, model, "--prompt", PROMPT))
    assert rc == 0 and f"[ddtree] {n} new tokens" in out
    assert f"generation_config.json: max_new_tokens 12, stop tokens [{eos}] (flags override)\n" in err
    rc, out, err = _run(capsys, *_ckpt_args(ckpt, model, "--prompt", PROMPT, "--ignore-eos"))
    assert rc == 0 and "[ddtree] 12 new tokens" in out and "stop" not in err
    rc, out, err = _run(capsys, *_ckpt_args(ckpt, model, "--prompt", PROMPT, "--max-new-tokens", "3"))
    assert rc == 0 and "[ddtree] 3 new tokens" in out and "max_new_tokens" not in err
    sampled = json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20})
    model = _variant(ckpt, "sampled", generation_config__json=sampled)
    parse = build_parser().parse_args
    config = _config(parse(["generate", "--model", model]), generation_defaults(model))
    assert (config.sampling.temperature, config.sampling.top_p, config.sampling.top_k) == (0.6, 0.95, 20)
    config = _config(parse(["generate", "--temperature", "0", "--top-k", "0"]), generation_defaults(model))
    assert (config.sampling.temperature, config.sampling.top_p, config.sampling.top_k) == (0.0, 0.95, 0)
    bad = _variant(ckpt, "badgen", generation_config__json='{"max_new_tokens": "many"}')
    rc, out, err = _run(capsys, *_ckpt_args(ckpt, bad, "--prompt", PROMPT))
    assert rc == 2 and out == "" and "generation_config.json: max_new_tokens must be an int" in err


def test_chat_template(capsys, ckpt):
    """--chat applies the tokenizer's chat template (a user message + the generation prompt)."""
    import json

    # Only PROMPT's characters have ids inside the model's vocabulary.
    template = (
        "{% for m in messages %}h{{ m['content'] }}o{% endfor %}{% if add_generation_prompt %}e{% endif %}"
    )
    model = _variant(ckpt, "chat", tokenizer_config__json=json.dumps({"chat_template": template}))
    rc, out, _ = _run(capsys, *_ckpt_args(ckpt, model, "--chat", "--prompt", "ll", "--max-new-tokens", "6",
                                          "--ignore-eos", "--prompt-ids", "5 6"))  # fmt: skip
    ids = ckpt.tok.encode("hlloe").ids
    cont = greedy_generate(ckpt.ours, [ids, [5, 6]], 6)
    assert rc == 0 and _requests(out, "ddtree") == {0: ckpt.tok.decode(cont[0]), 1: ckpt.tok.decode(cont[1])}
    rc, out, err = _run(capsys, *_ckpt_args(ckpt, None, "--chat", "--prompt", "hi"))
    assert rc == 2 and out == "" and "has no chat template" in err and err.count("\n") == 1


def test_trust_remote_code(capsys, ckpt, monkeypatch, tmp_path):
    """A tokenizer shipped as code needs --trust-remote-code; without it, the error says so."""
    import json
    import sys

    import transformers.dynamic_module_utils as dyn

    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # the copied code goes here
    monkeypatch.setattr(sys, "path", list(sys.path))
    code = "from transformers import PreTrainedTokenizerFast as Base\n\n\nclass TinyTokenizer(Base): ...\n"
    config = {
        "tokenizer_class": "TinyTokenizer",
        "auto_map": {"AutoTokenizer": [None, "tokenization_tiny.TinyTokenizer"]},
    }
    model = _variant(ckpt, "remote", tokenization_tiny__py=code, tokenizer_config__json=json.dumps(config))
    gen = ["--prompt", PROMPT, "--max-new-tokens", str(NEW), "--ignore-eos"]
    rc, out, err = _run(capsys, *_ckpt_args(ckpt, model, *gen))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "custom code" in err and "pass --trust-remote-code" in err
    rc, out, _ = _run(capsys, *_ckpt_args(ckpt, model, *gen, "--trust-remote-code"))
    assert rc == 0 and _stream_of(out, "ddtree") == ckpt.text


def test_without_transformers_tokenizer_json_is_read_by_tokenizers(capsys, ckpt, monkeypatch, tmp_path):
    """`pip install -e .` has no transformers: a tokenizer.json still works (through `tokenizers`, with
    the same text); tokenizer files without a tokenizer.json name the extra to install."""
    import sys

    gen = ["--prompt", PROMPT, "--max-new-tokens", str(NEW), "--ignore-eos"]
    rc, with_hf, _ = _run(capsys, *_ckpt_args(ckpt, None, *gen))
    assert rc == 0
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ModuleNotFoundError
    rc, without_hf, _ = _run(capsys, *_ckpt_args(ckpt, None, *gen))
    assert rc == 0 and _stream_of(without_hf, "ddtree") == _stream_of(with_hf, "ddtree") == ckpt.text
    model = tmp_path / "model"
    shutil.copytree(ckpt.model, model)  # the fixture is shared: change a copy
    (model / "tokenizer.json").unlink()
    (model / "tokenizer_config.json").write_text("{}")
    rc, out, err = _run(capsys, *_ckpt_args(ckpt, model, "--prompt", PROMPT))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "needs transformers" in err and 'pip install "kdtree-engine[hf]"' in err


def test_errors_before_anything_is_printed(capsys, ckpt, monkeypatch):
    """Missing drafter, no GPU, bad prompts: one line on stderr, exit 2, nothing on stdout and nothing
    loaded (no progress line)."""
    import torch

    rc, out, err = _run(capsys, "--model", str(ckpt.model), "--prompt", PROMPT)
    assert (rc, out) == (2, "")
    assert err == (
        "kdtree-engine generate: --drafter: method 'ddtree' needs a DFlash drafter checkpoint "
        "(pass --drafter DIR, or --method autoregressive)\n"
    )
    rc, out, err = _run(capsys, "--model", str(ckpt.model), "--method", "dflash", "--prompt", PROMPT)
    assert rc == 2 and "method 'dflash' needs a DFlash drafter" in err
    rc, out, _ = _run(capsys, "--model", str(ckpt.model), "--method", "autoregressive", "--prompt", PROMPT,
                      "--max-new-tokens", "2", "--device", "cpu")  # fmt: skip
    assert rc == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["--demo", "random"], _ckpt_args(ckpt)[:4]):
        rc, out, err = _run(capsys, *argv, "--device", "cuda", "--prompt", PROMPT)
        assert (rc, out) == (2, "") and err.count("\n") == 1
        assert "--device cuda: no CUDA GPU is available to torch here; use --device cpu" in err
    for argv, message in [
        (["--prompt-ids", "1 x"], "--prompt-ids: expected token ids separated by spaces, got '1 x'"),
        (["--prompt-ids", "1 500"], "prompt 0 has token ids outside [0, 128)"),
        (["--prompt", PROMPT, "--stop", "900"], "stop_tokens: ids must be in [0, 128)"),
        ([], "--prompt: give at least one prompt"),
    ]:
        rc, out, err = _run(capsys, *_ckpt_args(ckpt, None, *argv))
        assert (rc, out) == (2, "") and message in err, (argv, err)
        assert "--- " not in out


def test_impl_triton_on_the_cpu_is_refused_without_the_interpreter(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ("--demo", "random", "--impl", "triton", "--device", "cpu", "--max-new-tokens", "4")
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == "" and "--impl triton: needs --device cuda" in err


@pytest.mark.parametrize("impl", [None, "ref"])
def test_row_invariant_without_the_kernels_is_refused_before_loading(capsys, impl):
    argv = ["--demo", "random", "--row-invariant", "--device", "cpu", "--max-new-tokens", "4"]
    rc, out, err = _run(capsys, *argv, *(["--impl", impl] if impl else []))
    assert (
        rc == 2 and out == "" and err.startswith("kdtree-engine generate: --row-invariant: needs the kernels")
    )


def test_compare_explains_a_divergence(capsys):
    from kdtree_engine.engine.cli import _compare
    from kdtree_engine.engine.loop import GenerationOutput
    from kdtree_engine.engine.stats import GenerationStats
    from tests.engine.helpers import tiny_target

    target = tiny_target(0)
    base = greedy_generate(target, [[1, 2, 3]], 5)
    other = [base[0][:2] + [(base[0][2] + 1) % 96, 0, 0]]

    class Session:
        prompts, config = [[1, 2, 3]], type("C", (), {"impl": None})()

    Session.target = target
    runs = {
        "ddtree": GenerationOutput(other, GenerationStats("ddtree", 1)),
        "autoregressive": GenerationOutput(base, GenerationStats("autoregressive", 1)),
    }
    assert _compare(runs, greedy=True, session=Session) == 1  # float32, a real choice: not a tie
    out = capsys.readouterr().out
    assert "parted at new token 2" in out and "NOT explained" in out


# --- what a new user hits (issue 26) -------------------------------------------------------------


def test_a_huge_max_new_tokens_is_clamped_and_said(capsys):
    """Past the context (4096 for the random demo's target): one line on stderr, then it runs."""
    prompt = " ".join(str(i % 100) for i in range(4090))
    argv = [
        "--demo",
        "random",
        "--method",
        "autoregressive",
        "--prompt-ids",
        prompt,
        "--max-new-tokens",
        "99",
    ]
    rc, out, err = _run(capsys, *argv)
    assert rc == 0 and "[autoregressive] 6 new tokens" in out
    assert err == (
        "max_new_tokens: 99 is past the target's context of 4096 positions; each request stops at its "
        "end (request 0: 4090 prompt tokens, at most 6 new)\n"
    )


def test_mean_accepted_length_counts_committed_tokens(capsys):
    """--max-new-tokens 4: the prefill commits 1, the one round 3 (the stand-in gets 7 accepted)."""
    rc, out, _ = _run(capsys, "--demo", "random", "--max-new-tokens", "4")
    assert rc == 0 and "[ddtree] 4 new tokens (batch 1) in 2 target forwards" in out
    assert "mean accepted length 3.00 (histogram 3:1)" in out


def test_compare_says_what_a_round_costs(capsys):
    """Per method: a round's cost in decode steps against the tokens it commits; their ratio is the
    decoding speedup."""
    rc, out, _ = _run(capsys, "--demo", "random", "--compare", "--max-new-tokens", "24")
    rows = re.findall(
        r"^ +a round costs ([\d.]+) decode steps \((\w+) [\d.]+.*\) and commits ([\d.]+) tokens: "
        r"speedup about ([\d.]+) / ([\d.]+) = ([\d.]+)x$",
        out,
        flags=re.M,
    )
    assert rc == 0 and len(rows) == 2
    for cost, stage, tau, tau_again, cost_again, speedup in rows:
        assert (tau, cost) == (tau_again, cost_again) and stage in ("draft", "tree_build", "verify")
        assert abs(float(tau) / float(cost) - float(speedup)) < 0.02


def test_help_texts_say_what_the_demo_does(capsys):
    """The top-level description is whole; --stop names the kimi-nano demo's stop token, which is
    its generation_config.json's eos_token_id and the tokenizer's <|endoftext|>."""
    import json

    from kdtree_engine.assets import KIMI_NANO
    from kdtree_engine.cli import DESCRIPTION
    from kdtree_engine.engine.tokenizer import load_tokenizer

    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert DESCRIPTION in out and DESCRIPTION.endswith(".")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    eos = json.loads((KIMI_NANO / "generation_config.json").read_text())["eos_token_id"]
    token = load_tokenizer(KIMI_NANO).decode([eos], skip_special_tokens=False)
    assert f"the kimi-nano demo: {eos}, {token}; --demo random: none" in out


def test_kimi_nano_prompts_end_as_training_text(capsys):
    """The held-out prompts end with a def line, before its newline (the BPE merges a newline with the
    next line's indentation); a demo prompt ending in a bare newline loses it, said on stderr."""
    from kdtree_engine.assets import heldout_prompts

    assert all(p["text"].rstrip().endswith(":") and not p["text"].endswith("\n") for p in heldout_prompts())
    rc, out, err = _run(capsys, "--demo", "--prompt", "def add(a, b):\n", "--max-new-tokens", "6",
                        "--device", "cpu")  # fmt: skip
    assert rc == 0 and "--prompt: the newline at its end is dropped" in err
    assert _stream_of(out, "ddtree").startswith("\n    ")  # the body, indented
