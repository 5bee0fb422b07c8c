#!/usr/bin/env bash
# Trains kimi-nano on a CUDA machine in one device call per stage and packs what it wrote into $OUT in
# parts of at most 15 MB (the device returns at most 8 files of 16 MiB). Run from the repo root with the
# prepared corpus at data/kimi-nano (`kdtree-engine train data`, carried with the working tree) or at
# the folder given as --data. A --data folder that holds packed.json (a corpus packed on the CPU with
# `python -m kdtree_engine.train.carry pack`) is unpacked in place first, every file checked by sha256.
# Stages: "target" (train or resume the target into out/kimi-nano, or --out), "drafter" (train or resume
# its DFlash drafter into out/kimi-nano-dflash, or --out; needs out/kimi-nano, or --target). Extra
# arguments go to the command. The returned parts hold the --out folder (without trainer_state.pt);
# unpack them with: cat PREFIX.tar.part-* | tar xf - -C out
set -uo pipefail
stage=${1:?usage: train_kimi_nano.sh target|drafter [args...]}
shift
OUT=${OUT:-out/device}
mkdir -p "$OUT" out
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
option() {  # option NAME DEFAULT ARGS...: the value of --NAME among ARGS (--NAME VALUE or --NAME=VALUE)
  local name=$1 value=$2 previous= arg
  shift 2
  for arg in "$@"; do
    case $arg in "--$name="*) value=${arg#--"$name"=} ;; esac
    [ "$previous" = "--$name" ] && value=$arg
    previous=$arg
  done
  echo "$value"
}
data=$(option data data/kimi-nano "$@")
folder=$(option out out/kimi-nano "$@")
[ "$stage" = drafter ] && folder=$(option out out/kimi-nano-dflash "$@")
if [ -f "$data/packed.json" ]; then
  python3 -m kdtree_engine.train.carry unpack "$data" || exit 2
fi
python3 -m kdtree_engine train "$stage" "$@" 2>&1 | tr '\r' '\n' | grep -v '^train .*it/s\]$' \
  | tee "$OUT/train_$stage.log" | tail -60
status=${PIPESTATUS[0]}
tar cf - -C "$(dirname "$folder")" --exclude trainer_state.pt "$(basename "$folder")" \
  | split -b 15M - "$OUT/$stage.tar.part-"
ls -la "$OUT"
exit "$status"
