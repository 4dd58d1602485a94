#!/usr/bin/env bash
# Wheels of the pure-Python-side dependencies the GPU machine lacks (gguf and its yaml,
# tokenizers; the server's fastapi, uvicorn, sse-starlette, prometheus-client and httpx with
# theirs, for scripts/bench_serve.py), for Python 3.12 x86_64, into build/devwheels/ (about 9 MB;
# ignored by git).
# They do not fit in the same device call as .device/ (64 MiB in all): install them first, in a
# call of their own, and the next call on the still-warm machine finds them (docs/design.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p build/devwheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d build/devwheels gguf==0.19.0 tokenizers==0.23.3 pyyaml \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 sse-starlette==3.7.1 prometheus-client==0.26.0 \
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 annotated-doc==0.0.7 \
  typing-extensions==4.16.0 opentelemetry-api==1.45.2 anyio==4.16.0 idna==3.20 click==8.5.1 h11==0.16.0 \
  httpx==0.29.0 httpcore==1.0.9 certifi==2026.5.20 jinja2==3.1.6 markupsafe==3.0.3
du -sh build/devwheels
