"""Kernels compiled for sm_90 as the package's own code launches them, on any machine.

The offline compile tests (offline_compile.py) build kernels from signatures written by hand, which say
nothing of what Triton specializes at a real launch: an int argument that is a multiple of 16 is marked
divisible by 16, a pointer aligned to 16 bytes likewise, and the vector width of every load, whether a
loop is software-pipelined and how many buffers it gets all follow from those marks. Here the real code
runs instead (a model forward, a draft, an attention plan) on CPU tensors with Triton's driver replaced
by an sm_90 target that compiles each launch and runs nothing (`JITFunction.run` with warmup=True), so
each kernel is compiled with exactly the specialization, constexprs, warps and stages its wrapper
chooses. The outputs are never computed (the tensors keep whatever memory held), so only code whose
launches do not depend on values read back on the host can be compiled this way: the captured forward
and draft qualify (they never read the device).

`run_launch_script(body)` runs PRELUDE + body in a fresh interpreter without the Triton interpreter and
returns the JSON object the body prints last. The body calls `launched()` for what was compiled since
the last call: {kernel name: [report, ...]}, one report per distinct compiled variant:

- shared (bytes), regs (per thread), local (spilled bytes), from the cubin;
- copy_buffers: the depth of each multi-buffered shared allocation the pipeliner made for async copies
  (1: a single buffer, refilled after use; 2 or more: copies in flight while an earlier tile is used);
- waits: the `num` of every async wait, in program order (a wait of 0 at the top of a loop leaves no
  copy in flight while the tile is used);
- loads_16bit: global loads of 16 bits (a bf16 or fp16 element at a time: Triton could not prove the
  rows aligned, usually because a stride was kept out of its specialization);
- loads: every global load instruction of the PTX with its count;
- constants: the launch's keyword arguments (constexprs, warps, stages).
"""

from __future__ import annotations

from tests.kernels.offline_compile import run_compile_script

PRELUDE = r"""
import collections, json, os, re, subprocess, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SMS = 132  # an H200's multiprocessors, for the launch heuristics that read them


class CompileForSm90:
    # Triton's driver interface as far as a warmup launch reads it.
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


driver.set_active(CompileForSm90())
_COMPILED = []
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    constants = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, str))}
    _COMPILED.append((self.fn.__name__, kernel, constants))
    return kernel


JITFunction.run = _compile_only
import kdtree_engine.impl as _impl
from kdtree_engine.kernels import _device

_impl.kernels_unavailable = lambda impl, device_type: False  # kernels "run" on CPU tensors here
_device.multiprocessors = lambda index: SMS
from kdtree_engine.kernels import mla_attention_merge as _merge

_round_shape = _merge._round_shape
_merge._round_shape = lambda pieces, on_gpu: _round_shape(pieces, True)  # the GPU's shape, not the CPU's


def report(kernel):
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"]); f.flush()
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    loads = collections.Counter(re.findall(r"ld\.global[.\w]*", ptx))
    return {
        "shared": kernel.metadata.shared,
        "regs": int(re.search(r"REG:(\d+)", res).group(1)),
        "local": int(re.search(r"LOCAL:(\d+)", res).group(1)),
        "copy_buffers": [int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+", ttgir)],
        "waits": [int(n) for n in re.findall(r"async_wait[^{]*\{num = (\d+)", ttgir)],
        "loads_16bit": sum(n for op, n in loads.items() if re.search(r"\.[bsuf]16$", op)),
        "loads": dict(loads),
    }


def launched():
    found, seen = {}, set()
    for name, kernel, constants in _COMPILED:
        if id(kernel) not in seen:
            seen.add(id(kernel))
            found.setdefault(name, []).append(dict(report(kernel), constants=constants))
    _COMPILED.clear()
    return found


def aligned(module):
    # Parameters in fresh allocations, as on the GPU (weights loaded from safetensors are views into
    # the mapped file, aligned to 8 bytes only).
    for p in module.parameters():
        p.data = p.data.clone()
    return module
"""


def run_launch_script(body: str) -> dict:
    """The JSON object that PRELUDE + body prints last (skips where Triton ships no ptxas)."""
    return run_compile_script(PRELUDE + body)
