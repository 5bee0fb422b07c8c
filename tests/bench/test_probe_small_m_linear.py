"""scripts/probe_small_m_linear.py on the CPU (the Triton interpreter, a stand-in timer, one small
stand-in shape): each method and candidate launch runs on the same inputs and is checked against torch's,
a candidate reaches the small-M launch and is undone, and bad arguments are one line on stderr with exit
code 2."""

import pytest

from kdtree_engine.kernels import linear as kernels
from tests.bench.scripts import assert_cli_errors, load_script


@pytest.fixture(scope="module")
def probe():
    return load_script("probe_small_m_linear")


@pytest.mark.parametrize("heads", [0, 3])
def test_rows_cover_every_method_and_candidate(probe, monkeypatch, heads):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(probe.SHAPES, "stand-in", (heads, 40, 72))
    seen = []
    real = kernels._launch

    def spy(x, weight, bias, y, invariant):
        if not invariant:
            seen.append(kernels.small_m_launch(x.shape[1], weight.shape[1], x.shape[2], 2))
        return real(x, weight, bias, y, invariant)

    monkeypatch.setattr(kernels, "_launch", spy)
    rows = probe.rows_for("stand-in", 5, [(32, 16, 2, 3)], lambda fns: [f() for f in fns] and 2.0, "cpu")
    assert [r[2] for r in rows] == ["cuBLAS", "invariant", "small-M default", "32,16,2,3"]
    assert all(float(r[5]) < 2e-2 for r in rows)  # bf16 rounding, against torch's result
    assert kernels.Launch(32, 16, 2, 3, block_m=16) in seen
    assert (
        kernels.small_m_launch(5, 40, 72, 2).block_n != 32
        or kernels.small_m_launch(5, 40, 72, 2).block_k != 16
    )


def test_command_line_errors_are_one_line_and_exit_2():
    assert_cli_errors("probe_small_m_linear", ["--candidates", "16,100,4,4"], "--candidates")
    assert_cli_errors("probe_small_m_linear", ["--rows", "65"], "--rows")
