"""scripts/probe_router_launch.py on the CPU (the Triton interpreter, a stand-in timer): each candidate
launch reaches router_logits and is undone, the partial logits stay those of the default launch, and
bad arguments are one line on stderr with exit code 2."""

import pytest
import torch

from tests.bench.scripts import assert_cli_errors, load_script


@pytest.fixture(scope="module")
def probe():
    return load_script("probe_router_launch")


def test_candidates_reach_the_launch_and_keep_the_logits(probe, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kdtree_engine.kernels import moe_router

    launches = []
    real = moe_router._logits_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((grid, kw["BLOCK_E"], kw["BLOCK_K"], kw["num_warps"]))
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(moe_router, "_logits_kernel", Spy())
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, 512, generator=gen), torch.randn(32, 512, generator=gen)
    route_args = dict(
        bias=torch.zeros(32), n_group=1, topk_group=1, top_k=4, norm_topk_prob=True, scaling=1.0
    )
    rows = probe.compare(
        x, weight, route_args, [(32, 32, 2), (32, 32, 2, 128)], lambda call: call() is not None and 1.0
    )
    assert [r["candidate"] for r in rows] == [None, (32, 32, 2), (32, 32, 2, 128)]
    assert [r["same"] for r in rows] == [True, True, False]
    assert launches[0][1:] == (16, 32, 1) and launches[4][1:] == (32, 32, 2) and launches[4][0][2] == 1
    assert launches[-1][0][1] == 4  # 512 / 128 partial logits
    with probe.forced((32, 32, 2, 128)):
        forced = moe_router.router_logits(x, weight)
    assert torch.allclose(forced.sum(0), moe_router.router_logits(x, weight).sum(0), rtol=1e-5, atol=1e-5)
    assert moe_router.logit_launch(512, 32) == moe_router.LogitLaunch(32, 16, 32, 1)  # undone
    with probe.forced((16, 64, 1)), pytest.raises(ValueError, match="does not divide the chunk"):
        moe_router.router_logits(x, weight)


def test_command_line_errors_are_one_line_and_exit_2():
    assert_cli_errors("probe_router_launch", ["--candidates", "1,2"], "--candidates")
