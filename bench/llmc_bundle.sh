#!/usr/bin/env bash
# llm-compressor 0.14 for the GPU round, as wheels carried in .llmc/ (ignored by git):
#
#   bash bench/llmc_bundle.sh            # makes .llmc/ (the wheels and install.sh), here
#   bash .llmc/install.sh                # there: installs them into /tmp/lcsite (LCSITE=...)
#
# The device machine has no network and no llmcompressor, compressed-tensors, datasets or
# loguru, but has torch 2.11, transformers 5.17, accelerate 1.15, pyarrow, pandas, numpy,
# requests, tqdm, psutil, pillow, xxhash, fsspec, aiohttp, huggingface-hub, nvidia-ml-py,
# py-cpuinfo and pyyaml. Only what it lacks is carried, each wheel without its dependencies:
# llm-compressor's own import and its GPTQ / SmoothQuant path need no auto-round (imported only
# by its AutoRoundModifier), so auto-round is not carried. pydantic-core is the one binary
# wheel: the device's Python is 3.12 (PYVER=3.11 makes a bundle for this machine, to test).
# The site stays apart from /tmp/site (vLLM's, with its own compressed-tensors): the round's
# llmc step puts it first on PYTHONPATH for its own processes only.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
DEST=${DEST:-.llmc}
PIP=${PIP:-python3 -m pip}
PURE=(
  llmcompressor==0.14.0
  compressed-tensors==0.19.0
  loguru==0.7.3
  datasets==5.0.1
  dill==0.4.1
  pydantic==2.14.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
)
rm -rf "$DEST" && mkdir -p "$DEST"
$PIP download -q --no-deps --only-binary=:all: -d "$DEST" "${PURE[@]}"
# multiprocess ships one wheel per Python; pydantic-core is compiled
$PIP download -q --no-deps --only-binary=:all: -d "$DEST" --python-version "$PYVER" \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  multiprocess==0.70.19 pydantic-core==2.50.5
cat >"$DEST/install.sh" <<'EOF'
#!/usr/bin/env bash
# llm-compressor 0.14's wheels (bench/llmc_bundle.sh made them) into their own site dir
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
site=${LCSITE:-/tmp/lcsite}
${PY:-python3} -m pip install -q --no-deps --no-index --target "$site" "$here"/*.whl
echo "installed $(ls "$here"/*.whl | wc -l) wheels into $site"
EOF
chmod +x "$DEST/install.sh"
ls -l "$DEST"
du -sh "$DEST"
