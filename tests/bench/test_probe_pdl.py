"""scripts/probe_pdl.py on the CPU: its variants are the four it documents (plain first: the ratios are
against it), and bad arguments are one line on stderr with exit code 2 (it needs an sm_90 GPU to run)."""

from tests.bench.scripts import assert_cli_errors, load_script


def test_variants_start_with_the_plain_launch():
    probe = load_script("probe_pdl")
    assert list(probe.VARIANTS)[0] == "plain" and probe.VARIANTS["plain"] == (False, False, False, False)
    assert all(pdl and wait for pdl, wait, _, _ in list(probe.VARIANTS.values())[1:])


def test_command_line_errors_are_one_line_and_exit_2():
    assert_cli_errors("probe_pdl", ["--launches", "1"], "--launches")
