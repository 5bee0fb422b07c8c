"""scripts/step_cost_ab.py's figures on the CPU: a call's step is the median of its bucket-0 rounds only
(every round for plain decoding, which has no buckets), NaN intervals dropped; the kernel table puts the
largest difference first and counts a kernel one side lacks as zero; bad arguments are one line on
stderr with exit code 2."""

import math
from types import SimpleNamespace

from tests.bench.scripts import assert_one_line_error, load_script


def _stats(budgets, seconds, wall=1.0, capture=0.25):
    return SimpleNamespace(budgets=budgets, round_seconds=seconds, wall_time=wall, capture_time=capture,
                           rounds=len(seconds))  # fmt: skip


def test_a_calls_step_is_the_median_of_its_steps_alone():
    ab = load_script("step_cost_ab")
    nan = float("nan")
    got = ab.call_figures(_stats([8, 0, 0, 0, 8, 0], [nan, 3e-3, 1e-3, nan, 9e-3, 2e-3]))
    assert got["step_ms"] == 2.0 and got["steps"] == 3
    assert got["round_ms"] == 2.5 and got["call_ms"] == 750.0 and got["rounds"] == 6
    plain = ab.call_figures(_stats([], [nan, 4e-3, 1e-3, 2e-3]))  # plain decoding: every round a step
    assert plain["step_ms"] == 2.0 == plain["round_ms"] and plain["steps"] == 3
    assert math.isnan(ab.call_figures(_stats([8], [1e-3]))["step_ms"])


def test_the_kernel_table_puts_the_largest_difference_first():
    ab = load_script("step_cost_ab")
    ar = {"gemm": (10, 100.0), "copy": (2, 4.0)}
    auto = {"gemm": (10, 101.0), "copy": (2, 4.0), "cat": (5, 20.0)}
    lines = ab.kernel_diff(ar, auto)
    assert lines[0] == "  total device us: ar 104, auto 125"
    assert lines[1].split()[0] == "cat" and "ar     0 x       0.0 us" in lines[1]
    assert [line.split()[0] for line in lines[1:]] == ["cat", "gemm", "copy"]


def test_bad_arguments_are_one_line_and_exit_2():
    for argv, option in ((["--batch", "0"], "--batch"), (["--temperature", "-1"], "--temperature")):
        assert_one_line_error("step_cost_ab", argv, option)
