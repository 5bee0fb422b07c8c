"""Switch SGLang's DDTree port onto our tree path without editing its files.

Two ways, both calling `install()`:
- the plug-in: kdtree-engine declares `kdtree_ddtree = kdtree_engine.integrations.sglang.plugin:load`
  in SGLang's `sglang.srt.plugins` entry-point group; SGLang runs `load()` in every process it starts,
  and `load()` installs when the environment has KDTREE_ENGINE_SGLANG=1 (else it does nothing, so that
  merely installing kdtree-engine changes nothing);
- one line before SGLang starts: `import kdtree_engine.integrations.sglang as k; k.install()`.

`install()` replaces, in `sglang.srt.speculative.ddtree_utils`, the port's four tree-path functions
with ours; rebinds them in every loaded `sglang.srt.speculative` module that imported them by name;
and replaces the worker's draft top-k method on every class that defines it. Where the port has
SGLang's attention registry, it also registers our MLA attention backend as `kdtree_mla` and extends
the port's DDTree capability check so that the worker hands that backend the tree
(kdtree_engine.integrations.sglang.attention). It checks the port first: a function or hook missing,
or with parameters other than ours, is a clear error naming it (the port moved on; PORT_CHECKED names
the revision this was checked against).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys

PORT_CHECKED = "Rancy-Wang/sglang branch ddtree-v2 at 433c58ed70cd1dabe5a07a83da12f1513cd599ae"
UTILS = "sglang.srt.speculative.ddtree_utils"
WORKERS = ("sglang.srt.speculative.ddtree_worker_v2", "sglang.srt.speculative.ddtree_worker")
FUNCTIONS = ("build_ddtree_tree_gpu", "compile_ddtree_tree", "follow_verified_tree_gpu",
             "sample_ddtree_target_probs_gpu")  # fmt: skip
METHOD = "_compute_draft_topk_log_probs_and_token_ids"
ATTENTION_REGISTRY = "sglang.srt.layers.attention.attention_registry"
ENV = "KDTREE_ENGINE_SGLANG"


def _ours() -> dict:
    from kdtree_engine.integrations import sglang as ours

    return {name: getattr(ours, name) for name in FUNCTIONS}


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _check_port(utils, ours: dict) -> None:
    """ValueError naming every port function that is missing or whose parameters differ from ours."""
    problems = []
    for name, fn in ours.items():
        theirs = getattr(utils, name, None)
        if not callable(theirs):
            problems.append(f"{name} is missing")
        elif getattr(theirs, "__module__", "").startswith("kdtree_engine"):
            continue  # installed already
        elif _params(theirs) != _params(fn):
            problems.append(f"{name} takes {_params(theirs)}, ours takes {_params(fn)}")
    if problems:
        raise ValueError(
            f"{UTILS}: not the SGLang DDTree port this drop-in was checked against ({PORT_CHECKED}): "
            + "; ".join(problems)
        )


def _rebind_imported(originals: dict, ours: dict) -> list[str]:
    """Modules that did `from ddtree_utils import name` hold the original objects: point them at ours."""
    rebound = []
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("sglang.srt.speculative.") or module is None:
            continue
        for name, original in originals.items():
            if getattr(module, name, None) is original:
                setattr(module, name, ours[name])
                rebound.append(f"{mod_name}.{name}")
    return rebound


def _import_workers() -> None:
    """The worker modules, imported before the swap so that their imported names are rebound (and listed)."""
    for name in WORKERS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a port without this worker


def _patch_workers() -> list[str]:
    """The draft top-k method on every loaded speculative class that defines it."""
    from kdtree_engine.integrations.sglang.topk import compute_draft_topk_log_probs_and_token_ids

    patched = []
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("sglang.srt.speculative.") or module is None:
            continue
        for obj in list(vars(module).values()):
            if inspect.isclass(obj) and METHOD in vars(obj) and obj.__module__ == mod_name:
                setattr(obj, METHOD, compute_draft_topk_log_probs_and_token_ids)
                patched.append(f"{mod_name}.{obj.__name__}.{METHOD}")
    return patched


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _install_attention(utils) -> list[str]:
    """Our MLA attention backend and the capability check that hands it the tree, where the port has
    SGLang's attention registry (a tree of the speculative modules alone has none: nothing to do)."""
    if not _has_module(ATTENTION_REGISTRY):
        return []
    from kdtree_engine.integrations.sglang import attention

    try:
        changed, swaps = attention.install(utils)
    except ValueError as exc:
        raise ValueError(f"{exc} (checked against {PORT_CHECKED})") from exc
    for name, (original, wrapped) in swaps.items():
        changed += _rebind_imported({name: original}, {name: wrapped})
    return changed


def install() -> list[str]:
    """Swaps our tree path into the SGLang DDTree port (see the module docstring); returns what it
    replaced, as dotted names. ValueError when SGLang or the port's functions are not as expected."""
    try:
        utils = importlib.import_module(UTILS)
    except ImportError as exc:
        raise ValueError(f"{UTILS}: cannot import the SGLang DDTree port ({PORT_CHECKED}): {exc}") from exc
    ours = _ours()
    _check_port(utils, ours)
    _import_workers()
    originals = {name: getattr(utils, name) for name in FUNCTIONS}
    for name, fn in ours.items():
        setattr(utils, name, fn)
    replaced = [f"{UTILS}.{name}" for name in FUNCTIONS]
    return replaced + _rebind_imported(originals, ours) + _patch_workers() + _install_attention(utils)


def load() -> None:
    """SGLang's plug-in hook: install() when KDTREE_ENGINE_SGLANG=1, else nothing."""
    if os.environ.get(ENV) == "1":
        replaced = install()
        print(f"kdtree-engine: DDTree tree path installed ({len(replaced)} replacements)", file=sys.stderr)
