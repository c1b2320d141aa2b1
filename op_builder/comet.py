"""CometBuilder: JIT- or ahead-of-time-builds the kernels in csrc/ through DeepSpeed's op builder."""

import importlib
import os
import re
import shutil
from pathlib import Path

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, installed_cuda_version

MIN_COMPUTE_CAPABILITY = (8, 0)
# The op's translation units in csrc/: the kernels of each stage, which include no torch header, and
# the torch binding.
SOURCES = (
    "gate_kernels.cu",
    "routing_kernels.cu",
    "exchange_kernels.cu",
    "dispatch_kernels.cu",
    "combine_kernels.cu",
    "comet_binding.cpp",
)


def csrc_dir() -> Path:
    """csrc/ beside this package in a source checkout, or the copy a wheel carries inside it."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc", here / "csrc"):
        if (candidate / "comet.h").is_file():
            return candidate
    raise FileNotFoundError(
        f"ds_comet's CUDA sources are missing: looked for comet.h in {here.parent / 'csrc'} and {here / 'csrc'}"
    )


def plain_arch_list(arch_list: str) -> str:
    """'9.0a;8.0 10.0f+PTX' -> '9.0;8.0;10.0+PTX': arch-specific suffixes dropped, order kept."""
    plain = []
    for entry in re.split(r"[;\s]+", arch_list.strip()):
        match = re.fullmatch(r"(\d+)\.(\d+)[a-z]?(\+PTX)?", entry)
        if match:
            value = f"{match.group(1)}.{match.group(2)}{match.group(3) or ''}"
            if value not in plain:
                plain.append(value)
    return ";".join(plain)


class CometBuilder(CUDAOpBuilder):
    BUILD_VAR = "DS_BUILD_COMET"
    NAME = "ds_comet_ops"  # no DeepSpeed op uses this name

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return self.NAME

    def sources(self):
        # Absolute paths: relative ones would resolve against DeepSpeed's own tree.
        return [str(csrc_dir() / name) for name in SOURCES]

    def include_paths(self):
        return [str(csrc_dir())]

    def filter_ccs(self, ccs):
        kept = [
            cc.split(".") for cc in ccs if tuple(int(p.split("+")[0]) for p in cc.split(".")) >= MIN_COMPUTE_CAPABILITY
        ]
        dropped = [cc for cc in ccs if cc.split(".") not in kept]
        if dropped:
            self.warning(
                f"{self.NAME}: skipping compute capabilities {dropped}: the kernels need "
                f"sm_{MIN_COMPUTE_CAPABILITY[0]}{MIN_COMPUTE_CAPABILITY[1]} or newer"
            )
        return kept

    def nvcc_args(self):
        # DeepSpeed's default --use_fast_math turns logf into __logf and flushes denormals to zero:
        # the gate kernels must round and compare as torch's kernels do, and nothing here gains
        # from it (the kernels move data and add in fp32).
        return [arg for arg in super().nvcc_args() if arg != "--use_fast_math"] + ["-lineinfo"]

    def incompatibility(self):
        """Why the op cannot build or run here, or None."""
        import torch

        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a build without CUDA"
        if not torch.cuda.is_available():
            return "no CUDA device is visible"
        nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
        if shutil.which("nvcc") is None and not nvcc.is_file():
            return "nvcc was not found (put it on PATH or set CUDA_HOME)"
        try:
            installed_cuda_version()
        except Exception as error:  # DeepSpeed raises its own exception types here
            return f"the CUDA toolkit cannot be used: {error}"
        for index in range(torch.cuda.device_count()):
            capability = torch.cuda.get_device_capability(index)
            if capability < MIN_COMPUTE_CAPABILITY:
                return (
                    f"GPU {index} ({torch.cuda.get_device_name(index)}) has compute capability "
                    f"{capability[0]}.{capability[1]}; the kernels need {MIN_COMPUTE_CAPABILITY[0]}."
                    f"{MIN_COMPUTE_CAPABILITY[1]} or newer"
                )
        return None

    def is_compatible(self, verbose=False):
        reason = self.incompatibility()
        if reason is not None:
            self.error_log = reason
            if verbose:
                self.warning(f"{self.NAME} is not compatible: {reason}")
            return False
        return super().is_compatible(verbose)

    def jit_load(self, verbose=True):
        # DeepSpeed parses TORCH_CUDA_ARCH_LIST entries as X.Y[+PTX] and fails on arch-specific ones
        # such as 9.0a; the kernels use no arch-specific instructions, so build for the plain arch.
        saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if saved:
            os.environ["TORCH_CUDA_ARCH_LIST"] = plain_arch_list(saved)
        try:
            return super().jit_load(verbose)
        finally:
            if saved is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = saved

    def load(self, verbose=False):
        """The ahead-of-time build if `DS_BUILD_COMET=1 pip install` made one, else a JIT build."""
        try:
            return importlib.import_module(self.absolute_name())
        except ImportError:
            return self.jit_load(verbose)
