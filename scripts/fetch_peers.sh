#!/usr/bin/env bash
# Puts files of the SGLang DDTree port (Rancy-Wang/sglang, branch ddtree-v2) under .peers/sglang
# (git-ignored) for `kdtree-engine bench tree --peer sglang=... --peer sglang-triton=...`,
# `kdtree-engine bench sglang` and the peer tests (KDTREE_SGLANG_DDTREE=.peers/sglang).
# Only the files the adapters and tests import are extracted, at their paths in the repository:
#   python/sglang/kernels/ops/speculative/ddtree.py  (the Triton builder, build_ddtree_tree_triton)
#   python/sglang/srt/speculative/ddtree_utils.py    (the CPU builder, build_ddtree_tree)
#   python/sglang/srt/layers/attention/base_attn_backend.py  (AttentionBackend, which the kdtree_mla
#     backend's tests subclass)
#   python/sglang/srt/speculative/ddtree_worker_v2.py  (DDTreeWorkerV2, whose tensor-parallel draft top-k
#     the sharded-topk bench's port side follows; its test compares the two)
#   python/sglang/kernels/ops/attention/{extend,decode,prefill}_attention.py  (SGLang's Triton
#     extend-attention kernel, extend_attention_fwd, and the two files it imports: the peer of the
#     kdtree_mla backend's verify attention in its tests and in `kdtree-engine bench sglang`)
# The commit is written to .peers/sglang/COMMIT. Run from the repository root:
#   scripts/fetch_peers.sh [GIT]   GIT: a clone or bare mirror of the port (default: its GitHub URL)
#   REV=<commit or branch> pins another revision (default: ddtree-v2).
set -euo pipefail
SRC=${1:-https://github.com/Rancy-Wang/sglang.git}
REV=${REV:-ddtree-v2}
DEST=.peers/sglang
ATTN=python/sglang/kernels/ops/attention
FILES=(python/sglang/kernels/ops/speculative/ddtree.py python/sglang/srt/speculative/ddtree_utils.py
       python/sglang/srt/layers/attention/base_attn_backend.py python/sglang/srt/speculative/ddtree_worker_v2.py
       $ATTN/extend_attention.py $ATTN/decode_attention.py $ATTN/prefill_attention.py)

if [ -d "$SRC" ]; then
  git_dir=$SRC
  rev=$(git -C "$git_dir" rev-parse --verify -q "$REV^{commit}" \
        || git -C "$git_dir" rev-parse --verify "origin/$REV^{commit}")
else  # a URL: fetch just that revision into a temporary bare repository
  git_dir=$(mktemp -d)
  trap 'rm -rf "$git_dir"' EXIT
  git init -q --bare "$git_dir"
  git -C "$git_dir" fetch -q --depth 1 "$SRC" "$REV"
  rev=$(git -C "$git_dir" rev-parse FETCH_HEAD)
fi
rm -rf "$DEST"
mkdir -p "$DEST"
git -C "$git_dir" archive "$rev" "${FILES[@]}" | tar -x -C "$DEST"
echo "$rev" >"$DEST/COMMIT"
echo "$DEST: Rancy-Wang/sglang $REV at $rev"
