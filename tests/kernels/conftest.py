"""Run the Triton kernels on the CPU through Triton's interpreter. pytest imports this before the test modules
of this folder, and the kernel modules are imported lazily by the tests, so the variable is set before any
``@triton.jit`` is evaluated."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
