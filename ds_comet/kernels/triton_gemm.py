"""The grouped GEMMs of the fused pipeline, in Triton, forward and backward.

The two primitives each run in both directions:

- ``gemm1_kernel`` reads the receive buffer that the dispatch kernels of every rank fill, and
  waits per row tile until all of the tile's rows have arrived; tiles holding only this rank's own
  rows come first, the others in arrival order. Forward it is GEMM1 (``rows @ W1^T``), with the
  activation in its epilogue for gated experts; backward it takes the dispatched output gradients
  and gives ``dY @ W2``. Where it stores plain products (other experts' forward, every backward),
  an elementwise kernel (``triton_activation``) computes the rest from them.
- ``gemm2_kernel`` computes column chunk by column chunk, each across all experts, stores its rows
  locally (a plain row-major store, which needs no more registers than the tile; docs/decisions.md) and
  counts, per source rank of the tile's rows, how many of them the chunk now holds, on the counter
  the caller's table gives for that source (the combine's counters on this rank). Forward it is
  GEMM2 (``h @ W2^T``); backward it gives the rows' input gradients (``dA @ W1``), which the
  combine sums per token.
- ``wgrad_kernel`` gives every local expert's weight gradient (``A_l^T @ B_l`` over its rows), and
  ``expert_column_sums_kernel`` the column sums a bias gradient needs, beside it or beside the
  library's grouped GEMM.

Expert weights stay where the integration keeps them (one module per expert, or AutoEP's stacked
tensors): the kernels read them through device tables of per-expert pointers (ZeRO may move
parameters, so the tables are rebuilt when pointers change).
Weight tiles come through device-side TMA descriptors, one per tile's expert, built from those
pointers; a constexpr says whether a matrix is stored [N, K] (read transposed) or [K, N].
Launchers give Triton an allocator for the descriptors (``triton_phases.with_descriptor_scratch``).
"""

import triton
import triton.language as tl

from . import constants

# The activations (``_activation``, in GEMM1's epilogue and the elementwise kernels), by the names
# ``ds_comet.experts`` uses.
ACTIVATION_CODES = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3}
ERROR_CLAIM_AFTER_TILES = tl.constexpr(constants.TOTAL_ERROR_CLAIM - constants.TOTAL_TILES)
ERROR_RECORD_WAIT_NS = tl.constexpr(constants.ERROR_RECORD_WAIT_NS)
ERROR_FILLED = tl.constexpr(constants.ERROR_FILLED)
ERROR_RANK = tl.constexpr(constants.ERROR_RANK)
ERROR_KIND = tl.constexpr(constants.ERROR_KIND)
ERROR_INDEX = tl.constexpr(constants.ERROR_INDEX)
ERROR_TARGET = tl.constexpr(constants.ERROR_TARGET)
ERROR_OBSERVED = tl.constexpr(constants.ERROR_OBSERVED)
ERROR_WAITED_NS = tl.constexpr(constants.ERROR_WAITED_NS)
WAIT_DISPATCH_TILE = tl.constexpr(constants.WAIT_DISPATCH_TILE)


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise(
        "ld.global.acquire.sys.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _global_timer(anchor):
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,l", [anchor], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _fence_system(anchor):
    return tl.inline_asm_elementwise(
        "fence.sc.sys; mov.u32 $0, 0;", "=r,l", [anchor], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _trap(anchor):
    return tl.inline_asm_elementwise("mov.u32 $0, 0; trap;", "=r,l", [anchor], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_at_least(
    counter, target, timeout_ns, error_addr, error_claim, rank, index, WAIT_KIND: tl.constexpr, INTERPRET: tl.constexpr
):
    """Spin until *counter >= target; past timeout_ns record the wait in the error record and trap.

    Only the first wait to set ``error_claim`` (a device word the CUDA kernels' waits share) fills
    the record, so that its fields describe one wait; the others wait (boundedly) until it is filled,
    because a trap ends every program, the filling one included.
    """
    if INTERPRET:
        # The interpreter runs every producer to completion before a consumer starts.
        seen = tl.atomic_add(counter, 0)
        tl.device_assert(seen >= target, "ds_comet: a GEMM1 row tile is missing rows")
    else:
        seen = _load_acquire(counter)
        if seen < target:
            start = _global_timer(counter)
            waited = start - start
            while (seen < target) & (waited <= timeout_ns):
                seen = _load_acquire(counter)
                waited = _global_timer(counter) - start
            if seen < target:
                record = error_addr.to(tl.pointer_type(tl.int64))
                if tl.atomic_cas(error_claim, 0, 1) == 0:
                    tl.store(record + ERROR_RANK, tl.zeros([], tl.int64) + rank)
                    tl.store(record + ERROR_KIND, WAIT_KIND)
                    tl.store(record + ERROR_INDEX, index.to(tl.int64))
                    tl.store(record + ERROR_TARGET, target.to(tl.int64))
                    tl.store(record + ERROR_OBSERVED, seen.to(tl.int64))
                    tl.store(record + ERROR_WAITED_NS, waited)
                    _fence_system(counter)
                    tl.store(record + ERROR_FILLED, 1)
                    _fence_system(counter)
                else:
                    filled = tl.load(record + ERROR_FILLED, volatile=True)
                    begin = _global_timer(counter)
                    while (filled == 0) & (_global_timer(counter) - begin < ERROR_RECORD_WAIT_NS):
                        filled = tl.load(record + ERROR_FILLED, volatile=True)
                _trap(counter)


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:  # gelu (erf)
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == 1:  # gelu (tanh approximation); tanh(y) = 2 sigmoid(2y) - 1
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * inner)))
    elif ACTIVATION == 2:  # relu
        return tl.maximum(x, 0.0)
    else:  # silu
        return x / (1.0 + tl.exp(-x))


