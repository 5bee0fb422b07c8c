#!/usr/bin/env bash
# Builds the environment in which SGLang's DDTree port (Rancy-Wang/sglang, branch ddtree-v2) runs on the
# CPU with kdtree-engine inside it, for tests/integrations/sglang_live (issue 35). Nothing of SGLang is
# copied into this repository or edited: the port is read from PORT_CHECKOUT (a work tree at the pinned
# commit), and the changes it needs on the CPU are applied at run time by
# tests/integrations/sglang_live/harness.py.
#   scripts/sglang_live.sh PORT_CHECKOUT [ENV_DIR]     (ENV_DIR default: /work/sglang-live)
# Then:  KDTREE_SGLANG_LIVE=ENV_DIR ENV_DIR/venv/bin/python -m pytest tests/integrations/sglang_live -s
# Re-runnable: each step leaves a mark in ENV_DIR/done/ and is skipped when it is there. What it does:
#   1. libnuma-dev (apt), which sgl-kernel's CPU build links against;
#   2. ENV_DIR/venv with torch==2.13.0 (the CPU wheel that lies on this machine; the port pins 2.12.0,
#      which cannot be fetched; an unpinned torch would pull a multi-GB CUDA build);
#   3. the port's python/pyproject_cpu.toml dependencies, except torch, torchvision and torchaudio
#      (pinned to builds of other torch versions), under constraints that hold torch at 2.13.0;
#   4. torchvision 0.28.0 made importable on the CPU (see that step: PyPI's build for torch 2.13 is
#      CUDA's; SGLang and transformers import it at module level);
#   5. sgl-kernel's CPU wheel, built from a copy of the port's sgl-kernel/ with its pyproject_cpu.toml as
#      pyproject.toml (as the port's CPU docs do), cached in ENV_DIR/wheels by the port's commit;
#   6. the port's python/ on the venv's path (a .pth file: SGLang is not installed, so its checkout is
#      what runs), and kdtree-engine editable without dependencies (its entry point is SGLang's plug-in).
set -euo pipefail
PORT=$(realpath "${1:?usage: scripts/sglang_live.sh PORT_CHECKOUT [ENV_DIR]}")
ENV_DIR=$(realpath -m "${2:-/work/sglang-live}")
REPO=$(cd "$(dirname "$0")/.." && pwd)
case "$ENV_DIR/" in "$REPO"/*) echo "ENV_DIR must lie outside the repository ($REPO)" >&2; exit 2 ;; esac
[ -f "$PORT/python/pyproject_cpu.toml" ] || { echo "$PORT: not a checkout of the port" >&2; exit 2; }
COMMIT=$(git -C "$PORT" rev-parse HEAD)
PINNED=433c58ed70cd1dabe5a07a83da12f1513cd599ae  # kdtree_engine.integrations.sglang.plugin.PORT_CHECKED
[ "$COMMIT" = "$PINNED" ] || echo "warning: $PORT is at $COMMIT, not the pinned $PINNED" >&2
PY=$ENV_DIR/venv/bin/python
PIP=(pip_q install)  # quiet, without the warnings about this machine's local indexes
pip_q() { "$PY" -m pip -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
mkdir -p "$ENV_DIR/done" "$ENV_DIR/wheels"
step() { [ -f "$ENV_DIR/done/$1" ] && { echo "skip $1"; return 1; }; echo "== $1"; }
mark() { touch "$ENV_DIR/done/$1"; }

if step libnuma; then
  dpkg -s libnuma-dev >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q libnuma-dev; }
  mark libnuma
fi

if step venv; then
  python3 -m venv "$ENV_DIR/venv"
  "${PIP[@]}" --upgrade pip
  "${PIP[@]}" torch==2.13.0
  mark venv
fi

CONSTRAINTS=$ENV_DIR/constraints.txt
# torchvision pinned for timm, which needs one: unpinned, the newest would pull a CUDA torch 2.14
printf 'torch==2.13.0\ntorchvision==0.28.0\n' >"$CONSTRAINTS"
if step deps-$COMMIT; then
  "$PY" - "$PORT/python/pyproject_cpu.toml" >"$ENV_DIR/requirements.txt" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
skip = {"torch", "torchvision", "torchaudio"}
print("\n".join(d for d in deps if re.split(r"[<>=!~; \[]", d, maxsplit=1)[0] not in skip))
EOF
  "${PIP[@]}" -c "$CONSTRAINTS" -r "$ENV_DIR/requirements.txt"
  "${PIP[@]}" -c "$CONSTRAINTS" scikit-build-core cmake setuptools-scm
  mark deps-$COMMIT
fi

SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if step torchvision-cpu; then
  # PyPI's only torchvision for torch 2.13 (0.28.0; timm needs one) is a CUDA build: its _C.so needs
  # libtorch_cuda and cannot load. Without that file torchvision imports, except for its two modules that
  # register fake and autograd kernels for the ops _C.so would define ("operator torchvision::nms does
  # not exist"). A .pth line puts empty modules under those two names; `import torchvision` then works
  # (SGLang imports torchvision.io at module level, transformers its transforms), without its C++ ops,
  # which a text model never calls.
  "${PIP[@]}" --no-deps --force-reinstall torchvision==0.28.0
  rm -f "$SITE/torchvision/_C.so"
  echo 'import sys, types; sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")); sys.modules.setdefault("torchvision._autograd_registrations", types.ModuleType("torchvision._autograd_registrations"))' \
    >"$SITE/kdtree_torchvision_cpu.pth"
  mark torchvision-cpu
fi

if step sgl-kernel-$COMMIT; then
  wheel=$(ls "$ENV_DIR/wheels/$COMMIT"/*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    build=$ENV_DIR/build/sgl-kernel
    rm -rf "$build" && mkdir -p "$build"
    git -C "$PORT" archive "$COMMIT" sgl-kernel | tar -x -C "$build" --strip-components=1
    cp "$build/pyproject_cpu.toml" "$build/pyproject.toml"
    # --no-build-isolation: build against the venv's torch 2.13.0 (the file pins 2.12.0)
    MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip wheel -v --no-deps --no-build-isolation -w "$ENV_DIR/wheels/$COMMIT" "$build" \
      >"$ENV_DIR/sgl-kernel-build.log" 2>&1 || { tail -40 "$ENV_DIR/sgl-kernel-build.log"; exit 1; }
    wheel=$(ls "$ENV_DIR/wheels/$COMMIT"/*.whl | head -1)
  fi
  "${PIP[@]}" --no-deps --force-reinstall "$wheel"
  mark sgl-kernel-$COMMIT
fi

echo "$PORT/python" >"$SITE/sglang_port.pth"
# The live harness as an SGLang plug-in in every SGLang process (tests/integrations/sglang_live/harness.py):
# this repository's root on the path and an entry point in SGLang's group, declared by a bare dist-info.
echo "$REPO" >"$SITE/kdtree_sglang_live.pth"
INFO=$SITE/kdtree_sglang_live_harness-0.0.0.dist-info
mkdir -p "$INFO"
printf 'Metadata-Version: 2.1\nName: kdtree-sglang-live-harness\nVersion: 0.0.0\n' >"$INFO/METADATA"
printf '[sglang.srt.plugins]\nkdtree_sglang_live = tests.integrations.sglang_live.harness:load\n' \
  >"$INFO/entry_points.txt"
# ...and its hook that must run before SGLang is imported (harness.hide_amx), in every process, when asked.
echo 'import os; os.environ.get("KDTREE_SGLANG_LIVE_AMX_OFF") == "1" and __import__("tests.integrations.sglang_live.harness").integrations.sglang_live.harness.hide_amx()' \
  >"$SITE/kdtree_sglang_live_early.pth"
echo "$COMMIT" >"$ENV_DIR/PORT_COMMIT"
if step kdtree-engine; then
  "${PIP[@]}" --no-deps -e "$REPO"
  mark kdtree-engine
fi
"$PY" -c 'import torch, sglang, sgl_kernel, kdtree_engine; print("torch", torch.__version__, "| sglang from", sglang.__file__)'
echo "ready: KDTREE_SGLANG_LIVE=$ENV_DIR $PY -m pytest tests/integrations/sglang_live -s"
