"""Builds and loads the native CPU extension (fused ops + dataset index helpers) once per environment.

The sources are JIT-compiled with torch.utils.cpp_extension (g++, -O3, OpenMP, ninja) into
`<repo>/.cache/torch_extensions/<name>-<hash>`, where the hash covers the sources, the flags, the
torch version and the CPU capability; a second process (or pytest session) finds the library
built and only pays the load. ninja's own up-to-date check and cpp_extension's file lock make
concurrent first use from several processes safe.

Ops are registered through TORCH_LIBRARY, so the library is loaded with `torch.ops.load_library`
and no pybind11 module is compiled (that header alone costs tens of seconds per build).

A failed build is not fatal: `load_extension()` returns None after exactly one warning naming the
compiler error, and callers fall back to their pure-PyTorch references (and say so in their log).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
import warnings
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parent
EXTENSION_NAME = "amsp_csrc_cpu"
CPU_SOURCES = ("fused_cpu.cpp", "index_helpers.cpp")
CUDA_EXTENSION_NAME = "amsp_csrc_cuda"
CUDA_SOURCES = ("fused_cuda.cu",)  # CUDA kernels for the ops fused_cpu.cpp defines
# The cuBLAS weight-gradient GEMM (amsp.fuse_wgrad): a library of its own, since it needs cuBLAS's headers
WGRAD_EXTENSION_NAME = "amsp_wgrad_cuda"
WGRAD_SOURCES = ("wgrad_gemm_cuda.cu",)
CUDA_FLAGS = ["-O3", "--use_fast_math"]
DISABLE_ENV = "AMSP_CSRC_DISABLE"  # set to 1 to skip building (e.g. to time the references)
CACHE_ENV = "AMSP_CSRC_CACHE"



def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    repo = CSRC_DIR.parent
    if (repo / "pyproject.toml").exists():
        return repo / ".cache" / "torch_extensions"
    return Path.home() / ".cache" / "amsp_csrc" / "torch_extensions"


def _cpu_flags() -> list[str]:
    # ATen's Vectorized<T> uses AVX2 intrinsics only when CPU_CAPABILITY_AVX2 is defined and the
    # compiler may emit them; the capability is part of the cache key so a cache is never reused on
    # a machine that lacks it. No FMA contraction: the index builders must reproduce numpy's
    # separately rounded double products and sums bit for bit.
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        flags += ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mf16c"]
    return flags


def build_key(sources: list[Path], flags: list[str]) -> str:
    h = hashlib.sha256()
    for src in [*sources, *sorted(CSRC_DIR.glob("*.h"))]:  # the headers the sources share, too
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    h.update(torch.backends.cpu.get_cpu_capability().encode())
    return h.hexdigest()[:16]


def _first_error_line(exc: BaseException) -> str:
    text = str(exc)
    for line in text.splitlines():
        if re.search(r"\berror\b", line, re.IGNORECASE) and "Error building extension" not in line:
            return line.strip()
    return text.splitlines()[0].strip() if text.strip() else type(exc).__name__


def cublas_include_dirs() -> list[str]:
    """Directories holding cublas_v2.h: the CUDA toolkit's, else those torch's CUDA wheels install
    (site-packages/nvidia/cu13/include, nvidia/cublas/include for CUDA 12)."""
    import site
    import sysconfig

    from torch.utils.cpp_extension import CUDA_HOME

    candidates = [Path(CUDA_HOME) / "include"] if CUDA_HOME else []
    roots = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    for root in sorted(roots):
        candidates += [Path(root) / "nvidia" / sub / "include" for sub in ("cu13", "cublas", "cu12")]
    for d in candidates:
        if (d / "cublas_v2.h").exists():
            return [str(d)]
    return []


def build_and_load(name: str, sources: list[Path], verbose: bool = False, include_dirs: list[str] | None = None) -> str:
    """Compile (if not already cached) and load a TORCH_LIBRARY extension; returns the library path."""
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None and not (Path(os.sys.executable).parent / "ninja").exists():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    cuda = any(s.suffix == ".cu" for s in sources)
    flags = _cpu_flags()
    build_dir = cache_root() / f"{name}-{build_key(sources, flags + (CUDA_FLAGS if cuda else []))}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # cpp_extension finds ninja on PATH; the virtualenv's bin may not be on it when python is
    # called by its full path.
    venv_bin = str(Path(os.sys.executable).parent)
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    load(name=name, sources=[str(s) for s in sources], extra_cflags=flags, extra_ldflags=["-fopenmp"],
         extra_cuda_cflags=CUDA_FLAGS if cuda else None, with_cuda=cuda, extra_include_paths=include_dirs,
         build_directory=str(build_dir), is_python_module=False, verbose=verbose)
    return str(build_dir / f"{name}.so")


class NativeExtension:
    """One extension's build-and-load, attempted at most once per process."""

    def __init__(self, name: str, sources: list[Path], include_dirs=None):
        """include_dirs: a function giving extra header directories, called at the first build."""
        self.name, self.sources, self.include_dirs = name, sources, include_dirs
        self.lib: str | None = None
        self.error: str | None = None  # why it is unavailable, once a load has failed
        self._lock = threading.Lock()

    def load(self) -> str | None:
        """The loaded library's path, or None (after exactly one warning naming the error)."""
        with self._lock:
            if self.lib is not None or self.error is not None:
                return self.lib
            if os.environ.get(DISABLE_ENV) == "1":
                self.error = f"disabled by {DISABLE_ENV}=1"
                log.info("csrc: %s %s", self.name, self.error)
                return None
            try:
                self.lib = build_and_load(self.name, self.sources,
                                          include_dirs=self.include_dirs() if self.include_dirs else None)
            except Exception as exc:  # any build or load failure: fall back, but loudly, once
                self.error = _first_error_line(exc)
                warnings.warn(f"csrc: building the native extension {self.name} failed ({self.error}); "
                              "using the pure-PyTorch references", RuntimeWarning, stacklevel=3)
                return None
            log.info("csrc: loaded native extension %s", self.lib)
            return self.lib


