"""Test-session setup that must happen before any test module imports triton: without a CUDA GPU the
Triton kernels run under the interpreter (TRITON_INTERPRET=1 is read when triton is first imported)."""

import os
import shutil

if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"
