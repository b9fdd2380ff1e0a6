#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels a GPU machine without package-registry access needs
# beyond its image (torch, transformers, triton, sentencepiece, safetensors, pytest, hypothesis, numpy,
# pyarrow, xxhash, ... are there; the device tool's README lists the image), for CPython 3.12 on
# manylinux x86-64.
# zstandard (a core dependency: .jsonl.zst corpora, data/sources.py) is the one binary wheel among them:
# without it tests/data/test_data_prep.py fails to import and the GPU check's test part fails.
# Run it on a machine that reaches the registry, from anywhere in the repository:
#
#     bash scripts/gpu/prepare_wheels.sh
#
# then carry `.whl` to the GPU machine and run scripts/gpu/check.sh there, which installs them with
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
#
# Versions are the ones installed in the project's virtual environment (.venv), so the GPU run uses
# the versions the CPU suite was tested with; the pins below apply where the venv lacks a package.
# Not carried: wandb (20 MB plus opentelemetry/pydantic/sentry dependencies; run train.py there with
# logging.wandb.mode=disabled), flash-attn and transformer-engine (built against the machine's CUDA
# torch; see README "GPU clusters").
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=.whl
LIMIT_MIB=40  # the device tool carries at most 64 MiB with the working tree; keep most of it for the tree

# name (as pip knows it) and the version used when the venv has none
declare -A FALLBACK=(
  [hydra-core]=1.3.2 [omegaconf]=2.3.0 [PuLP]=3.3.2
  [datasets]=5.2.0 [dill]=0.4.1 [multiprocess]=0.70.19 [zstandard]=0.25.0
)
ORDER=(hydra-core omegaconf PuLP datasets dill multiprocess zstandard)
ANTLR=antlr4-python3-runtime==4.9.3  # omegaconf/hydra pin 4.9.*; PyPI has only its sdist: built here

version_of() {
  "$PY" - "$1" <<'EOF' 2>/dev/null || true
import importlib.metadata as m, sys
print(m.version(sys.argv[1]))
EOF
}

PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done

rm -rf "$DEST"  # one version of each package: two make the whole install fail
mkdir -p "$DEST"
specs=()
for name in "${ORDER[@]}"; do
  v=$(version_of "$name")
  specs+=("$name==${v:-${FALLBACK[$name]}}")
done
echo "downloading: ${specs[*]}"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${specs[@]}"

# A pure-Python sdist: the wheel it builds (py3-none-any) installs on any Python 3.
echo "building: $ANTLR"
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$DEST" "$ANTLR"

echo
echo "wheels in $DEST/:"
total=0
for f in "$DEST"/*.whl; do
  size=$(stat -c %s "$f")
  total=$((total + size))
  printf '  %10d  %s\n' "$size" "$(basename "$f")"
done
count=$(find "$DEST" -maxdepth 1 -name "*.whl" | wc -l)
expected=$(( ${#ORDER[@]} + 1 ))
awk -v c="$count" -v t="$total" 'BEGIN { printf "total: %d wheels, %d bytes (%.1f MiB)\n", c, t, t / 1048576 }'
if [ "$count" -ne "$expected" ]; then
  echo "error: expected $expected wheels, found $count" >&2
  exit 1
fi
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "error: the wheels take more than ${LIMIT_MIB} MiB of the 64 MiB the device tool carries" >&2
  exit 1
fi
