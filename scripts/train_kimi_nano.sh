#!/usr/bin/env bash
# Trains kimi-nano on a CUDA machine in one device call per stage and packs what it wrote into $OUT in
# parts of at most 15 MB (the device returns at most 8 files of 16 MiB). Run from the repo root with the
# prepared corpus at data/kimi-nano (`kdtree-engine train data`, carried with the working tree).
# Stages: "target" (train or resume the target into out/kimi-nano), "drafter" (train or resume its
# DFlash drafter into out/kimi-nano-dflash; needs out/kimi-nano). Extra arguments go to the command.
# Unpack the returned parts with: cat PREFIX.tar.part-* | tar xf - -C out
set -uo pipefail
stage=${1:?usage: train_kimi_nano.sh target|drafter [args...]}
shift
OUT=${OUT:-out/device}
mkdir -p "$OUT" out
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m kdtree_engine train "$stage" "$@" 2>&1 | tr '\r' '\n' | grep -v '^train .*it/s\]$' \
  | tee "$OUT/train_$stage.log" | tail -60
status=${PIPESTATUS[0]}
folder=out/kimi-nano; [ "$stage" = drafter ] && folder=out/kimi-nano-dflash
tar cf - -C out --exclude trainer_state.pt "$(basename "$folder")" | split -b 15M - "$OUT/$stage.tar.part-"
ls -la "$OUT"
exit "$status"
