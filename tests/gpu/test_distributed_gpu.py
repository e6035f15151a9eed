"""Context parallelism with NCCL, one GPU per rank: tests/distributed_check.py under torchrun (ring and Ulysses
equal one process's sage_attention). Needs two or more GPUs."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ring_and_ulysses_with_nccl():
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "distributed_check.py")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script,
                             "--backend", "nccl"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "distributed checks passed on 2 ranks (nccl)" in result.stdout