@triton.jit
def _find_expert(prefix, value):
    """Index of the expert whose [prefix[l], prefix[l+1]) holds value (padding entries are huge)."""
    return tl.sum((prefix <= value).to(tl.int32)) - 1


@triton.jit
def _swizzle(tile, rows, cols, GROUP_M: tl.constexpr):
    """(row, col) of tile in a rows x cols grid walked GROUP_M rows at a time, rows fastest."""
    per_group = GROUP_M * cols
    first_row = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(rows - first_row, GROUP_M)
    in_group = tile % per_group
    return first_row + in_group % group_rows, in_group // group_rows


@triton.jit
def _own_rows_first(
    slot,
    local_prefix,
    remote_prefix,
    local_total,
    layout,
    off_expert_start,
    off_local_tiles,
    off_remote_tiles,
    BM: tl.constexpr,
):
    """(expert, its tile index, first row, the expert's row end) of GEMM1's row tile ``slot`` in the
    schedule that runs every expert's tiles of own rows first, then every expert's remaining tiles.

    Branch-free: given this as an if/else, ptxas 12.8 (Triton 3.6's) if-converts the two warp-wide
    reductions of _find_expert under the per-thread predicate that guards the TMA descriptor's
    staging, so warps take the wrong branch's expert and build descriptors of garbage pointers
    (docs/decisions.md). Both answers are in bounds.
    """
    own_tile = slot < local_total
    remote_slot = slot - local_total
    expert = tl.where(own_tile, _find_expert(local_prefix, slot), _find_expert(remote_prefix, remote_slot))
    local_start = tl.load(layout + off_local_tiles + expert)
    full_local = tl.load(layout + off_local_tiles + expert + 1) - local_start
    t = tl.where(own_tile, slot - local_start, full_local + remote_slot - tl.load(layout + off_remote_tiles + expert))
    row_end = tl.load(layout + off_expert_start + expert + 1)
    tile_row = tl.load(layout + off_expert_start + expert) + t * BM
    return expert, t, tile_row, row_end


