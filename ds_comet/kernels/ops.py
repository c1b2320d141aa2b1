"""Loading the CUDA op, and turning a failed bounded wait into a Python exception."""

import functools
import importlib
import os
import time

import torch
from deepspeed.utils import logger

from ..op_builder import CometBuilder
from . import constants
from .jit_build import guarded_build, torch_build_directory
from .layout import HEADER_FIELDS


class CometWaitTimeout(RuntimeError):
    """A layer waited past ``wait_timeout_s`` for a rank of its group: a fused kernel for data or a
    signal, or the reference pipeline for one of its exchanges (``pipelines/collective_waits.py``)."""


@functools.cache
def load_op():
    """The compiled ds_comet op: the ahead-of-time build if there is one, else a JIT build, made once
    into $TORCH_EXTENSIONS_DIR (a minute or two) and loaded from there afterwards, under the guard
    that keeps a killed build from hanging later loads (jit_build.py)."""
    builder = CometBuilder()
    try:
        op = importlib.import_module(builder.absolute_name())
        rebuild = "reinstall ds_comet with DS_BUILD_COMET=1 (the op loaded is the ahead-of-time build)"
    except ImportError:
        directory = torch_build_directory(builder.NAME)
        rebuild = f"remove {directory}"

        def build():
            # Looked at under the guard: a process that waited for another's build only loads it.
            why = build_needed(os.path.join(directory, f"{builder.NAME}.so"), _source_files())
            if why:
                logger.warning(
                    f"ds_comet: building the CUDA op {builder.NAME} into {directory} ({why}; about a "
                    "minute, cached afterwards)"
                )
            started = time.perf_counter()
            built = builder.jit_load(verbose=False)
            if why:
                logger.warning(f"ds_comet: built the CUDA op {builder.NAME} in {time.perf_counter() - started:.0f} s")
            return built

        op = guarded_build(directory, build)
    compiled = dict(op.codes())
    if compiled != constants.CONSTANTS:
        raise RuntimeError(
            f"the compiled ds_comet op disagrees with csrc/{constants.HEADER}: {compiled} vs "
            f"{constants.CONSTANTS}; rebuild it ({rebuild})"
        )
    return op


def build_needed(library: str, sources: list[str]) -> str | None:
    """Why the JIT build will compile (the op is not built, or a source is newer than it), or None
    when it will only load."""
    if not os.path.exists(library):
        return "not built yet"
    built = os.path.getmtime(library)
    changed = sorted(os.path.basename(path) for path in sources if os.path.getmtime(path) > built)
    if changed:
        return f"its sources changed since the last build: {', '.join(changed)}"
    return None


def _source_files() -> list[str]:
    """Every file of csrc/, the sources and the headers they include."""
    from ..op_builder.comet import csrc_dir

    return [str(path) for path in csrc_dir().iterdir() if path.is_file()]


@functools.cache
def op_unavailable_reason() -> str | None:
    """Why the op cannot be used here, or None once it is loaded."""
    reason = CometBuilder().incompatibility()
    if reason is not None:
        return reason
    try:
        load_op()
    except Exception as error:  # a build failure is a reason: an error under "fused", a warning under "auto"
        return f"building the ds_comet CUDA op failed: {type(error).__name__}: {error}"
    return None


_WHAT = {
    constants.WAIT_EXCHANGE_FLAG: "the expert counts of peer rank {index}",
    constants.WAIT_DISPATCH_TILE: "the rows of GEMM1 row tile {index}",
    constants.WAIT_COMBINE_CHUNK: "the expert outputs of column chunk {index}",
    constants.WAIT_DISPATCH_STAGE: "the rows peer rank {index} staged for it",
    constants.WAIT_COMBINE_REDUCE: "its own GEMM2's rows of other ranks' tokens in column chunk {index}",
}
_OVERFLOWING = {0: "receive rows", 1: "GEMM1 row tiles", 2: "staging pieces"}


def describe_error_record(record: torch.Tensor) -> str | None:
    """The message of a filled error record (pinned host memory the kernels write), or None."""
    words = record.tolist()
    if words[constants.ERROR_FILLED] == 0:
        return None
    rank, kind, index = words[constants.ERROR_RANK], words[constants.ERROR_KIND], words[constants.ERROR_INDEX]
    target, observed = words[constants.ERROR_TARGET], words[constants.ERROR_OBSERVED]
    waited_ns = words[constants.ERROR_WAITED_NS]
    if kind == constants.WORKSPACE_OVERFLOW:
        what = _OVERFLOWING.get(index, f"workspace part {index}")
        return (
            f"ds_comet: rank {rank} needed {observed} {what} but the call allows {target} (the workspace, or "
            'the gate\'s capacity in its current mode, for the most tokens per rank); raise "moe": '
            '{"max_tokens_per_rank"} in the ds_config if a rank got more tokens than the first call'
        )
    if kind == constants.HEADER_MISMATCH:
        source, word = divmod(index, constants.HEADER_WORDS)
        return (
            f"ds_comet: group rank {rank}'s exchange header differs from group rank {source}'s in its "
            f"{HEADER_FIELDS[word]}: {target} here, {observed} there; the ranks of the expert-parallel group are "
            "not in the same exchange (another layer, another call, a backward or an evaluation forward on some "
            "ranks alone, or a setting changed on some ranks alone)"
        )
    what = _WHAT.get(kind, "signal {index}").format(index=index)
    return (
        f"ds_comet: rank {rank} waited {waited_ns / 1e9:.1f} s for {what} to reach {target} but saw {observed}; "
        'a rank of the expert-parallel group stopped or fell behind (raise "moe": {"wait_timeout_s"} if it '
        "is only slow)"
    )
