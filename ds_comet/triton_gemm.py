"""The two grouped GEMMs of the fused pipeline, in Triton.

GEMM1 (layer0) reads the receive buffer that the dispatch kernels of every rank fill, and waits per
row tile until all of the tile's rows have arrived; tiles holding only this rank's own rows come
first, the others in arrival order. GEMM2 (layer1) computes column chunk by column chunk, each
across all experts, and stores every output row straight into the returning buffer of the rank the
token came from, then tells that rank how many rows of the chunk it delivered.

Expert weights stay in DeepSpeed's per-expert modules: the kernels read them through device tables
of per-expert pointers (ZeRO may move parameters, so the tables are rebuilt when pointers change).
"""

import triton
import triton.language as tl

ACT_GELU, ACT_GELU_TANH, ACT_RELU, ACT_SILU = 0, 1, 2, 3
ACTIVATION_CODES = {"gelu": ACT_GELU, "gelu_tanh": ACT_GELU_TANH, "relu": ACT_RELU, "silu": ACT_SILU}


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.global.acquire.sys.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _global_timer(anchor):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [anchor], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _trap(anchor):
    return tl.inline_asm_elementwise("mov.u32 $0, 0; trap;", "=r,l", [anchor], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_at_least(counter, target, timeout_ns, error_addr, rank, index, WAIT_KIND: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Spin until *counter >= target; past timeout_ns record the wait in the error record and trap."""
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
                tl.store(record + 1, tl.zeros([], tl.int64) + rank)
                tl.store(record + 2, WAIT_KIND)
                tl.store(record + 3, index.to(tl.int64))
                tl.store(record + 4, target.to(tl.int64))
                tl.store(record + 5, seen.to(tl.int64))
                tl.store(record + 6, waited)
                tl.store(record, 1)
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


# Not specialised: a rank of 1 would otherwise become a constant, and each rank its own compile.
@triton.jit(do_not_specialize=["error_addr", "timeout_ns", "rank"])
def gemm1_kernel(recv, h, w1_table, b1_table, w3_table, b3_table, layout, tile_counters, error_addr, timeout_ns,
                 rank, hidden, ffn, num_local, off_expert_start, off_tile_start, off_local_tiles, off_remote_tiles,
                 off_total_tiles, L_POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                 ACTIVATION: tl.constexpr, WAIT: tl.constexpr, INTERPRET: tl.constexpr):
    """h[rows of expert l] = act(recv[rows] @ W1_l^T + b1_l) (gated: * (recv[rows] @ W3_l^T + b3_l))."""
    dtype = recv.dtype.element_ty
    total_m = tl.load(layout + off_total_tiles)
    n_tiles = tl.cdiv(ffn, BN)
    lanes = tl.arange(0, L_POW2)
    local_prefix = tl.load(layout + off_local_tiles + lanes, mask=lanes <= num_local, other=1 << 30)
    remote_prefix = tl.load(layout + off_remote_tiles + lanes, mask=lanes <= num_local, other=1 << 30)
    local_total = tl.load(layout + off_local_tiles + num_local)
    offs_k = tl.arange(0, BK)

    for tile in range(tl.program_id(0), total_m * n_tiles, NUM_PROGS):
        slot, pid_n = _swizzle(tile, total_m, n_tiles, GROUP_M)
        # The schedule: every expert's tiles of own rows, then every expert's remaining tiles.
        if slot < local_total:
            expert = _find_expert(local_prefix, slot)
            t = slot - tl.load(layout + off_local_tiles + expert)
        else:
            remote_slot = slot - local_total
            expert = _find_expert(remote_prefix, remote_slot)
            full_local = tl.load(layout + off_local_tiles + expert + 1) - tl.load(layout + off_local_tiles + expert)
            t = full_local + remote_slot - tl.load(layout + off_remote_tiles + expert)
        row_end = tl.load(layout + off_expert_start + expert + 1)
        tile_row = tl.load(layout + off_expert_start + expert) + t * BM
        if WAIT:
            tile_index = tl.load(layout + off_tile_start + expert) + t
            _wait_at_least(tile_counters + tile_index, tl.minimum(row_end - tile_row, BM), timeout_ns, error_addr, rank,
                           tile_index, 2, INTERPRET)

        offs_m = tile_row + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        m_mask = offs_m < row_end
        n_mask = offs_n < ffn
        # Weights are 16-byte aligned (ExpertTables checks): say so, or the loads cannot be vectorised.
        w1 = tl.multiple_of(tl.load(w1_table + expert).to(tl.pointer_type(dtype)), 16)
        a_ptrs = recv + offs_m[:, None] * hidden + offs_k[None, :]
        b_ptrs = w1 + offs_n[:, None] * hidden + offs_k[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if GATED:
            w3 = tl.multiple_of(tl.load(w3_table + expert).to(tl.pointer_type(dtype)), 16)
            b3_ptrs = w3 + offs_n[:, None] * hidden + offs_k[None, :]
            acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(hidden, BK)):
            k_mask = offs_k < hidden - k * BK
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            if GATED:
                b3 = tl.load(b3_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                acc3 = tl.dot(a, tl.trans(b3), acc3)
                b3_ptrs += BK
            a_ptrs += BK
            b_ptrs += BK

        if HAS_BIAS:
            bias1 = tl.load(b1_table + expert).to(tl.pointer_type(dtype))
            acc += tl.load(bias1 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = _activation(acc, ACTIVATION)
        if GATED:
            if HAS_BIAS:
                bias3 = tl.load(b3_table + expert).to(tl.pointer_type(dtype))
                acc3 += tl.load(bias3 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            out = out * acc3
        tl.store(h + offs_m[:, None] * ffn + offs_n[None, :], out.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def gemm2_kernel(h, w2_table, b2_table, origin, ret_table, chunk_counter_table, layout, hidden, ffn, num_local,
                 off_expert_start, off_tile_start, off_total_tiles, EP_SIZE: tl.constexpr, L_POW2: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 CHUNK_TILES: tl.constexpr, NUM_PROGS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y = h[rows of expert l] @ W2_l^T + b2_l, each row stored into its source rank's return buffer.

    Tiles go column chunk by column chunk (CHUNK_TILES column tiles each), every chunk across all
    experts; after storing a tile, the program adds to each source's counter of that chunk the
    number of the tile's rows that came from it.
    """
    dtype = h.dtype.element_ty
    total_m = tl.load(layout + off_total_tiles)
    n_tiles = tl.cdiv(hidden, BN)
    lanes = tl.arange(0, L_POW2)
    tile_prefix = tl.load(layout + off_tile_start + lanes, mask=lanes <= num_local, other=1 << 30)
    offs_k = tl.arange(0, BK)

    for tile in range(tl.program_id(0), total_m * n_tiles, NUM_PROGS):
        chunk = tile // (total_m * CHUNK_TILES)
        chunk_cols = tl.minimum(CHUNK_TILES, n_tiles - chunk * CHUNK_TILES)
        m, n_in_chunk = _swizzle(tile - chunk * total_m * CHUNK_TILES, total_m, chunk_cols, GROUP_M)
        expert = _find_expert(tile_prefix, m)
        t = m - tl.load(layout + off_tile_start + expert)
        row_end = tl.load(layout + off_expert_start + expert + 1)
        offs_m = tl.load(layout + off_expert_start + expert) + t * BM + tl.arange(0, BM)
        offs_n = (chunk * CHUNK_TILES + n_in_chunk) * BN + tl.arange(0, BN)
        m_mask = offs_m < row_end
        n_mask = offs_n < hidden

        w2 = tl.multiple_of(tl.load(w2_table + expert).to(tl.pointer_type(dtype)), 16)
        a_ptrs = h + offs_m[:, None] * ffn + offs_k[None, :]
        b_ptrs = w2 + offs_n[:, None] * ffn + offs_k[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(ffn, BK)):
            k_mask = offs_k < ffn - k * BK
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BK
            b_ptrs += BK
        if HAS_BIAS:
            bias2 = tl.load(b2_table + expert).to(tl.pointer_type(dtype))
            acc += tl.load(bias2 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]

        row_origin = tl.load(origin + offs_m, mask=m_mask, other=0)
        source = (row_origin >> 32).to(tl.int32)
        position = row_origin & 0xFFFFFFFF
        dest_base = tl.load(ret_table + source, mask=m_mask, other=0).to(tl.pointer_type(dtype))
        dest = dest_base[:, None] + position[:, None] * hidden + offs_n[None, :]
        tl.store(dest, acc.to(dtype), mask=m_mask[:, None] & n_mask[None, :])
        # Every thread's stores are done before the (one-thread, release) count below.
        tl.debug_barrier()
        for p in tl.static_range(EP_SIZE):
            delivered = tl.sum((m_mask & (source == p)).to(tl.int32))
            if delivered > 0:
                counter = tl.load(chunk_counter_table + p).to(tl.pointer_type(tl.int32))
                tl.atomic_add(counter + chunk, delivered, sem="release", scope="sys")