@triton.jit
def _chunk_major_tile(
    tile,
    total_m,
    n_tiles,
    tile_prefix,
    layout,
    off_expert_start,
    off_tile_start,
    BM: tl.constexpr,
    BN: tl.constexpr,
    GROUP_M: tl.constexpr,
    CHUNK_TILES: tl.constexpr,
):
    """(column chunk, expert, first row, the expert's row end, first column) of GEMM2's ``tile`` in the
    schedule that finishes each chunk of CHUNK_TILES column tiles across all experts before the next."""
    chunk = tile // (total_m * CHUNK_TILES)
    chunk_cols = tl.minimum(CHUNK_TILES, n_tiles - chunk * CHUNK_TILES)
    m, n_in_chunk = _swizzle(tile - chunk * total_m * CHUNK_TILES, total_m, chunk_cols, GROUP_M)
    # Every chunk reads all the rows again. Odd chunks walk them backwards, so a chunk starts on the
    # rows its predecessor read last, which are still in L2.
    m = tl.where(chunk % 2 == 1, total_m - 1 - m, m)
    expert = _find_expert(tile_prefix, m)
    t = m - tl.load(layout + off_tile_start + expert)
    row_end = tl.load(layout + off_expert_start + expert + 1)
    row0 = tl.load(layout + off_expert_start + expert) + t * BM
    return chunk, expert, row0, row_end, (chunk * CHUNK_TILES + n_in_chunk) * BN


@triton.jit
def _weight_tiles(table, expert, dtype, K, N, BK: tl.constexpr, BN: tl.constexpr, W_NK: tl.constexpr):
    """A TMA descriptor of expert's weight matrix: stored [N, K] (read transposed) with W_NK, else [K, N].

    TMA zero-fills tiles past the matrix's edges, which is what masked loads did.
    """
    # What TMA needs: 16-byte aligned weights (PointerTables checks) and rows of a multiple of 16
    # bytes (pipelines/policy.py allows the fused path only for bf16/fp16 with hidden and FFN multiples of 8).
    w = tl.multiple_of(tl.load(table + expert).to(tl.pointer_type(dtype)), 16)
    if W_NK:
        return tl.make_tensor_descriptor(w, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    else:
        return tl.make_tensor_descriptor(w, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])


@triton.jit
def _weight_tile(desc, k0, n0, W_NK: tl.constexpr):
    """The [BK, BN] tile of W at (k0, n0)."""
    if W_NK:
        return tl.trans(desc.load([n0, k0]))
    else:
        return desc.load([k0, n0])


@triton.jit
def _dot_rows(
    acc, acc2, a, lda, offs_m, m_mask, w, w2, n0, K, BK: tl.constexpr, W_NK: tl.constexpr, SECOND: tl.constexpr
):
    """acc + A[offs_m, :K] @ W[:K, n0:n0+BN], W a descriptor from ``_weight_tiles``.

    With SECOND, acc2 also gets the same rows times the matrix of descriptor w2: both products of a
    gated expert's first layer share each loaded tile of A.
    """
    offs_k = tl.arange(0, BK)
    a_ptrs = a + offs_m[:, None] * lda + offs_k[None, :]
    for k in range(0, tl.cdiv(K, BK)):
        k_mask = offs_k < K - k * BK
        x = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, _weight_tile(w, k * BK, n0, W_NK), acc)
        if SECOND:
            acc2 = tl.dot(x, _weight_tile(w2, k * BK, n0, W_NK), acc2)
        a_ptrs += BK
    return acc, acc2


