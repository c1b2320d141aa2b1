"""The header of a layer's exchanges: which layer, which call of it, which direction, which settings.

Every call of an MoE layer exchanges rows between the ranks of its expert-parallel group, and every
rank must be in the same exchange: the same layer, the same call of it, forward or backward, in the
same mode, with the same settings. A rank that calls the layers in another order, runs a backward or
an evaluation forward that its peers do not, or changes a setting alone would otherwise trade rows
with another exchange: rows of another layer mixed into its sums, or, where the sizes differ, a
transport that ends the process (gloo's "Received data size doesn't match expected size").

Each exchange therefore carries ``HEADER_WORDS`` words (csrc/comet.h; ``ExchangeHeader.words``, in
the order of ``layout.HEADER_FIELDS``), each below 2**31 so that the fused kernels hold them in the
int32 words of their metadata:

- the layer: a stable hash of its name (the module's path under ``ds_comet.initialize``, else
  ``MoE layer <n>`` in construction order), the same on every rank that builds the same model;
- the call: the layer's forward calls on this rank, this one included (a backward carries the call
  it belongs to);
- the direction: forward in training, forward in evaluation, or backward;
- the settings' digest: a stable hash of what every rank must share (k, the gate's capacity
  factors, the chunks, the hidden size, the dtype, the experts' shapes: ``PipelineSelection``'s
  settings), kept by name beside it so that an error can say which one differs.

The reference pipeline exchanges the header first, before any collective whose size the ranks could
disagree on, in an all_to_all of fixed size (``check_header``), and once more before the first
collective of its backward. On a mismatch every rank sees every rank's words; they then gather their
names and settings (one more collective, on this path only) and raise the same ``ExchangeMismatch``.
The fused pipeline's exchange kernel publishes the words beside its counts and compares each peer's
with its own (csrc/exchange_kernels.cu); a mismatch stops it as a wait that timed out does.
"""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..kernels.constants import HEADER_WORDS
from ..kernels.layout import HEADER_FIELDS
from .collective_waits import NOTED, CollectiveWaits, describe_ranks, gather_objects

FORWARD_TRAINING, FORWARD_EVALUATION, BACKWARD = 1, 2, 3
DIRECTIONS = {FORWARD_TRAINING: "forward (training)", FORWARD_EVALUATION: "forward (evaluation)", BACKWARD: "backward"}
WORD_RANGE = 2**31  # every word is below it: the fused kernels keep them in int32
NO_HEADER = [0] * HEADER_WORDS  # the header of a pipeline used without a selection: the same on every rank


class GroupDisagreement(RuntimeError):
    """The ranks of an expert-parallel group called a layer with settings that do not line up."""


class ExchangeMismatch(GroupDisagreement):
    """The ranks of an expert-parallel group are not in the same exchange: another layer, another call
    of it, another direction or mode, or other settings (the message names them, rank by rank)."""


def stable_hash(text: str) -> int:
    """A hash of ``text`` below ``WORD_RANGE``, the same in every process (Python's ``hash`` of a str
    is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % WORD_RANGE


@dataclass(frozen=True)
class ExchangeHeader:
    """One exchange's header (see the module's docstring); ``layer_name`` and ``settings`` travel
    only in the error path's gather."""

    layer: int
    call: int
    direction: int
    digest: int
    layer_name: str = field(compare=False)
    settings: tuple = field(compare=False, repr=False)

    def words(self) -> list[int]:
        """The ``HEADER_WORDS`` words every rank compares (``layout.HEADER_FIELDS``: layer, call,
        direction, digest), each in [0, 2**31)."""
        return [getattr(self, name) for name in HEADER_FIELDS]

    def backward(self) -> "ExchangeHeader":
        """The header of this call's backward."""
        return replace(self, direction=BACKWARD)

    def describe(self) -> str:
        return f"{self.layer_name}, {DIRECTIONS.get(self.direction, self.direction)} of call {self.call}"


