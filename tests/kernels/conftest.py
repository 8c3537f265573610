"""Without a GPU, run the Triton kernels on the CPU through Triton's interpreter. pytest imports this before the test modules
of this folder, and the kernel modules are imported lazily by the tests, so the variable is set before any
``@triton.jit`` is evaluated."""

import os

import torch

if not torch.cuda.is_available():  # on a GPU machine the kernels run compiled (the gpu-marked tests)
    os.environ.setdefault("TRITON_INTERPRET", "1")
