#!/usr/bin/env bash
# The CUDA check: run on a machine with an NVIDIA GPU (the `device` tool lends one).
# Builds the venv with the CUDA torch build (the Makefile picks it where nvidia-smi sees a
# GPU), then runs the engine's behaviour tests on CUDA (greedy parity with transformers,
# batch invariance, chunked == unchunked, prefix hit == miss, preempted == uninterrupted,
# prefill -> decode hand-off, prompt logprobs), the KV transfer contract suite, tensor
# parallelism on NCCL (TP=2 == TP=1 greedy, tiny models, fp32; skipped with one GPU), and
# a short engine bench on the GPU. Everything it prints is the report.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L
make venv .venv/.test model >/dev/null
PY=.venv/bin/python
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
echo "== engine tests on CUDA"
$PY -m pytest -q -p no:cacheprovider tests/engine/test_engine.py tests/engine/test_engine_kernels.py --device cuda
echo "== KV transfer contract (torch backend: NCCL for CUDA tensors, gloo on CPU)"
$PY -m pytest -q -p no:cacheprovider tests/kv_transfer/test_contract.py -k "torch"
echo "== tensor parallel on CUDA (NCCL): TP=2 == TP=1 greedy, tiny models"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
    # float32 only: in bf16 on CUDA the activations are bf16 too, so the row-parallel
    # partial sums are rounded before the all-reduce (not bit-equal to one rank's matmul).
    $PY -m pytest -q -p no:cacheprovider tests/engine/test_tensor_parallel.py --device cuda \
        -k "test_two_ranks_equal_one and float32"
else
    echo "SKIP tensor parallel on CUDA: $NGPU GPU(s) here, TP=2 needs 2"
fi
echo "== engine bench on CUDA"
$PY -m benchmarks.engine --device cuda --threads 1 --formats float32,bfloat16 \
    --concurrency 1,32 --prefill 128,1024,4096
