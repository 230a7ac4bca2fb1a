#!/usr/bin/env bash
# Creates .venv/ at the repository root and installs the ABI-matched triple
# torch 2.13.0 (CPU) + fbgemm-gpu-cpu 1.8.0 + torchrec 1.8.0, then this project (editable).
# Idempotent: a stamp keyed on the hash of this script and pyproject.toml skips a second run.
# CNR_VARIANT=cuda installs the CUDA pair (torch 2.13.0 CUDA build + fbgemm-gpu 1.8.0) instead.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VARIANT=${CNR_VARIANT:-cpu}
VENV=.venv
STAMP=$VENV/.cnr-install-stamp
want=$(cat scripts/install.sh pyproject.toml | sha256sum | cut -d' ' -f1)-$VARIANT

if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]] && "$VENV/bin/python" -c 'import torchrec, fbgemm_gpu' 2>/dev/null; then
  exit 0
fi

case $VARIANT in
  cpu)  FBGEMM=fbgemm-gpu-cpu==1.8.0 ;;
  cuda) FBGEMM=fbgemm-gpu==1.8.0 ;;
  *) echo "install.sh: CNR_VARIANT='$VARIANT' is not allowed; use 'cpu' or 'cuda'" >&2; exit 2 ;;
esac

[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

# torch first, pinned exactly, so nothing later can pull a different build.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps "$FBGEMM" torchrec==1.8.0
# torchrec's own requirements minus fbgemm-gpu (its metadata names the CUDA build).
"${PIP[@]}" tensordict torchmetrics==1.0.3 tqdm pyre-extensions iopath typing-inspect
"${PIP[@]}" -e ".[test,examples]"

if ! "$VENV/bin/python" -c 'import torchrec, fbgemm_gpu, cnr' ; then
  echo "install.sh: 'import torchrec, fbgemm_gpu, cnr' failed after install" >&2
  exit 1
fi
echo "$want" > "$STAMP"
echo "install.sh: .venv ready ($VARIANT)"