# Not specialised: a rank of 1 would otherwise become a constant, and each rank its own compile.
@triton.jit(do_not_specialize=["error_addr", "timeout_ns", "rank"])
def gemm1_kernel(
    rows,
    out,
    pre,
    w_table,
    w3_table,
    b1_table,
    b3_table,
    layout,
    tile_counters,
    error_addr,
    timeout_ns,
    rank,
    K,
    N,
    num_local,
    off_expert_start,
    off_tile_start,
    off_local_tiles,
    off_remote_tiles,
    off_total_tiles,
    L_POW2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BACKWARD: tl.constexpr,
    ACTIVATE: tl.constexpr,
    STORE_PRE: tl.constexpr,
    WAIT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The first grouped GEMM over the receive buffer ``rows`` ([R, K]), tile by tile as rows arrive
    (``_gemm1_row_tile``).

    Forward (W = W1, [N, K]) with ACTIVATE: out = act(rows @ W1^T + b1) [* (rows @ W3^T + b3)], and
    with STORE_PRE the products before the activation in ``pre`` (``_gemm1_activations``). Forward
    without ACTIVATE (ungated experts): out = rows @ W1^T + b1 alone; backward (W = W2, [K, N]; rows
    are output gradients): out = g = rows @ W2 alone (``_gemm1_store_products``). An elementwise
    kernel computes the rest from those (``triton_activation``); the pipeline runs ungated experts
    that way, training and eval alike (docs/decisions.md). Without ACTIVATE, ``pre``, ACTIVATION and
    STORE_PRE are unused; backward, the other weights, the biases, GATED and HAS_BIAS too.
    """
    tl.static_assert(not (BACKWARD and (STORE_PRE or ACTIVATE)), "gemm1_kernel: the backward stores g alone")
    tl.static_assert(ACTIVATE or not STORE_PRE, "gemm1_kernel: without ACTIVATE, out holds the products")
    tl.static_assert(ACTIVATE or BACKWARD or not GATED, "gemm1_kernel: a gated forward activates in its epilogue")
    dtype = rows.dtype.element_ty
    total_m = tl.load(layout + off_total_tiles)
    n_tiles = tl.cdiv(N, BN)
    lanes = tl.arange(0, L_POW2)
    local_prefix = tl.load(layout + off_local_tiles + lanes, mask=lanes <= num_local, other=1 << 30)
    remote_prefix = tl.load(layout + off_remote_tiles + lanes, mask=lanes <= num_local, other=1 << 30)
    local_total = tl.load(layout + off_local_tiles + num_local)
    for tile in range(tl.program_id(0), total_m * n_tiles, NUM_PROGS):
        expert, tile_row, row_end, pid_n = _gemm1_row_tile(
            tile, total_m, n_tiles, local_prefix, remote_prefix, local_total, layout, tile_counters, error_addr,
            timeout_ns, rank, off_expert_start, off_tile_start, off_local_tiles, off_remote_tiles, off_total_tiles,
            BM, GROUP_M, WAIT, INTERPRET,
        )  # fmt: skip
        offs_m = tile_row + tl.arange(0, BM)
        m_mask = offs_m < row_end
        acc, acc3 = _gemm1_mainloop(
            rows, w_table, w3_table, expert, offs_m, m_mask, pid_n, K, N, dtype, BM, BN, BK, BACKWARD, GATED
        )
        if ACTIVATE:
            _gemm1_activations(
                acc, acc3, out, pre, b1_table, b3_table, expert, offs_m, m_mask, pid_n, N, dtype, BM, BN,
                HAS_BIAS, GATED, ACTIVATION, STORE_PRE,
            )  # fmt: skip
        else:
            _gemm1_store_products(
                acc, out, b1_table, expert, offs_m, m_mask, pid_n, N, dtype, BN, HAS_BIAS and not BACKWARD
            )


@triton.jit
def _gemm1_row_tile(
    tile,
    total_m,
    n_tiles,
    local_prefix,
    remote_prefix,
    local_total,
    layout,
    tile_counters,
    error_addr,
    timeout_ns,
    rank,
    off_expert_start,
    off_tile_start,
    off_local_tiles,
    off_remote_tiles,
    off_total_tiles,
    BM: tl.constexpr,
    GROUP_M: tl.constexpr,
    WAIT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """(expert, first row, the expert's row end, column tile) of GEMM1's ``tile``: row tiles in
    ``_own_rows_first``'s order, GROUP_M at a time; with WAIT, once every row of the tile has arrived."""
    slot, pid_n = _swizzle(tile, total_m, n_tiles, GROUP_M)
    expert, t, tile_row, row_end = _own_rows_first(
        slot, local_prefix, remote_prefix, local_total, layout, off_expert_start, off_local_tiles, off_remote_tiles, BM
    )
    if WAIT:
        tile_index = tl.load(layout + off_tile_start + expert) + t
        _wait_at_least(
            tile_counters + tile_index,
            tl.minimum(row_end - tile_row, BM),
            timeout_ns,
            error_addr,
            layout + off_total_tiles + ERROR_CLAIM_AFTER_TILES,
            rank,
            tile_index,
            WAIT_DISPATCH_TILE,
            INTERPRET,
        )
    return expert, tile_row, row_end, pid_n


@triton.jit
def _gemm1_mainloop(
    rows,
    w_table,
    w3_table,
    expert,
    offs_m,
    m_mask,
    pid_n,
    K,
    N,
    dtype,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BACKWARD: tl.constexpr,
    GATED: tl.constexpr,
):
    """The fp32 products of GEMM1's rows ``offs_m`` with the expert's weights' column tile ``pid_n``:
    forward rows @ W1^T and, gated, rows @ W3^T beside it (each tile of rows loaded once for both);
    backward rows @ W2 (the second result is then unused)."""
    two_products: tl.constexpr = GATED and not BACKWARD
    # Forward reads W1 ([N, K]) as W1^T; backward reads W2 ([K, N]) as it is.
    w = _weight_tiles(w_table, expert, dtype, K, N, BK, BN, not BACKWARD)
    w3 = w
    if two_products:
        w3 = _weight_tiles(w3_table, expert, dtype, K, N, BK, BN, True)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    return _dot_rows(acc, acc, rows, K, offs_m, m_mask, w, w3, pid_n * BN, K, BK, not BACKWARD, two_products)


@triton.jit
def _gemm1_store_products(
    acc, out, b1_table, expert, offs_m, m_mask, pid_n, N, dtype, BN: tl.constexpr, ADD_BIAS: tl.constexpr
):
    """GEMM1's tile of plain products ``acc`` (+ b1 with ADD_BIAS) into ``out`` ([R, N]), a row-major
    store as GEMM2's: an ungated expert's forward products, or the backward's g = dY @ W2. An
    epilogue that read the forward's products and wrote their gradients and the activations held up
    the MMAs; an elementwise kernel after the GEMM (``triton_activation.activation_backward_kernel``)
    was faster (docs/decisions.md)."""
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    if ADD_BIAS:
        bias1 = tl.load(b1_table + expert).to(tl.pointer_type(dtype))
        acc += tl.load(bias1 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    at = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out + at, acc.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemm1_activations(
    acc,
    acc3,
    out,
    pre,
    b1_table,
    b3_table,
    expert,
    offs_m,
    m_mask,
    pid_n,
    N,
    dtype,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PRE: tl.constexpr,
):
    """GEMM1's forward epilogue with the activation: act(acc + b1) [* (acc3 + b3)] into ``out``
    ([R, N]) and, with STORE_PRE, the products before it into ``pre`` ([R, N], gated [R, 2N]: first,
    then up).

    It runs on one column half of the tile at a time. A whole tile's accumulator did not fit the
    registers together with its pre-activations and activations: ptxas spilled up to 2.4 KB a
    thread, and a layer's training step ran 20-45 % slower (docs/decisions.md).
    """
    if GATED:
        pre_cols = 2 * N
    else:
        pre_cols = N
    bias1 = out  # read only with HAS_BIAS
    bias3 = out
    if HAS_BIAS:
        bias1 = tl.load(b1_table + expert).to(tl.pointer_type(dtype))
        if GATED:
            bias3 = tl.load(b3_table + expert).to(tl.pointer_type(dtype))
    acc_left, acc_right = _column_halves(acc, BM, BN)
    acc3_left, acc3_right = _column_halves(acc3, BM, BN)
    half_n = pid_n * BN + tl.arange(0, BN // 2)
    _gemm1_epilogue(
        acc_left,
        acc3_left,
        offs_m,
        m_mask,
        half_n,
        N,
        pre_cols,
        out,
        pre,
        bias1,
        bias3,
        GATED,
        ACTIVATION,
        STORE_PRE,
        HAS_BIAS,
    )
    _gemm1_epilogue(
        acc_right,
        acc3_right,
        offs_m,
        m_mask,
        half_n + BN // 2,
        N,
        pre_cols,
        out,
        pre,
        bias1,
        bias3,
        GATED,
        ACTIVATION,
        STORE_PRE,
        HAS_BIAS,
    )


@triton.jit
def _column_halves(x, BM: tl.constexpr, BN: tl.constexpr):
    """The [BM, BN/2] left and right halves of x. Each thread of an MMA accumulator holds columns
    of both halves, so the split itself moves no data between threads (Triton may still change
    each half's layout for its loads and stores)."""
    return tl.split(tl.permute(tl.reshape(x, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _gemm1_epilogue(
    acc,
    acc3,
    offs_m,
    m_mask,
    offs_n,
    N,
    pre_cols,
    out,
    pre,
    bias1,
    bias3,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PRE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """The forward gemm1_kernel's outputs for the columns offs_n of its tile (acc3: the up products
    of gated experts): the activations, and with STORE_PRE the products before them."""
    dtype = out.dtype.element_ty
    n_mask = offs_n < N
    mn_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_BIAS:
        acc += tl.load(bias1 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc3 += tl.load(bias3 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if STORE_PRE:
        pre_ptrs = pre + offs_m[:, None] * pre_cols + offs_n[None, :]
        tl.store(pre_ptrs, acc.to(dtype), mask=mn_mask)
        if GATED:
            tl.store(pre_ptrs + N, acc3.to(dtype), mask=mn_mask)
    result = _activation(acc, ACTIVATION)
    if GATED:
        result = result * acc3
    tl.store(out + offs_m[:, None] * N + offs_n[None, :], result.to(dtype), mask=mn_mask)


@triton.jit
def gemm2_kernel(
    rows,
    lda,
    w_table,
    w3_table,
    b2_table,
    origin,
    out,
    chunk_counter_table,
    layout,
    K,
    N,
    num_local,
    off_expert_start,
    off_tile_start,
    off_total_tiles,
    EP_SIZE: tl.constexpr,
    L_POW2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    CHUNK_TILES: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SECOND: tl.constexpr,
    W_NK: tl.constexpr,
):
    """out = rows[:, :K] @ W + b2 (+ rows[:, K:2K] @ W3 with SECOND), row for row ([R, N]);
    W is stored [N, K] (and read transposed) with W_NK, else [K, N].

    Forward: rows = h, W = W2^T. Backward: rows = the activation-input gradients, W = W1 (and the up
    projection W3 for gated experts), so y is the rows' input gradient.

    Tiles go column chunk by column chunk (CHUNK_TILES column tiles each), every chunk across all
    experts; after storing a tile, the program adds the number of the tile's rows that came from
    each source rank (origin holds it) to that chunk's counter of ``chunk_counter_table[source]``.
    """
    dtype = rows.dtype.element_ty
    total_m = tl.load(layout + off_total_tiles)
    n_tiles = tl.cdiv(N, BN)
    lanes = tl.arange(0, L_POW2)
    tile_prefix = tl.load(layout + off_tile_start + lanes, mask=lanes <= num_local, other=1 << 30)

    for tile in range(tl.program_id(0), total_m * n_tiles, NUM_PROGS):
        chunk, expert, row0, row_end, n0 = _chunk_major_tile(
            tile, total_m, n_tiles, tile_prefix, layout, off_expert_start, off_tile_start, BM, BN, GROUP_M, CHUNK_TILES
        )
        offs_m = row0 + tl.arange(0, BM)
        offs_n = n0 + tl.arange(0, BN)
        m_mask = offs_m < row_end
        n_mask = offs_n < N

        w = _weight_tiles(w_table, expert, dtype, K, N, BK, BN, W_NK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc, _ = _dot_rows(acc, acc, rows, lda, offs_m, m_mask, w, w, n0, K, BK, W_NK, False)
        if SECOND:
            w3 = _weight_tiles(w3_table, expert, dtype, K, N, BK, BN, W_NK)
            acc, _ = _dot_rows(acc, acc, rows + K, lda, offs_m, m_mask, w3, w3, n0, K, BK, W_NK, False)
        _gemm2_store(acc, out, b2_table, expert, offs_m, m_mask, offs_n, n_mask, N, dtype, HAS_BIAS)
        _count_finished_rows(origin, offs_m, m_mask, chunk_counter_table, chunk, EP_SIZE)


@triton.jit
def _gemm2_store(acc, out, b2_table, expert, offs_m, m_mask, offs_n, n_mask, N, dtype, HAS_BIAS: tl.constexpr):
    """GEMM2's tile ``acc`` (+ b2 with HAS_BIAS) into the rows ``offs_m`` and columns ``offs_n`` of ``out``
    ([R, N]) in ``dtype``: a plain row-major store."""
    if HAS_BIAS:
        bias2 = tl.load(b2_table + expert).to(tl.pointer_type(dtype))
        acc += tl.load(bias2 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out + offs_m[:, None] * N + offs_n[None, :], acc.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _count_finished_rows(origin, offs_m, m_mask, chunk_counter_table, chunk, EP_SIZE: tl.constexpr):
    """After a GEMM2 tile's rows ``offs_m`` are stored: adds, per source rank, how many of them came from
    it (``origin``) to that source's counter of column chunk ``chunk`` (``chunk_counter_table[source]``)."""
    source = (tl.load(origin + offs_m, mask=m_mask, other=0) >> 32).to(tl.int32)
    # Every thread's stores are done before the (one-thread, release) count below.
    tl.debug_barrier()
    for p in tl.static_range(EP_SIZE):
        delivered = tl.sum((m_mask & (source == p)).to(tl.int32))
        if delivered > 0:
            counter = tl.load(chunk_counter_table + p).to(tl.pointer_type(tl.int32))
            tl.atomic_add(counter + chunk, delivered, sem="release", scope="sys")


@triton.jit
def count_received_rows_kernel(
    chunk_counter_table, layout, off_recv_rows, N, CHUNK_COLS: tl.constexpr, BN: tl.constexpr
):
    """After a GEMM2 whose kernel counts no rows (a library's, alone in the group, on the same stream):
    adds every received row once per BN-column tile of column chunk ``program_id(0)`` (CHUNK_COLS
    columns) to this rank's counter of that chunk (``chunk_counter_table[0]``), the sum that
    ``gemm2_kernel``'s tiles add there one by one."""
    chunk = tl.program_id(0)
    rows = tl.load(layout + off_recv_rows)
    first = chunk * CHUNK_COLS
    tiles = tl.cdiv(tl.minimum(N, first + CHUNK_COLS) - first, BN)
    counter = tl.load(chunk_counter_table).to(tl.pointer_type(tl.int32))
    tl.atomic_add(counter + chunk, rows * tiles, sem="release", scope="sys")


@triton.jit
def wgrad_kernel(
    a,
    lda,
    b,
    ldb,
    out,
    layout,
    off_expert_start,
    M,
    N,
    num_local,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr,
):
    """out[l] = a[rows of l, :M]^T @ b[rows of l, :N] ([L, M, N]): the weight gradients of every
    local expert (their bias gradients: ``expert_column_sums_kernel``).

    An expert without rows gets zeros. Accumulates in fp32 and stores in out's dtype.
    """
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_expert = tiles_m * tiles_n
    offs_r = tl.arange(0, BK)
    for tile in range(tl.program_id(0), num_local * per_expert, NUM_PROGS):
        expert = tile // per_expert
        pid_m, pid_n = _swizzle(tile - expert * per_expert, tiles_m, tiles_n, GROUP_M)
        first = tl.load(layout + off_expert_start + expert)
        end = tl.load(layout + off_expert_start + expert + 1)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for r in range(first, end, BK):
            r_mask = (r + offs_r) < end
            x = tl.load(
                a + (r + offs_r)[:, None] * lda + offs_m[None, :], mask=r_mask[:, None] & m_mask[None, :], other=0.0
            )
            y = tl.load(
                b + (r + offs_r)[:, None] * ldb + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0
            )
            acc = tl.dot(tl.trans(x), y, acc)
        base = expert.to(tl.int64) * M * N
        tl.store(
            out + base + offs_m[:, None] * N + offs_n[None, :],
            acc.to(out.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )


@triton.jit
def expert_column_sums_kernel(x, ldx, out, layout, off_expert_start, M, BR: tl.constexpr, BM: tl.constexpr):
    """out[l, :M] = the column sums of x[rows of local expert l, :M] ([L, M] in out's dtype; zeros
    for an expert without rows): the bias gradients beside the weight gradients.

    One program per expert and BM columns walks the expert's rows BR at a time, summing in fp32 in
    a fixed order, so the sums are the same on every run.
    """
    expert = tl.program_id(1)
    cols = tl.program_id(0) * BM + tl.arange(0, BM)
    first = tl.load(layout + off_expert_start + expert)
    end = tl.load(layout + off_expert_start + expert + 1)
    offs_r = tl.arange(0, BR)
    acc = tl.zeros((BR, BM), dtype=tl.float32)
    for r in range(first, end, BR):
        mask = ((r + offs_r) < end)[:, None] & (cols < M)[None, :]
        rows = (r + offs_r).to(tl.int64)
        acc += tl.load(x + rows[:, None] * ldx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out + expert.to(tl.int64) * M + cols, tl.sum(acc, axis=0).to(out.dtype.element_ty), mask=cols < M)