class LayerHeaders:
    """One layer's headers on this rank: its forward calls, and its settings' digest, computed again
    only when the settings' key changes. ``current`` is the header of the call in progress (None
    before the first)."""

    def __init__(self):
        self.calls = 0
        self.current: ExchangeHeader | None = None
        self._key = None
        self._settings: tuple = ()
        self._digest = 0
        self._names: dict[str, int] = {}

    def begin_call(self, layer_name: str, train: bool, key, settings: Callable[[], tuple]) -> ExchangeHeader:
        """Counts a forward call and returns its header. ``key`` stands for the settings (compared,
        not hashed: the digest is made again only when it changes); ``settings()`` -> the
        (name, value) pairs the ranks must share, read only then."""
        self.calls += 1
        if key != self._key:
            self._key, self._settings = key, settings()
            self._digest = stable_hash(repr(self._settings))
        if layer_name not in self._names:
            self._names[layer_name] = stable_hash(layer_name)
        self.current = ExchangeHeader(
            layer=self._names[layer_name],
            call=self.calls % WORD_RANGE,
            direction=FORWARD_TRAINING if train else FORWARD_EVALUATION,
            digest=self._digest,
            layer_name=layer_name,
            settings=self._settings,
        )
        return self.current


# Eager under torch.compile, as the exchanges are (reference.py): a collective read back on the host.
@torch.compiler.disable
def check_header(header: ExchangeHeader, waits: CollectiveWaits, before: str) -> None:
    """Compares ``header`` with that of every rank of ``waits.group``, in one all_to_all of
    ``HEADER_WORDS`` int64 words a rank (bounded as ``waits`` bounds it); raises ``ExchangeMismatch``
    on every rank where any differs. The group's first collective of an exchange: its size is the
    same whatever the ranks disagree on. ``before`` names what follows it, in the error of a wait
    that times out."""
    group = waits.group
    on_gpu = torch.distributed.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    world = torch.distributed.get_world_size(group)
    # An all_to_all of the words to every rank (one tensor each way, as the counts' exchange): on gloo
    # (2 ranks, CPU) 0.39 ms against 0.69 ms for an all_gather into a list of tensors.
    mine = torch.tensor(header.words() * world, dtype=torch.int64, device=device)
    everyone = torch.empty_like(mine)
    work = torch.distributed.all_to_all_single(everyone, mine, group=group, async_op=True)
    what = f"the exchange headers of the other ranks (this rank: {header.describe()}; before {before})"
    waits.wait(work, what, on_gpu, read_back=True)
    words = everyone.view(world, HEADER_WORDS).tolist()
    if any(rank_words != words[0] for rank_words in words):
        raise_mismatch(header, waits)


def raise_mismatch(header: ExchangeHeader, waits: CollectiveWaits) -> None:
    """Every rank's name, call, direction and settings, gathered (every rank comes here together:
    each saw every rank's words), and the ``ExchangeMismatch`` that names them."""
    entries = gather_objects(
        (header.layer_name, header.call, header.direction, header.settings),
        waits,
        "the other ranks' exchange headers, which differ from this rank's",
    )
    places: dict[str, list[int]] = {}
    for rank, (name, call, direction, _) in enumerate(entries):
        places.setdefault(ExchangeHeader(0, call, direction, 0, name, ()).describe(), []).append(rank)
    where = "; ".join(f"{_ranks(ranks)}: {place}" for place, ranks in places.items())
    differences = setting_differences([entry[3] for entry in entries])
    message = f"ds_comet: {header.layer_name}: the ranks of its expert-parallel group " + (
        f"are not in the same exchange ({where})" if len(places) > 1 else f"are in {where.partition(': ')[2]}"
    )
    if differences:
        message += f"; they disagree on {'; '.join(differences)}"
    error = ExchangeMismatch(
        message + ". Every rank must call the group's MoE layers in the same order and as many times, run the "
        "backward of every call, in the same mode (training or evaluation), with the same settings"
    )
    setattr(error, NOTED, True)  # every rank raises it: no peer is left waiting to read a note of it
    raise error


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {describe_ranks(ranks)}"


def setting_differences(settings: list[tuple[tuple[str, object], ...]]) -> list[str]:
    """Each setting whose value is not the same on every rank (``settings``: each rank's (name,
    value) pairs, by rank of the group), as ``name (ranks [..]: value; ranks [..]: value)``."""
    differences = []
    names = dict.fromkeys(name for rank_settings in settings for name, _ in rank_settings)
    for name in names:
        values = [dict(rank_settings).get(name) for rank_settings in settings]
        if any(value != values[0] for value in values):
            by_value: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                by_value.setdefault(repr(value), []).append(rank)
            differences.append(f"{name} ({'; '.join(f'ranks {ranks}: {value}' for value, ranks in by_value.items())})")
    return differences
