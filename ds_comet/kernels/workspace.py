"""CometBuffer: the fused pipeline's workspace for one expert-parallel group inside one node.

One object owns everything the kernels share across ranks: the receive buffer the dispatch writes
and GEMM1 reads, the rows the dispatch stages from other ranks (each token once) with the routes
and gates of each, the rows the combine sums per staged token and the source ranks read, the row
origins, the backward's gate-gradient dot products, and the int32 meta array of exchanged counts,
flags and arrival counters. All of it is one allocation of
torch symmetric memory (peer pointers through CUDA IPC), made once from the largest token count
the layers will see and reused every call; the kernels reset the counters they use each call.

Ranks that share a GPU (a test machine with one GPU, say) get the same workspace through legacy
CUDA IPC handles instead, since torch's symmetric memory refuses them. The GPU then time-slices
between the ranks' processes, and a kernel waiting for a peer proceeds only in the peer's slices:
correct, but far slower than one rank a GPU.
"""

import math
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from deepspeed.utils import logger

from . import layout
from .constants import ERROR_RECORD_WORDS, ERROR_WAITED_NS, STAGE_PIECE_ROWS
from .ops import describe_error_record, load_op

ALIGN = 256  # bytes; keeps every part 16-byte aligned for vector copies


@dataclass(frozen=True)
class BufferShape:
    ep_size: int
    num_experts: int
    hidden: int
    dtype: torch.dtype
    max_tokens: int
    max_recv_rows: int
    top_k: int
    tile_m: int
    max_chunks: int = 64

    @property
    def max_routes(self) -> int:
        return self.top_k * self.max_tokens

    @property
    def max_tiles(self) -> int:
        return math.ceil(self.max_recv_rows / self.tile_m) + self.num_experts // self.ep_size

    @property
    def max_staged_rows(self) -> int:
        """Rows other ranks can stage on a rank in one call: each a token of another rank (at most
        ``max_tokens`` a rank) with a route there (at most its received rows)."""
        return min(self.max_recv_rows, (self.ep_size - 1) * self.max_tokens)

    @property
    def max_stage_pieces(self) -> int:
        """Staging pieces a rank can receive in one call: its staged rows (``max_staged_rows``) in
        pieces of ``STAGE_PIECE_ROWS`` a source, each source's last piece possibly part full."""
        return math.ceil(self.max_staged_rows / STAGE_PIECE_ROWS) + self.ep_size


