"""The kernels' constants, read from ``csrc/comet.h``, where ``DS_COMET_CONSTANTS`` states each once.

The header's ``X(WaitExchangeFlag, 1)`` is ``WAIT_EXCHANGE_FLAG`` here. The op loader
checks the compiled op's ``codes()`` against these values, so a build older than the header is
refused rather than misread.
"""

import re

from ..op_builder.comet import csrc_dir

HEADER = "comet.h"
_ENTRY = re.compile(r"^\s*X\((\w+),\s*(-?\d+)\)", re.MULTILINE)


def header_constants() -> dict[str, int]:
    """``{CamelName: value}`` as the header's ``DS_COMET_CONSTANTS`` lists them."""
    text = (csrc_dir() / HEADER).read_text()
    found = {name: int(value) for name, value in _ENTRY.findall(text)}
    if not found:
        raise RuntimeError(f"no DS_COMET_CONSTANTS entries found in {csrc_dir() / HEADER}")
    return found


CONSTANTS = header_constants()


def _constant(name: str) -> int:
    if name not in CONSTANTS:
        raise RuntimeError(f"{csrc_dir() / HEADER} lacks the constant {name} in DS_COMET_CONSTANTS")
    return CONSTANTS[name]


WAIT_EXCHANGE_FLAG = _constant("WaitExchangeFlag")
WAIT_DISPATCH_TILE = _constant("WaitDispatchTile")
WAIT_COMBINE_CHUNK = _constant("WaitCombineChunk")
WORKSPACE_OVERFLOW = _constant("WorkspaceOverflow")
WAIT_DISPATCH_STAGE = _constant("WaitDispatchStage")
WAIT_COMBINE_REDUCE = _constant("WaitCombineReduce")
HEADER_MISMATCH = _constant("HeaderMismatch")
HEADER_WORDS = _constant("HeaderWords")
STAGE_PIECE_ROWS = _constant("StagePieceRows")
ERROR_RECORD_WORDS = _constant("ErrorRecordWords")
ERROR_RECORD_WAIT_NS = _constant("ErrorRecordWaitNs")
ERROR_FILLED = _constant("ErrorFilled")
ERROR_RANK = _constant("ErrorRank")
ERROR_KIND = _constant("ErrorKind")
ERROR_INDEX = _constant("ErrorIndex")
ERROR_TARGET = _constant("ErrorTarget")
ERROR_OBSERVED = _constant("ErrorObserved")
ERROR_WAITED_NS = _constant("ErrorWaitedNs")
MAX_COMBINE_TOP_K = _constant("MaxCombineTopK")
TOTALS_WORDS = _constant("TotalsWords")
TOTAL_TILES = _constant("TotalTiles")
TOTAL_KEPT = _constant("TotalKept")
TOTAL_RECV_ROWS = _constant("TotalRecvRows")
TOTAL_PIECES = _constant("TotalPieces")
TOTAL_GENERATION = _constant("TotalGeneration")
TOTAL_COMBINE_CLAIM = _constant("TotalCombineClaim")
TOTAL_ERROR_CLAIM = _constant("TotalErrorClaim")
TOTAL_OWN_ROUTES = _constant("TotalOwnRoutes")
TOTAL_STAGED_SENT = _constant("TotalStagedSent")
