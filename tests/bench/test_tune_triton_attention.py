"""scripts/tune_triton_attention.py on the CPU (the Triton interpreter, a stand-in timer): a forced launch
shape reaches the plan and is undone after, every candidate is compared with the default on the same
inputs, a malformed --configs entry is a ValueError naming it, and on the command line one line on
stderr with exit code 2 (so is a machine without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.bench.scripts import assert_cli_errors, load_script

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def tune():
    return load_script("tune_triton_attention")


def test_parse_config(tune):
    assert tune.parse_config("16,32,4,5") == tune.triton_attention.Config(16, 32, 4, 5)
    assert tune.parse_config("hopper") == tune.HOPPER
    for bad in ("16,32,4", "a,b,c,d", ""):
        with pytest.raises(ValueError, match="--configs"):
            tune.parse_config(bad)


def _plan(problem):
    from kdtree_engine.attention import plan_attention

    p = problem
    return plan_attention(p["q"], p["kv"], p["lengths"], softmax_scale=0.1, d_v=512, visibility=p["vis"],
                          block_table=p["block_table"], impl="triton")  # fmt: skip


def test_forced_config_reaches_the_plan_and_is_undone(tune):
    from kdtree_engine.bench.attention import make_problem

    problem = make_problem(1, 1, 2, 80, 16, torch.device("cpu"))
    default = _plan(problem).launch.config
    wanted = tune.triton_attention.Config(16, 32, 4, 7)
    with tune.forced(wanted):
        assert _plan(problem).launch.config == wanted
    assert _plan(problem).launch.config == default != wanted
    from kdtree_engine.kernels import mla_attention_hopper as hopper

    with tune.forced(tune.HOPPER):
        assert hopper.MIN_ROWS == 1
    assert hopper.MIN_ROWS == 17


@pytest.mark.parametrize("page", [0, 16])
def test_compare_times_every_candidate_on_the_same_inputs(tune, page):
    from kdtree_engine.bench.attention import make_problem

    problems = [make_problem(1, 1, 2, 80, page, torch.device("cpu"), seed=i) for i in range(2)]
    configs = [tune.parse_config("16,32,4,5"), tune.parse_config("16,64,4,5"), tune.HOPPER]
    timed = []
    rows = tune.compare(problems, configs, lambda calls: timed.append(len(calls)) or 1.0 + len(timed))
    assert [r["config"] for r in rows] == [None, *configs]
    assert timed == [2, 2, 2] and [r["us"] for r in rows] == [2.0, 3.0, 4.0, None]
    assert rows[0]["max_diff"] == 0.0
    assert all(r["max_diff"] < 2e-2 for r in rows[:3]) and rows[3]["max_diff"] is None  # no Hopper on a CPU


def test_command_line_errors_are_one_line_and_exit_2():
    assert_cli_errors("tune_triton_attention", ["--configs", "1,2"], "--configs")


def test_forced_splits_reach_the_plan_and_keep_the_output(tune):
    from kdtree_engine.bench.attention import make_problem

    problems = [make_problem(1, 1, 2, 80, 0, torch.device("cpu"))]
    rows = tune.compare(problems, [], lambda calls: 1.0, splits=(0, 1, 3))
    assert [(r["config"], r["splits"]) for r in rows] == [(None, 0), (None, 1), (None, 3)]
    assert all(r["max_diff"] < 2e-2 for r in rows)
    plans = tune.calls(problems, None, 3)
    assert len(plans) == 1
    from kdtree_engine.attention import plan_attention

    p = problems[0]
    plan = plan_attention(p["q"], p["kv"], p["lengths"], softmax_scale=tune.SCALE, d_v=tune.D_C,
                          visibility=p["vis"], impl="triton", num_splits=3)  # fmt: skip
    assert plan.launch.num_splits == 3
