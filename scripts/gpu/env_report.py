"""What a GPU check ran on: nvidia-smi, torch / CUDA / cuDNN, the devices, and the packages the
project imports there. Exits non-zero when CUDA is not visible or a required package is missing
(optional kernel libraries are only reported). Used by scripts/gpu/check.sh."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # csrc/: the project is not installed there

REQUIRED = ("transformers", "hydra", "omegaconf", "pulp")
OPTIONAL = ("datasets", "flash_attn", "transformer_engine")


def main() -> int:
    try:
        print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60).stdout)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"nvidia-smi: {e}")
    import torch

    print(f"python {sys.version.split()[0]}; torch {torch.__version__}; CUDA {torch.version.cuda}; "
          f"cuDNN {torch.backends.cudnn.version()}; CUDA available: {torch.cuda.is_available()}")
    problems = []
    if not torch.cuda.is_available():
        problems.append("no CUDA device visible to torch")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"device {i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
              f"{p.multi_processor_count} SMs")
    # The CUDA kernels build here (nvcc) and the wgrad GEMM links cuBLAS: a missing header shows in this
    # report rather than as failed tests and an unmeasured kernels part (reported, not required).
    from torch.utils.cpp_extension import CUDA_HOME

    from csrc.loader import cublas_include_dirs, cuda_build_possible

    print(f"CUDA_HOME {CUDA_HOME}; CUDA kernels buildable: {cuda_build_possible() or 'yes'}; "
          f"cublas_v2.h in: {cublas_include_dirs() or 'not found (the wgrad GEMM cannot build)'}")
    for mod in REQUIRED + OPTIONAL:
        try:
            m = importlib.import_module(mod)
            print(f"{mod} {getattr(m, '__version__', '(no __version__)')}")
        except Exception as e:  # report every missing package, then fail once
            print(f"{mod}: not importable ({type(e).__name__}: {e}){' (optional)' if mod in OPTIONAL else ''}")
            if mod in REQUIRED:
                problems.append(f"{mod} missing")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
