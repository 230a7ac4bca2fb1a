#!/usr/bin/env bash
# Builds the carry bundle for a GPU device check into .dev/ (git-ignored): fbgemm-gpu 1.6.0 (CUDA
# 13.0, torch 2.11: the device image's torch) with only sm_90 cubins, split into two chunks under
# the 64 MiB carry limit, and the small wheels cnr and torchrec need there. About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo '/.dev/' >> .git/info/exclude
W=$(mktemp -d); mkdir -p .dev
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q "${P[@]}" -d "$W" fbgemm-gpu==1.6.0
python3 -m pip download -q "${P[@]}" -d "$W/small" torchrec==1.6.1 tensordict==0.12.0 pyvers orjson zstandard \
  pyre-extensions typing-inspect iopath torchmetrics==1.0.3 boto3 botocore s3transfer jmespath
mkdir "$W/fb" && (cd "$W/fb" && unzip -q ../fbgemm_gpu-1.6.0-*.whl)
for so in "$W"/fb/fbgemm_gpu/*.so; do python3 scripts/cuda/fatbin_keep_arch.py "$so" keep=90 "$so.k" > /dev/null && mv "$so.k" "$so"; done
tar -C "$W/fb" -cf - . | zstd -q -15 --long=30 -T0 -f -o "$W/fb.tar.zst"
sha256sum "$W/fb.tar.zst" | sed "s#$W/#/tmp/dev/#" > .dev/fb.sha256
split -b 52M -d "$W/fb.tar.zst" .dev/fb.
tar -C "$W" -cf .dev/small.tar small
cp scripts/cuda/setup.sh scripts/cuda/run.sh .dev/
rm -rf "$W"; ls -la .dev
