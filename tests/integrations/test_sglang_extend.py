"""SGLang's Triton extend-attention kernel, the peer of our verify attention (bench/sglang_extend.py: the
port's extend_attention.py and the two files it imports, loaded by path with a stub for what they take
from sglang.srt.utils), on the inputs the port's Triton backend passes it for a DDTree target verify.

With KDTREE_SGLANG_DDTREE naming a checkout that holds those files (scripts/fetch_peers.sh; skipped
otherwise): on the CPU the kernel runs through the Triton interpreter and equals our reference
(ref.mla_attention.tree_mla_attention) on random trees over ragged prefixes (0 and 1 included), small
head dims and Kimi's 576 / 512, float32 and bf16, trees wider than one of its query blocks, causal as the
port passes it and not; the dense mask built from our trees equals the packed mask of the port's own
compile. On the GPU (-m gpu) at Kimi dims in bf16 it equals our kernel, and one point of the bench's
verify-attention section runs (both sides captured in CUDA graphs).
Without the checkout: the inputs' construction (pool, req_to_token, kv indices, indptrs, mask layout)
against a plain-torch reading of the kernel's documented semantics, the loader's errors on stand-in
files, our backend as the bench drives it, and the section's arithmetic and report.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import pytest
import torch

from kdtree_engine.bench.attention import _tree_visibility
from kdtree_engine.bench.sglang_extend import (
    KEYWORDS,
    PEER_FILES,
    POSITIONAL,
    dense_custom_mask,
    extend_call,
    load_extend_attention,
    make_token_pool,
    mask_indptr,
    prefix_kv_indices,
)
from kdtree_engine.ref.mla_attention import tree_mla_attention

_LOADED: dict[Path, object] = {}


def extend_fn():
    """extend_attention_fwd from the port's checkout (KDTREE_SGLANG_DDTREE), loaded once; skips when unset
    or when the checkout predates the attention files."""
    from .port import port_dir

    root = port_dir()
    missing = [str(f) for f in PEER_FILES if not (root / f).is_file()]
    if missing:
        pytest.skip(f"{root} lacks {missing}: run scripts/fetch_peers.sh again")
    if root not in _LOADED:
        _LOADED[root] = load_extend_attention(root)
    return _LOADED[root]


def problem(prefixes: list[int], t: int, h: int, d: int, dtype, device, seed: int = 0):
    """(pool, q [b, t, h, d], visibility [b, t, t]): random rows in a scattered token pool, random trees."""
    gen = torch.Generator().manual_seed(seed)
    b = len(prefixes)
    kv = torch.randn(b, max(prefixes) + t, d, generator=gen).to(device=device, dtype=dtype)
    pool = make_token_pool(kv, torch.tensor(prefixes, dtype=torch.int32), t, gen=gen)
    q = torch.randn(b, t, h, d, generator=gen).to(device=device, dtype=dtype)
    return pool, q, _tree_visibility(b, t, gen).to(device)


def reference(pool, q, vis, scale: float, d_v: int) -> torch.Tensor:
    """Our reference on the pool read as pages of one slot through req_to_token: [b t, h, d_v] float."""
    lengths = pool.prefix_lens + pool.t
    table = pool.rows(int(lengths.max()))
    out, _ = tree_mla_attention(q, pool.kv, lengths, vis, scale, d_v, block_table=table)
    return out.reshape(-1, q.shape[2], d_v)


def run_extend(fn, call) -> torch.Tensor:
    with warnings.catch_warnings():  # the interpreter divides the unused rows of a query block by 0
        warnings.simplefilter("ignore", RuntimeWarning)
        return call(fn).float()


# ---- the kernel (needs the checkout) -------------------------------------------------------------------
CASES = {  # name: (d, d_v, h, t, prefixes, dtype, causal)
    "small dims": (32, 16, 2, 5, [0, 1, 37, 5], torch.float32, True),
    "small dims, not causal": (32, 16, 2, 5, [0, 1, 37, 5], torch.float32, False),
    "small dims, t=33": (32, 16, 3, 33, [1, 64, 0], torch.float32, True),
    "kimi dims, t over a query block": (576, 512, 2, 33, [0, 40], torch.float32, True),
    "kimi dims, bf16": (576, 512, 2, 9, [1, 31, 0], torch.bfloat16, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_extend_kernel_equals_the_reference(case, device):
    d, d_v, h, t, prefixes, dtype, causal = CASES[case]
    fn = extend_fn()
    pool, q, vis = problem(prefixes, t, h, d, dtype, device, seed=len(case))
    scale = d**-0.5
    call = extend_call(pool, q, vis, scale, d_v)
    call.is_causal = causal
    got = run_extend(fn, call)
    want = reference(pool, q, vis, scale, d_v)
    tol = 2e-2 if dtype == torch.bfloat16 else (5e-3 if device.type == "cuda" else 1e-5)  # tf32 dots on GPUs
    err = float((got - want).abs().max())
    assert err <= tol, f"{case}: max difference {err:.3g} > {tol}"


def test_the_dense_mask_is_the_ports_packed_mask():
    """For full trees, the mask built from our visibility (prefix columns all allowed) is the one the
    port's compile packs for its Triton backend, byte for byte, and mask_indptr indexes its blocks."""
    from .port import port_utils

    utils = port_utils()
    gen = torch.Generator().manual_seed(3)
    t, prefixes = 9, torch.tensor([40, 0, 1, 13])
    b = len(prefixes)
    vis = _tree_visibility(b, t, gen)
    _, _, packed, _ = utils._compile_ddtree_tree_torch(
        root_token_ids=torch.zeros(b, dtype=torch.long),
        node_token_ids=torch.zeros(b, t - 1, dtype=torch.long),
        node_depths=(vis[:, 1:, :].sum(-1) - 1).long(), visibility=vis.clone(), start_positions=prefixes,
        past_lengths=prefixes, tree_budget=t - 1, actual_tree_sizes=torch.full((b,), t),
        device=torch.device("cpu"), past_lens_cpu=prefixes.tolist(), actual_sizes_cpu=[t] * b,
        verify_token_num=t, build_attention_mask=True,
    )  # fmt: skip
    ours = dense_custom_mask(vis, prefixes)
    assert torch.equal(ours, packed)
    assert int(mask_indptr(prefixes, t)[-1]) == packed.numel()


