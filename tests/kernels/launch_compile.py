"""Kernels compiled for sm_90 as the package's own code launches them, on any machine.

The offline compile tests (offline_compile.py) build kernels from signatures written by hand, which say
nothing of what Triton specializes at a real launch: an int argument that is a multiple of 16 is marked
divisible by 16, a pointer aligned to 16 bytes likewise, and the vector width of every load, whether a
loop is software-pipelined and how many buffers it gets all follow from those marks. Here the real code
runs instead (a model forward, a draft, an attention plan) on CPU tensors with Triton's driver replaced
by an sm_90 target that compiles each launch and runs nothing (`JITFunction.run` with warmup=True), so
each kernel is compiled with exactly the specialization, constexprs, warps and stages its wrapper
chooses, by the pinned Triton (constraints.txt: 3.6.0, the H200 image's; another version's pipeliner may
place stages differently, which these tests would then report). The outputs are never computed (the
tensors keep whatever memory held), so only code whose launches do not depend on values read back on
the host can be compiled this way: the captured forward and draft qualify (they never read the
device).

`run_launch_script(body)` runs PRELUDE (offline_compile.BUILD's helpers, then the harness) + body in a
fresh interpreter without the Triton interpreter and returns the JSON object the body prints last. The
body calls `launched()` for what was compiled since the last call: {kernel name: [report, ...]}, one
report per distinct compiled variant:

- shared (bytes), regs (per thread), local (spilled bytes): BUILD's resources(kernel);
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

from tests.kernels.offline_compile import BUILD, run_compile_script

PRELUDE = (
    BUILD
    + r"""
import collections
import torch
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

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
    loads = collections.Counter(re.findall(r"ld\.global[.\w]*", ptx))
    return {
        **resources(kernel),
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
)

# The shapes that matter, each compiled as launched (test_launch_compile.py, scripts/compile_audit.py):
# one GPU's share of Kimi-K2 under 8-way tensor parallelism (hidden 7168, 8 MLA heads on a 512 + 64
# latent cache, a 1024-token prefix; 2 layers and 8 experts, which changes no kernel) at decode and at a
# 33-node verify, default and row-invariant; its DFlash drafter's share (8 query heads and 1 KV head of
# 128, an 8k context: cut into splits); the shipped kimi-nano pair; the attention at decode (h 8, t 1)
# and at a 9-node tree (h 64) on a contiguous cache and on pages of 64 and of 1 (SGLang's). bf16, batch
# 2. Prints {scenario: launched()}.
SCENARIOS = r"""
from types import SimpleNamespace
from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH
from kdtree_engine.attention import plan_attention
from kdtree_engine.bench.forward_cost import draft_call, forward_call
from kdtree_engine.bench.kimi_layer import KIMI_K2, Shard, drafter_shard
from kdtree_engine.drafter import load_drafter
from kdtree_engine.model.loader import load_model
from kdtree_engine.model.testing import random_model

bf = torch.bfloat16
found = {}
torch.manual_seed(0)
with torch.no_grad():
    kimi = KIMI_K2.replace(num_hidden_layers=2, num_attention_heads=8, n_routed_experts=8, vocab_size=4096,
                           intermediate_size=2048, moe_intermediate_size=256)
    target = aligned(random_model(kimi, dtype=bf))
    for t in (1, 33):
        forward_call(target, 2, t, 1024, "triton")()
        found[f"kimi t={t}"] = launched()
        cache = target.new_cache(2, 1024 + t)
        cache.seqlens.fill_(1024)
        target(torch.zeros(2, t, dtype=torch.long), cache, impl="triton", validate=False, row_invariant=True)
        found[f"kimi row-invariant t={t}"] = launched()
    drafter, stand_in = drafter_shard(Shard(), 1)
    drafter = aligned(drafter.to(bf))
    stand_in = SimpleNamespace(embed_tokens=aligned(stand_in.embed_tokens.to(bf)),
                               lm_head=aligned(stand_in.lm_head.to(bf)))
    b, block = 2, drafter.block_size
    cache = drafter.new_cache(b, 8192 + 2 * block)  # a context long enough to be cut into splits
    cache.seqlens.fill_(8192)
    lens = torch.full((b,), 3)
    context = torch.zeros(b, block, drafter.fc.in_features, dtype=bf)
    drafter.draft(stand_in, context, lens, torch.zeros(b, dtype=torch.long), cache.seqlens + lens, cache,
                  impl="triton")
    found["kimi drafter"] = launched()

    nano = aligned(load_model(KIMI_NANO, dtype=bf))
    nano_drafter = aligned(load_drafter(KIMI_NANO_DFLASH, dtype=bf))
    for t in (1, 33):
        forward_call(nano, 2, t, 256, "triton")()
        found[f"nano t={t}"] = launched()
    draft_call(nano_drafter, nano, 2, 256, "triton")[1]()
    found["nano drafter"] = launched()

    s = 4096
    for h, t in ((8, 1), (64, 9)):
        q = torch.zeros(2, t, h, 576, dtype=bf)
        for page in (0, 64, 1):
            table = None
            if page:
                kv = torch.zeros(2 * s // page, page, 576, dtype=bf)
                table = torch.arange(2 * s // page, dtype=torch.int32).view(2, -1)
            else:
                kv = torch.zeros(2, s, 576, dtype=bf)
            lengths = torch.full((2,), s, dtype=torch.int64)
            plan = plan_attention(q, kv, lengths, softmax_scale=0.1, d_v=512, block_table=table,
                                  impl="triton", validate=False)
            plan.run(q, kv)
            found[f"attention h={h} t={t} page={page}"] = launched()
print(json.dumps(found))
"""


def run_launch_script(body: str) -> dict:
    """The JSON object that PRELUDE + body prints last (skips where Triton ships no ptxas)."""
    return run_compile_script(PRELUDE + body)
