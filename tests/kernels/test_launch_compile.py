"""The Triton kernels compiled for an H200 (sm_90) exactly as the package launches them, at the shapes
that matter (launch_compile.py: SCENARIOS, the real forward, draft and attention plans on CPU tensors,
every launch compiled and none run).

What a GPU run would only show as time: whether the kernels that stream weights or a cache read it
16 bytes at a time and keep a tile's copy in flight while the previous one is used. Each property
failed before the fix it holds in place: the paged decode attention had one tile buffer (refilled only
after use), the drafter's attention and the row-invariant projection read bf16 two bytes at a time
and synchronously, because strides kept out of Triton's specialization hid the rows' alignment
(docs/notes/kernels.md)."""

from __future__ import annotations

import pytest
from tests.kernels.launch_compile import SCENARIOS, run_launch_script
from tests.kernels.offline_compile import MAX_SHARED

# Kernels whose time is reading weights or a cache from memory, tile after tile.
STREAMING = (
    "_split_kv_kernel",
    "_drafter_attention_kernel",
    "_linear_kernel",
    "_gate_up_kernel",
    "_down_kernel",
    "_logits_kernel",
)


@pytest.fixture(scope="module")
def launches() -> dict:
    return run_launch_script(SCENARIOS)


def _reports(launches, names=None):
    for scenario, kernels in launches.items():
        for name, reports in kernels.items():
            if names is None or name in names:
                for report in reports:
                    yield f"{scenario}: {name} {report['constants']}", name, report


def test_every_scenario_launched_the_streaming_kernels(launches):
    assert len(launches) == 14
    launched = {name for _, name, _ in _reports(launches)}
    assert set(STREAMING) <= launched, set(STREAMING) - launched
    for h in (8, 64):
        for page in (0, 64, 1):
            assert "_split_kv_kernel" in launches[f"attention h={h} t={1 if h == 8 else 9} page={page}"]


def test_no_kernel_spills_or_overflows_shared_memory(launches):
    for where, _, report in _reports(launches):
        assert report["local"] == 0, f"{where}: spills {report}"
        assert report["shared"] <= MAX_SHARED, f"{where}: {report}"


def test_streaming_kernels_read_16_bytes_at_a_time(launches):
    """No 16-bit global load: bf16 tiles arrive as 16-byte vectors or asynchronous copies (the byte loads
    left are the tree mask's)."""
    for where, _, report in _reports(launches, STREAMING):
        assert report["loads_16bit"] == 0, f"{where}: {report['loads']}"


def test_streaming_kernels_keep_a_copy_in_flight(launches):
    """Every tile a streaming kernel loops over is copied asynchronously into two or more buffers, and the
    loop's first wait leaves copies in flight. The one exception is the Triton attention's 64-row launch
    (t * h > 16): two buffers, refilled once the P V product is issued (a third does not fit next to 64
    query rows of 576); on an H200 the Hopper kernel serves those calls unless the pages are not
    multiples of 64. The router's matmul reads its chunk in one step where the chunk is one BLOCK_K (a
    program per chunk and 16 experts: no loop to pipeline)."""
    for where, name, report in _reports(launches, STREAMING):
        if name == "_logits_kernel" and report["constants"]["CHUNK"] == report["constants"]["BLOCK_K"]:
            continue  # the router's matmul in one step per program (many small programs): no loop
        assert report["copy_buffers"] and min(report["copy_buffers"]) >= 2, f"{where}: {report}"
        if name == "_split_kv_kernel" and report["constants"]["BLOCK_M"] == 64:
            continue
        assert report["waits"][0] > 0, f"{where}: {report}"
