#!/usr/bin/env bash
# Wheels of the pure-Python-side dependencies the GPU machine lacks (gguf and its yaml,
# tokenizers), for Python 3.12 x86_64, into build/devwheels/ (about 4.4 MB; ignored by git).
# They do not fit in the same device call as .device/ (64 MiB in all): install them first, in a
# call of their own, and the next call on the still-warm machine finds them (docs/design.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p build/devwheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d build/devwheels gguf==0.19.0 tokenizers==0.23.3 pyyaml
du -sh build/devwheels