# ---- the inputs, without the checkout ------------------------------------------------------------------
def extend_semantics(call) -> torch.Tensor:
    """What extend_attention_fwd computes, read from its docstring and arguments: request r's queries
    q_extend[qo_indptr[r]:qo_indptr[r + 1]] attend to its prefix rows k_buffer[kv_indices[kv_indptr[r]:
    kv_indptr[r + 1]]] and its own k_extend rows, allowed where custom_mask's row-major
    [t, prefix + t] block at mask_indptr[r] is True; values v_buffer / v_extend. [b t, h, d_v] float."""
    outs = []
    for r in range(call.qo_indptr.shape[0] - 1):
        q0, q1 = int(call.qo_indptr[r]), int(call.qo_indptr[r + 1])
        k0, k1 = int(call.kv_indptr[r]), int(call.kv_indptr[r + 1])
        slots = call.kv_indices[k0:k1]
        keys = torch.cat([call.k_buffer[slots, 0], call.k_extend[q0:q1, 0]]).float()
        values = torch.cat([call.v_buffer[slots, 0], call.v_extend[q0:q1, 0]]).float()
        m0, n = int(call.mask_indptr[r]), keys.shape[0]
        allowed = call.custom_mask[m0 : m0 + (q1 - q0) * n].view(q1 - q0, n)
        scores = torch.einsum("thd,sd->ths", call.q_extend[q0:q1].float(), keys) * call.sm_scale
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        outs.append(torch.einsum("ths,sd->thd", scores.softmax(-1), values))
    return torch.cat(outs)