def _align(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def _peer_pointers(handle, local: torch.Tensor, ep_size: int):
    pointers = getattr(handle, "buffer_ptrs", None)
    if pointers is None:
        pointers = [handle.get_buffer(p, local.shape, local.dtype).data_ptr() for p in range(ep_size)]
    return [int(p) for p in pointers]


def _ipc_peer_pointers(local: torch.Tensor, group, rank: int, ep_size: int):
    """Every rank's base pointer of ``local``, opened from CUDA IPC handles, and the opened tensors.

    The opened tensors must outlive the kernels that use the pointers; ``local`` must come from
    torch's caching allocator. Each peer gets its own share, whose reference count it releases.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    shares = [None if peer == rank else reduce_tensor(local)[1] for peer in range(ep_size)]
    everyone = [None] * ep_size
    torch_dist.all_gather_object(everyone, shares, group=group)
    opened = [local if peer == rank else rebuild_cuda_tensor(*everyone[peer][rank]) for peer in range(ep_size)]
    return [t.data_ptr() for t in opened], opened


def allocator_ipc_refusal() -> str | None:
    """What in the caching allocator's settings CUDA IPC cannot share between ranks on one GPU, or None.

    Read as torch reads them: PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF; the last value of a
    key wins.
    """
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    settings = {}
    for entry in conf.split(","):
        key, _, value = entry.partition(":")
        settings[key.strip()] = value.strip()
    if settings.get("backend") == "cudaMallocAsync":
        return "the cudaMallocAsync backend, which cannot share IPC handles"
    if settings.get("expandable_segments", "").lower() == "true":
        # Such blocks travel as file descriptors taken with pidfd_getfd, which containers and
        # ptrace_scope usually refuse between sibling processes.
        return "expandable segments"
    return None


def symmetric_parts(shape: BufferShape, meta_words: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The parts of a workspace's symmetric allocation, in their order there: (name, dtype, shape) of
    each, the one list of them. ``CometBuffer`` holds this rank's part under its name, and the
    kernels take every rank's address of it as the op's ``Workspace.peer_<name>``.

    GEMM2's output rows are not here: each call writes them into a tensor of its own, which only this
    rank's combine reads and the forward keeps for the backward (fused.py). The staged rows (each
    token of another rank once, at most max_staged_rows) and their route lists (top_k entries a row)
    are read by this rank's dispatch. The combine sums each staged row's routes into its own row of
    ``reduced``, which the row's source pulls; ``row_dot`` keeps the backward's gate-gradient dot
    product of each received row. ``meta`` holds ``meta_words`` int32 words (``layout.meta_offsets``).
    """
    rows, staged, hidden = shape.max_recv_rows, shape.max_staged_rows, shape.hidden
    stage_entries = staged * shape.top_k
    return [
        ("recv", shape.dtype, (rows, hidden)),
        ("stage", shape.dtype, (staged, hidden)),
        ("reduced", shape.dtype, (staged, hidden)),
        ("origin", torch.int64, (rows,)),
        ("row_dot", torch.float32, (rows,)),
        ("stage_routes", torch.int64, (stage_entries,)),
        ("stage_scale", torch.float32, (stage_entries,)),
        ("meta", torch.int32, (meta_words,)),
    ]


class CometBuffer:
    """The symmetric workspace of one group; build it on every rank of the group at once.

    It holds this rank's part of each of ``symmetric_parts`` under the part's name (``recv``,
    ``stage``, ``reduced``, ``origin``, ``row_dot``, ``stage_routes``, ``stage_scale``, ``meta``),
    the local arrays ``layout`` (int32, ``layout_offsets``), ``route_row`` and ``route_stage``
    ([max_routes] int64 and int32), the pinned ``error_record``, and ``kernel_workspace``: these with
    every rank's address of each part, as the op's exchange, dispatch and combine take them.
    """

    def __init__(self, group, shape: BufferShape, timeout_s: float, shared_device: bool = False):
        """shared_device: some ranks of the group share a GPU (the workspace then goes through CUDA IPC)."""
        self.shape = shape
        self.group = group
        self.op = load_op()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank = torch_dist.get_rank(group) if group is not None else 0
        P, E = shape.ep_size, shape.num_experts
        self.meta_offsets = layout.meta_offsets(P, E, shape.max_tiles, shape.max_chunks, shape.max_stage_pieces)
        self.layout_offsets = layout.layout_offsets(E // P, E)

        parts = symmetric_parts(shape, self.meta_offsets.total)
        bases = self._allocate(parts, shared_device)
        peer_tables = self._place_parts(parts, bases)
        self.meta.zero_()
        self.gemm2_counters = self._gemm2_counters(bases[self.rank] + self._byte_offset["meta"])
        self.tile_counters = self.meta[self.meta_offsets.tile_counter :]
        self.layout = torch.zeros(self.layout_offsets.total, dtype=torch.int32, device=self.device)
        self.route_row = torch.zeros(shape.max_routes, dtype=torch.int64, device=self.device)
        self.route_stage = torch.zeros(shape.max_routes, dtype=torch.int32, device=self.device)
        self.none = torch.empty(0, dtype=torch.float32, device=self.device)  # "none" to the op's optional tensors
        self.error_record = torch.zeros(ERROR_RECORD_WORDS, dtype=torch.int64, pin_memory=True)
        self.kernel_shape = self._kernel_shape(timeout_s)
        self.kernel_workspace = self._kernel_workspace(peer_tables)
        self.comm_stream = torch.cuda.Stream(self.device, priority=-1)
        # Exchanges launched on this workspace so far: each rewrites the layout, which a call's backward
        # reads again in its later autograd nodes (pipelines.fused.PendingBackward checks it).
        self.exchanges = 0
        properties = torch.cuda.get_device_properties(self.device)
        self.num_sms = properties.multi_processor_count
        self.capability = (properties.major, properties.minor)
        # Every rank's meta must be zero before any rank publishes into it.
        torch.cuda.synchronize(self.device)
        torch_dist.barrier(group=group)

    def _allocate(self, parts, shared_device: bool) -> list[int]:
        """Allocates the parts as one block of symmetric memory (through CUDA IPC where ranks share a
        GPU), each at an aligned offset; returns every rank's base address of the block."""
        import torch.distributed._symmetric_memory as symm_mem

        self._byte_offset, total = {}, 0
        for name, dtype, dims in parts:
            self._byte_offset[name] = total
            total += _align(math.prod(dims) * torch.empty((), dtype=dtype).element_size())
        if shared_device:
            logger.warning(
                f"ds_comet: rank {self.rank} shares its GPU with another rank of its expert-parallel "
                "group; the fused kernels will run time-sliced between them, far slower than with "
                "one rank a GPU (under MPS, which runs their kernels side by side, a rank's waiting "
                "kernels can hold the SMs its peer needs until the wait times out)"
            )
            self._storage = torch.empty(total, dtype=torch.uint8, device=self.device)
            bases, self._peer_storage = _ipc_peer_pointers(self._storage, self.group, self.rank, self.shape.ep_size)
            return bases
        self._storage = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            with warnings.catch_warnings():  # deprecated (and unneeded) on newer torch
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.group.group_name)
        handle = symm_mem.rendezvous(self._storage, self.group)
        return _peer_pointers(handle, self._storage, self.shape.ep_size)

    def _place_parts(self, parts, bases: list[int]) -> dict[str, torch.Tensor]:
        """Sets this rank's view of each part as the attribute of its name; returns, by part, the
        table of every rank's address of it ([P] int64 on the device)."""
        tables = {}
        for name, dtype, dims in parts:
            setattr(self, name, self._part(name, dtype, dims))
            addresses = [base + self._byte_offset[name] for base in bases]
            tables[name] = torch.tensor(addresses, dtype=torch.int64, device=self.device)
        return tables

    def _gemm2_counters(self, own_meta: int) -> torch.Tensor:
        """Where GEMM2 counts its finished rows, by the rows' source rank ([P] int64 addresses): this
        rank's own routes on its chunk counters, every other rank's on its reduce counters, which the
        combine's sums here wait for before they count on the sources (all of it this rank's meta,
        at address ``own_meta``)."""
        offsets = self.meta_offsets
        return torch.tensor(
            [
                own_meta + 4 * (offsets.chunk_counter if p == self.rank else offsets.reduce_counter)
                for p in range(self.shape.ep_size)
            ],
            dtype=torch.int64,
            device=self.device,
        )

    def _kernel_workspace(self, peer_tables: dict[str, torch.Tensor]):
        """The op's ``Workspace``: every part's peer table, this rank's parts and arrays that the
        kernels address directly, and the error record's address."""
        return self.op.Workspace(
            **{f"peer_{name}": table for name, table in peer_tables.items()},
            meta=self.meta,
            row_dot=self.row_dot,
            stage_routes=self.stage_routes,
            stage_scale=self.stage_scale,
            layout=self.layout,
            route_row=self.route_row,
            route_stage=self.route_stage,
            error_record=self.error_address,
        )

    def _part(self, name, dtype, shape: tuple[int, ...]) -> torch.Tensor:
        start = self._byte_offset[name]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self._storage[start : start + nbytes].view(dtype).view(shape)

    def _kernel_shape(self, timeout_s: float):
        ks = self.op.GroupShape()
        ks.rank, ks.ep_size, ks.num_experts = self.rank, self.shape.ep_size, self.shape.num_experts
        ks.tile_m, ks.max_recv_rows = self.shape.tile_m, self.shape.max_recv_rows
        ks.max_tiles, ks.max_chunks = self.shape.max_tiles, self.shape.max_chunks
        ks.max_stage_pieces = self.shape.max_stage_pieces
        ks.timeout_ns = int(timeout_s * 1e9)
        meta = self.op.MetaOffsets()
        for field in (
            "counts",
            "exchange_flag",
            "tile_counter",
            "chunk_counter",
            "stage_counter",
            "reduce_counter",
            "generation",
            "header",
        ):
            setattr(meta, field, getattr(self.meta_offsets, field))
        offsets = self.op.LayoutOffsets()
        for field in (
            "expert_start",
            "tile_start",
            "local_tiles",
            "remote_tiles",
            "send_offset",
            "dest_row",
            "dest_rel",
            "dest_tile",
            "send_order",
            "piece_start",
            "stage_send",
            "stage_dest_row",
            "stage_dest_piece",
            "stage_recv_row",
            "stage_recv_piece",
            "totals",
        ):
            setattr(offsets, field, getattr(self.layout_offsets, field))
        ks.meta, ks.layout = meta, offsets
        return ks

    @property
    def error_address(self) -> int:
        return self.error_record.data_ptr()

    def failed_wait(self) -> tuple[str, float] | None:
        """If a kernel of this rank gave up on a wait: the error record's description of that wait
        and when it began (seconds since the epoch, as ``time.time()``); else None."""
        message = describe_error_record(self.error_record)
        if message is None:
            return None
        return message, time.time() - self.error_record[ERROR_WAITED_NS].item() / 1e9

    def check_tokens(self, num_tokens: int):
        if num_tokens > self.shape.max_tokens:
            raise ValueError(
                f"this MoE layer got {num_tokens} tokens on one rank but the fused workspace was "
                f'sized for {self.shape.max_tokens}; set "moe": {{"max_tokens_per_rank": '
                f"{num_tokens}}} (or more) in the ds_config"
            )


_BUFFERS: dict[tuple, CometBuffer] = {}


def get_buffer(group, shape: BufferShape, timeout_s: float, shared_device: bool = False) -> CometBuffer:
    """The group's buffer for this shape, built (collectively) the first time it is asked for."""
    # The group object, not its name: torch numbers group names from 0 again after
    # destroy_process_group, so a group made after a re-initialisation may reuse a dead group's name.
    key = (group, shape, timeout_s)
    if key not in _BUFFERS:
        _BUFFERS[key] = CometBuffer(group, shape, timeout_s, shared_device)
    return _BUFFERS[key]
