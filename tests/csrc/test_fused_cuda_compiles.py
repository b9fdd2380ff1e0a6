"""csrc/fused_cuda.cu compiles with nvcc against this torch's headers, on machines without a GPU.

The CUDA kernels can only be linked and run beside a CUDA build of torch (tests/csrc/test_fused_cuda.py,
marked `gpu`). Where nvcc exists but torch is the CPU wheel, this still compiles the file to an
object with the flags torch.utils.cpp_extension would use, so a syntax or template error in code that
the CPU machines never run is caught here rather than on the first GPU job. Skipped without nvcc.
"""
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

from csrc.loader import CSRC_DIR, CUDA_FLAGS, CUDA_SOURCES, WGRAD_SOURCES, cublas_include_dirs

ARCH = "sm_90"  # H100; one architecture keeps the check to about a minute on two cores


def _nvcc() -> str | None:
    home = cpp_extension.CUDA_HOME
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _sources() -> list:
    """fused_cuda.cu always; the cuBLAS GEMM where cuBLAS's headers are found (a library of its own)."""
    return [pytest.param(s, id=s) for s in CUDA_SOURCES] + [
        pytest.param(s, id=s, marks=pytest.mark.skipif(not cublas_include_dirs(), reason="no cuBLAS headers"))
        for s in WGRAD_SOURCES]


# Two depths: to PTX (the front end parses the whole file, host code included, and compiles every kernel
# for the device: about 15 s on two cores) in the default run, and the full object (host compiler and
# ptxas at -O3 as well: about a minute) with `pytest -m slow`.
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("source", _sources())
def test_cuda_kernels_compile_to_ptx(tmp_path, source):
    _compile(tmp_path, source, ["-ptx"], "ptx")


@pytest.mark.slow
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("source", _sources())
def test_cuda_kernels_compile_with_nvcc(tmp_path, source):
    _compile(tmp_path, source, ["-c"], "o")


def _compile(tmp_path, source: str, mode: list[str], suffix: str) -> None:
    includes = cpp_extension.include_paths() + (cublas_include_dirs() if source in WGRAD_SOURCES else [])
    # The CPU wheel ships the c10/cuda headers but not the one its CMake generates for CUDA builds;
    # supply it (it only declares that c10_cuda is a shared library) when it is missing.
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in includes):
        shim = tmp_path / "shim/c10/cuda/impl/cuda_cmake_macros.h"
        shim.parent.mkdir(parents=True)
        shim.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes = [str(tmp_path / "shim"), *includes]
    out = tmp_path / f"{source}.{suffix}"
    cmd = [_nvcc(), *mode, str(CSRC_DIR / source), "-o", str(out),
           f"-arch={ARCH}", "-std=c++20", "-Xcompiler", "-fPIC", "-DTORCH_EXTENSION_NAME=amsp_csrc_cuda",
           f"-I{sysconfig.get_paths()['include']}", *cpp_extension.COMMON_NVCC_FLAGS, *CUDA_FLAGS,
           *(f"-I{p}" for p in includes)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 0, f"nvcc failed on {source}:\n" + "\n".join(errors[:20] or [proc.stderr[-3000:]])
    assert out.stat().st_size > 0