def test_the_inputs_read_as_the_kernel_documents_them_are_our_problem():
    pool, q, vis = problem([0, 1, 37, 5, 64], 7, 3, 24, torch.float32, "cpu", seed=5)
    call = extend_call(pool, q, vis, 0.2, 16)
    torch.testing.assert_close(extend_semantics(call), reference(pool, q, vis, 0.2, 16), atol=1e-5, rtol=1e-5)


def test_the_inputs_are_laid_out_as_the_ports_triton_backend_passes_them():
    prefixes, t, d, d_v = [3, 0, 1, 10], 4, 24, 16
    pool, q, vis = problem(prefixes, t, 2, d, torch.float32, "cpu", seed=6)
    call = extend_call(pool, q, vis, 0.25, d_v)
    assert call.is_causal and call.max_len_extend == t and call.sm_scale == 0.25
    assert call.qo_indptr.dtype == torch.int32 and call.qo_indptr.tolist() == [0, 4, 8, 12, 16]
    assert call.kv_indptr.dtype == torch.int32 and call.kv_indptr.tolist() == [0, 3, 3, 4, 14]
    assert call.mask_indptr.dtype == torch.int64
    assert call.mask_indptr.tolist() == [0, 28, 44, 64, 120]  # t (prefix + t) per request
    assert call.kv_indices.dtype == torch.int64 and call.custom_mask.dtype == torch.bool
    want = torch.cat([pool.req_to_token[pool.req_pool_indices[r], :p] for r, p in enumerate(prefixes)])
    assert torch.equal(call.kv_indices, want.long())
    assert 0 not in call.kv_indices.tolist() and 0 not in pool.tree_slots().tolist()  # slot 0: padding
    # v_buffer is the pool's first d_v columns, in place; k / v_extend are the tree's rows of the pool
    assert call.v_buffer.data_ptr() == call.k_buffer.data_ptr() and call.v_buffer.shape[-1] == d_v
    assert torch.equal(call.k_extend[:, 0], pool.kv[pool.tree_slots(), 0])
    assert torch.equal(call.v_extend, call.k_extend[..., :d_v]) and call.v_extend.is_contiguous()
    # mask: prefix columns all allowed, tree columns the visibility
    block = call.custom_mask[28:44].view(t, 0 + t)
    assert torch.equal(block, vis[1])
    block = call.custom_mask[64:120].view(t, 10 + t)
    assert block[:, :10].all() and torch.equal(block[:, 10:], vis[3])


def test_prefix_kv_indices_with_host_bounds_over_the_prefixes():
    pool, _, _ = problem([5, 0, 2], 3, 1, 8, torch.float32, "cpu", seed=7)
    kv_indptr, kv_indices = prefix_kv_indices(pool, max_prefix=9, total=7)  # bounds above the batch's
    assert kv_indptr.tolist() == [0, 5, 5, 7]
    rows = pool.req_to_token[pool.req_pool_indices]
    want = torch.cat([rows[0, :5], rows[2, :2]])
    assert torch.equal(kv_indices, want.long())


# ---- the loader, on stand-in files ---------------------------------------------------------------------
def stand_in_checkout(root: Path, params: list[str], extra_import: str = "") -> Path:
    """Three files at the port's paths, written here (not the port's code): extend_attention.py imports
    what the real one imports and defines extend_attention_fwd(*params)."""
    folder = root / PEER_FILES[0].parent
    folder.mkdir(parents=True)
    (folder / "decode_attention.py").write_text(
        "from sglang.srt.utils import is_hip\n\ndef _extract_kv_strides(buf, page_size):\n    return 0\n"
    )
    (folder / "prefill_attention.py").write_text(
        "from sglang.srt.utils import is_cuda, is_hip\n\ndef context_attention_fwd():\n    pass\n"
    )
    (folder / "extend_attention.py").write_text(
        "from sglang.kernels.ops.attention.decode_attention import _extract_kv_strides\n"
        "from sglang.kernels.ops.attention.prefill_attention import context_attention_fwd\n"
        "from sglang.srt.utils import is_cuda, is_gfx95_supported, is_hip\n" + extra_import + "\n"
        f"def extend_attention_fwd({', '.join(params)}):\n"
        "    return is_cuda(), is_hip(), is_gfx95_supported()\n"
    )
    return root


