#!/usr/bin/env bash
# The main job on the embedded default (tiny local model, no downloads); see examples/default_job.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python examples/default_job.py "$@"
