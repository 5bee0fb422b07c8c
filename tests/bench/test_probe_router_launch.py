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
    rows = probe.compare(x, weight, [(16, 256, 2)], lambda call: call() is not None and 1.0)
    assert [r["candidate"] for r in rows] == [None, (16, 256, 2)]
    assert launches[1][1:] == (32, 64, 4) and launches[-1][1:] == (16, 256, 2) and launches[-1][0][2] == 2
    with probe.forced((16, 256, 2)):
        forced = moe_router.router_logits(x, weight)
    assert torch.allclose(forced, moe_router.router_logits(x, weight), rtol=1e-5, atol=1e-5)
    assert moe_router.LOGIT_BLOCK_K == 64 and moe_router.logit_block_e(32) == 32  # undone


def test_command_line_errors_are_one_line_and_exit_2():
    assert_cli_errors("probe_router_launch", ["--candidates", "1,2"], "--candidates")