def test_the_loader_runs_the_files_with_stubs_and_leaves_no_module_behind(tmp_path):
    params = [*POSITIONAL, *(f"{k}=None" for k in KEYWORDS), "lse_extend=None"]
    before = {k for k in sys.modules if k == "sglang" or k.startswith("sglang.")}
    fn = load_extend_attention(stand_in_checkout(tmp_path, params))
    assert fn(*range(len(POSITIONAL))) == (torch.cuda.is_available() and torch.version.cuda is not None,
                                           torch.version.hip is not None, False)  # fmt: skip
    assert {k for k in sys.modules if k == "sglang" or k.startswith("sglang.")} == before


@pytest.mark.parametrize(
    "params, extra, match",
    [
        (None, "", "path: no python/sglang/kernels/ops/attention/extend_attention.py"),
        (list(POSITIONAL), "", "path: .*extend_attention_fwd takes"),  # the keywords gone
        (["q", *POSITIONAL[1:], *KEYWORDS], "", "path: .*extend_attention_fwd takes"),  # a renamed one
        ([*POSITIONAL, *KEYWORDS], "from sglang.srt.layers import something\n", "path: .*needs a module"),
    ],
)
def test_the_loader_names_the_path_when_the_checkout_differs(tmp_path, params, extra, match):
    root = tmp_path if params is None else stand_in_checkout(tmp_path, params, extra)
    with pytest.raises(ValueError, match=match):
        load_extend_attention(root)


def test_the_bench_skips_the_section_only_where_the_tree_path_still_runs(tmp_path, capsys):
    from kdtree_engine.bench.sglang import TREE, VERIFY, load_verify_peer

    assert load_verify_peer(argparse.Namespace(sections=[TREE], port=tmp_path)) is None
    assert load_verify_peer(argparse.Namespace(sections=[TREE, VERIFY], port=tmp_path)) is None
    assert "verify attention: skipped: path: no" in capsys.readouterr().out
    with pytest.raises(ValueError, match="path: no"):
        load_verify_peer(argparse.Namespace(sections=[VERIFY], port=tmp_path))


# ---- the bench section ---------------------------------------------------------------------------------
def test_our_backend_as_the_bench_drives_it_is_the_reference():
    """OursVerify: our kdtree_mla backend on stand-ins for the runner, batch and layer (CPU: the Triton
    kernels in the interpreter): a step (metadata, plan, run) and a later layer's run."""
    from kdtree_engine.bench.sglang_verify import OursVerify

    pool, q, vis = problem([0, 1, 37], 5, 2, 32, torch.float32, "cpu", seed=9)
    ours = OursVerify.make(pool, q, vis, 0.2, 16, impl="triton")
    want = reference(pool, q, vis, 0.2, 16).reshape(15, -1)
    torch.testing.assert_close(ours.step(), want, atol=1e-5, rtol=1e-5)
    plan = ours.backend.forward_metadata.plan
    torch.testing.assert_close(ours.run(), want, atol=1e-5, rtol=1e-5)
    assert ours.backend.forward_metadata.plan is plan and ours.kernel == "triton"


