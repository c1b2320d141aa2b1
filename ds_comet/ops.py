"""Loading the CUDA op, and turning a failed bounded wait into a Python exception."""

import functools
from typing import Optional

import torch

from . import layout


class CometWaitTimeout(RuntimeError):
    """A fused kernel waited past ``wait_timeout_s`` for data or a signal from a rank of its group."""


@functools.lru_cache(maxsize=None)
def load_op():
    """The compiled ds_comet op (built ahead of time, or JIT-built once into $TORCH_EXTENSIONS_DIR)."""
    from op_builder import CometBuilder
    op = CometBuilder().load(verbose=False)
    expected = dict(total_tiles=layout.TOTAL_TILES, total_kept=layout.TOTAL_KEPT,
                    total_recv_rows=layout.TOTAL_RECV_ROWS, total_pieces=layout.TOTAL_PIECES,
                    total_generation=layout.TOTAL_GENERATION, total_combine_claim=layout.TOTAL_COMBINE_CLAIM,
                    total_error_claim=layout.TOTAL_ERROR_CLAIM,
                    wait_exchange_flag=layout.WAIT_EXCHANGE_FLAG,
                    wait_dispatch_tile=layout.WAIT_DISPATCH_TILE, wait_combine_chunk=layout.WAIT_COMBINE_CHUNK,
                    workspace_overflow=layout.WORKSPACE_OVERFLOW, error_record_words=layout.ERROR_RECORD_WORDS)
    if dict(op.codes()) != expected:
        raise RuntimeError(f"ds_comet's compiled op disagrees with ds_comet/layout.py: {dict(op.codes())} vs "
                           f"{expected}; rebuild it (clear $TORCH_EXTENSIONS_DIR/ds_comet_ops)")
    return op


@functools.lru_cache(maxsize=None)
def op_unavailable_reason() -> Optional[str]:
    """Why the op cannot be used here, or None once it is loaded."""
    from op_builder import CometBuilder
    reason = CometBuilder().incompatibility()
    if reason is not None:
        return reason
    try:
        load_op()
    except Exception as error:  # a build failure is a reason to fall back, reported once
        return f"building the ds_comet op failed: {type(error).__name__}: {error}"
    return None


_WHAT = {
    layout.WAIT_EXCHANGE_FLAG: "the expert counts of peer rank {index}",
    layout.WAIT_DISPATCH_TILE: "the rows of GEMM1 row tile {index}",
    layout.WAIT_COMBINE_CHUNK: "the expert outputs of column chunk {index}",
}


def describe_error_record(record: torch.Tensor) -> Optional[str]:
    """The message of a filled error record (pinned host memory the kernels write), or None."""
    words = record.tolist()
    if words[0] == 0:
        return None
    _, rank, kind, index, target, observed, waited_ns, _ = words
    if kind == layout.WORKSPACE_OVERFLOW:
        what = "receive rows" if index == 0 else "GEMM1 row tiles"
        return (f"ds_comet: rank {rank} needed {observed} {what} but the call allows {target} (the workspace, or "
                "the gate's capacity in its current mode, for the most tokens per rank); raise \"moe\": "
                "{\"max_tokens_per_rank\"} in the ds_config if a rank got more tokens than the first call")
    what = _WHAT.get(kind, "signal {index}").format(index=index)
    return (f"ds_comet: rank {rank} waited {waited_ns / 1e9:.1f} s for {what} to reach {target} but saw {observed}; "
            "a rank of the expert-parallel group stopped or fell behind (raise \"moe\": {\"wait_timeout_s\"} if it "
            "is only slow)")