CPU_EXTENSION = NativeExtension(EXTENSION_NAME, [CSRC_DIR / s for s in CPU_SOURCES])
CUDA_EXTENSION = NativeExtension(CUDA_EXTENSION_NAME, [CSRC_DIR / s for s in CUDA_SOURCES])
WGRAD_EXTENSION = NativeExtension(WGRAD_EXTENSION_NAME, [CSRC_DIR / s for s in WGRAD_SOURCES],
                                  include_dirs=cublas_include_dirs)


def cuda_build_possible() -> str | None:
    """None when the CUDA kernels can be built here, else why not (CPU machines: always a reason)."""
    if torch.version.cuda is None:
        return "torch is a CPU build"
    if not torch.cuda.is_available():
        return "no CUDA device"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "nvcc / CUDA_HOME not found"
    return None


def _load_cuda(ext: NativeExtension) -> str | None:
    """A CUDA library of ops the CPU extension defines (so that one first), or None with a logged reason."""
    if load_extension() is None:
        return None
    why = cuda_build_possible()
    if why is not None:
        if ext.error is None:
            ext.error = why
            log.info("csrc: %s not built (%s)", ext.name, why)
        return None
    return ext.load()


def load_cuda_extension() -> str | None:
    """The CUDA kernels' library, or None with a logged reason."""
    return _load_cuda(CUDA_EXTENSION)


def ops_unavailable(device, cuda_ext: NativeExtension) -> str | None:
    """None when the ops serve tensors on `device` (CUDA: `cuda_ext` built and loaded, after the CPU
    extension that defines them; CPU: the CPU extension), else why not."""
    if torch.device(device).type != "cuda":
        return None if load_extension() is not None else CPU_EXTENSION.error
    return None if _load_cuda(cuda_ext) is not None else (cuda_ext.error or CPU_EXTENSION.error)


def load_extension() -> str | None:
    """The CPU extension's library path once loaded, or None (after one warning) if it cannot be built."""
    return CPU_EXTENSION.load()


def unavailable_reason() -> str | None:
    """Why the CPU extension is not loaded (None when it is, or before the first attempt)."""
    return CPU_EXTENSION.error