def test_the_sections_saving_per_round_and_report():
    from kdtree_engine.bench.sglang_verify import VerifyGrid, report, with_derived

    row = {"h": 8, "t": 33, "prefix": 4096, "batch": 16, "kernel": "hopper", "max_diff": 1e-4,
           "mask_equal": True, "port_step_us": 1000.0, "port_kernel_us": 900.0, "ours_step_us": 60.0,
           "ours_run_us": 40.0}  # fmt: skip
    row = with_derived(row, layers=61)
    assert row["step_x"] == pytest.approx(1000 / 60) and row["layer_x"] == pytest.approx(900 / 40)
    assert row["saved_round_ms"] == pytest.approx((100 - 20 + 61 * 860) / 1e3)
    slow = with_derived({**row, "prefix": 1024, "port_step_us": 240.0}, layers=61)  # 4x
    tree = [{"batch": 16, "budget": 32, "port greedy path": 3400.0, "ours greedy path": 200.0}]
    text = report([row, slow], tree)
    assert "| 8 | 33 | 4096 | 16 | 1 | hopper |" in text and f"{row['saved_round_ms']:.2f} | 3.20 |" in text
    assert f"{row['saved_round_ms'] + 3.2:.2f}" in text
    assert ">= 5x at 1/2 points, >= 10x at 1/1 points" in text and "lowest 4.0x" in text
    assert VerifyGrid().layers == 61 and len(list(VerifyGrid().points())) == 3 * 3 * 4 * 3
    with pytest.raises(ValueError, match="heads"):
        VerifyGrid(heads=())


