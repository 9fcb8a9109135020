#!/usr/bin/env bash
# The CUDA check: run on a machine with an NVIDIA GPU (the `device` tool lends one).
# Builds the venv with the CUDA torch build (the Makefile picks it where nvidia-smi sees a
# GPU), then runs the engine's behaviour tests on CUDA (greedy parity with transformers,
# batch invariance, chunked == unchunked, prefix hit == miss, preempted == uninterrupted,
# prefill -> decode hand-off, prompt logprobs), the KV transfer contract suite, and a
# short engine bench on the GPU. Everything it prints is the report.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L
make venv .venv/.test model >/dev/null
PY=.venv/bin/python
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
echo "== engine tests on CUDA"
$PY -m pytest -q -p no:cacheprovider tests/engine/test_engine.py --device cuda
echo "== KV transfer contract (torch backend: NCCL for CUDA tensors, gloo on CPU)"
$PY -m pytest -q -p no:cacheprovider tests/kv_transfer/test_contract.py -k "torch"
echo "== engine bench on CUDA"
$PY -m pdserve.engine.bench --device cuda --threads 1 --formats float32,bfloat16 \
    --concurrency 1,32 --prefill 128,1024,4096