@pytest.mark.parametrize("page", [1, 3, 64])
def test_the_pool_hands_out_whole_pages_in_order(page):
    """make_token_pool: a request's rows fill its pages in order (req_to_token[r, p * page + o] is
    page_id * page + o), page 0 (the padding) goes to nobody, no page is shared, and the pool holds the
    problem's rows where req_to_token says."""
    gen = torch.Generator().manual_seed(page)
    prefixes, t = [0, 5, 130], 3
    kv = torch.randn(3, max(prefixes) + t, 8, generator=gen)
    pool = make_token_pool(kv, torch.tensor(prefixes, dtype=torch.int32), t, page=page, gen=gen)
    assert pool.page == page and pool.kv.shape[0] % page == 0
    seen = set()
    for r, n in enumerate(p + t for p in prefixes):
        slots = pool.req_to_token[pool.req_pool_indices[r], :n].long()
        assert torch.equal(slots % page, torch.arange(n) % page)
        pages = (slots // page)[::page]
        assert torch.equal(slots // page, pages.repeat_interleave(page)[:n]) and 0 not in pages.tolist()
        assert not seen & set(pages.tolist())
        seen |= set(pages.tolist())
        assert torch.equal(pool.kv[slots, 0], kv[r, :n])
    with pytest.raises(ValueError, match="^page"):
        make_token_pool(kv, torch.tensor(prefixes, dtype=torch.int32), t, page=0)


def stand_in_compile(*, visibility, past_lengths, tree_attention_mask, **_):
    """The port's compile_ddtree_tree_triton (CUDA only) as far as the section reads it: the packed mask of
    full trees, written into its buffer (the previous test checks that layout against the port's)."""
    if tree_attention_mask is not None:
        tree_attention_mask.copy_(dense_custom_mask(visibility, past_lengths.cpu()))


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_the_section_runs_its_points_off_the_gpu_with_the_timer_stubbed(tmp_path, monkeypatch, capsys):
    """run_section and the report files, on the CPU: the Triton kernels in the interpreter, the port's
    compile by a stand-in and time_graph (CUDA graphs) by a stub; a point over the memory bound skipped."""
    from kdtree_engine.bench import sglang, sglang_verify, timing

    fn = extend_fn()
    calls = []

    def fake_time_graph(f, **_):
        calls.append(f())
        return timing.Timing(10.0 if len(calls) % 2 else 2.0, 0, 0, 1, "graph")

    monkeypatch.setattr(timing, "time_graph", fake_time_graph)
    grid = sglang_verify.VerifyGrid(heads=(2,), tokens=(3,), prefixes=(64, 1 << 20), batch=(2,),
                                    pages=(1, 16), max_gb=0.5)  # fmt: skip
    rows = sglang_verify.run_section(fn, stand_in_compile, grid, torch.device("cpu"), on_row=lambda r: None)
    assert "prefix=1048576 b=2 page=16 skipped" in capsys.readouterr().out
    assert [row["page"] for row in rows] == [1, 16] and len(calls) == 8
    for row in rows:  # both sides on the same pool of 1- or 16-slot pages
        assert row["mask_equal"] and row["max_diff"] <= 2e-2
        assert row["port_step_us"] == 10.0 and row["port_kernel_us"] == 2.0 and row["step_x"] == 1.0
    results = {"header": "h", "rows": [], "verify_attention": rows}
    text = sglang.write_results(results, tmp_path)
    assert "## Verify attention" in text and (tmp_path / "sglang_bench.md").read_text() == text
    assert "verify_attention" in (tmp_path / "sglang_bench.json").read_text()


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_the_section_adds_flashmlas_cascade_on_64_slot_pages(monkeypatch):
    """With a flash_mla module (a stand-in computing its dense decode by our reference), points on 64-slot
    pages also time FlashMLA's cascade on the same pool (prefix by FlashMLA through a block table read
    from req_to_token, tree by ours, merged by lse), equal to the port's output; points on pages of 1
    do not; the report shows it next to our per-layer time."""
    from kdtree_engine.bench import sglang, sglang_verify, timing
    from tests.bench.test_flashmla_peer import _stand_in

    fn, flash = extend_fn(), _stand_in()
    monkeypatch.setattr(timing, "time_graph", lambda f, **_: (f(), timing.Timing(8.0, 0, 0, 1, "graph"))[1])
    grid = sglang_verify.VerifyGrid(heads=(2,), tokens=(3,), prefixes=(70,), batch=(2,), pages=(1, 64))
    rows = sglang_verify.run_section(fn, stand_in_compile, grid, torch.device("cpu"), lambda r: None, flash)
    assert [("cascade_us" in r) for r in rows] == [False, True] and set(flash.calls) == {False}  # no mask
    assert rows[1]["cascade_diff"] <= 2e-2 and rows[1]["cascade_us"] == 8.0
    assert "| 8.0 (1.00x) |" in sglang_verify.report(rows, [])
    assert sglang.verify_flashmla(sglang_verify.VerifyGrid(pages=(1,))) is None


# ---- on the GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("h", [8, 64])
@pytest.mark.parametrize("t", [9, 33])
def test_the_extend_kernel_equals_our_kernel_at_kimi_dims(h, t):
    """bf16, d = 576, d_v = 512, prefixes 1k-4k: SGLang's kernel and ours (as our backend plans it: the
    pool as pages of one slot, the block table from req_to_token) on the same pool and trees."""
    from kdtree_engine.attention import tree_mla_attention as ours_attention

    fn = extend_fn()
    pool, q, vis = problem([1024, 4096, 2500], t, h, 576, torch.bfloat16, torch.device("cuda"), seed=h + t)
    scale = 192**-0.5
    got = run_extend(fn, extend_call(pool, q, vis, scale, 512))
    lengths = pool.prefix_lens + t
    ours, _ = ours_attention(q, pool.kv, lengths, softmax_scale=scale, d_v=512, visibility=vis,
                             block_table=pool.rows(int(lengths.max())))  # fmt: skip
    ours = ours.float().reshape(got.shape)
    want = reference(pool, q, vis, scale, 512)
    assert float((got - ours).abs().max()) <= 1e-2
    assert max(float((got - want).abs().max()), float((ours - want).abs().max())) <= 1e-2


@pytest.mark.gpu
def test_one_point_of_the_verify_section_runs():
    """time_point at a small point: both sides captured and replayed, the port's mask (its compile's
    Triton kernel) equal to ours, the outputs equal within bf16 tolerance."""
    from kdtree_engine.bench.peers import load_sglang_port
    from kdtree_engine.bench.sglang_verify import VerifyGrid, time_point

    from .port import port_dir

    fn = extend_fn()
    port = load_sglang_port(port_dir())
    grid = VerifyGrid(heads=(8,), tokens=(9,), prefixes=(1024,), batch=(2,), rep_ms=5)
    row = time_point(fn, port.kernels.compile_ddtree_tree_triton, 8, 9, 1024, 2, grid, torch.device("cuda"))
    assert row["mask_equal"] and row["max_diff"] <= 1e-2
    assert all(row[k] > 0 for k in ("port_step_us", "port_kernel_us", "ours_step_us", "ours_run_us"))
