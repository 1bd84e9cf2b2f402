"""Triton attention over KV cells: the queries of one ubatch against n_kv cells of each group's
stream, flash attention's online softmax, GQA (the r query heads of a KV head share one
program, so each K/V tile is read once for all of them), f32 / f16 / Q8_0 caches dequantised
as the tiles are loaded. Nothing the size of [n_tokens, n_kv] is written.

The mask is either the engine's additive f16 tensor (MASK_CELLS False: read tile by tile, as
the graph hands it over today), or computed in the kernel from the cells (MASK_CELLS True):
a query sees a cell that is not empty, shares its first sequence id (a bit of the cell's
sequence set), is not in its future when causal, and lies inside the sliding window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from ubatch.kernels.cuda.triton import mode
from ubatch.kernels.ops import KV_CHUNK, MASKED, AttentionArgs, KVTensor

FLOAT_KV = frozenset({int(T.F32), int(T.F16), int(T.BF16)})
KV_TYPES = FLOAT_KV | {int(T.Q8_0)}
_FLOOR = tl.constexpr(MASKED)  # the running max never drops below this (rows that saw nothing)


@triton.jit
def _load_kv(P, P8, P16, cell, cm, hk, stride_cell, row_bytes, D: tl.constexpr, BD: tl.constexpr, Q8: tl.constexpr):
    """A [cells, BD] tile of one KV head as f32 (zeros past D and for cells outside cm): float
    rows, or Q8_0 blocks read as [cells, blocks, 32] codes times one f16 scale per block."""
    if Q8:
        b = tl.arange(0, BD // 32)[None, :, None]
        j = tl.arange(0, 32)[None, None, :]
        blk = cell[:, None, None] * row_bytes + (hk * (D // 32) + b) * 34
        m = cm[:, None, None] & (b * 32 < D)
        q = tl.load(P8 + blk + 2 + j, mask=m, other=0).to(tl.float32)
        s = tl.load(P16 + blk // 2, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        return tl.reshape(q * s, [cell.shape[0], BD])
    d = tl.arange(0, BD)[None, :]
    return tl.load(P + cell[:, None] * stride_cell + hk * D + d, mask=cm[:, None] & (d < D), other=0.0).to(tl.float32)


@triton.jit
def _query_rows(T, R, n_head_kv, BM: tl.constexpr):
    """The program's KV stream g and KV head hk (axis 0: g·Hkv + hk) and its block of BM query
    rows (axis 1): row i is token t = i // R, query head h = hk·R + i % R; rm masks rows past T·R."""
    pid = tl.program_id(0)
    g, hk = (pid // n_head_kv).to(tl.int64), pid % n_head_kv
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    return g, hk, rows < T * R, rows // R, hk * R + rows % R


@triton.jit
def _store_rows(O, acc, l_i, g, t, h, rm, T, so, DV: tl.constexpr, BDV: tl.constexpr):  # noqa: E741
    """The output rows, normalised by their sums (a row that saw no cell: 0, not 0/0)."""
    dv = tl.arange(0, BDV)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(O + (g * T + t[:, None]) * so + h[:, None] * DV + dv[None, :], out, mask=rm[:, None] & (dv[None, :] < DV))


@triton.jit
def attention_kernel(
    Q, K, K8, K16, V, V8, V16, STARTS, MASK, VIS, CPOS, CSEQ, QPOS, QLIM, QSEQ, O, PART,  # noqa: E741
    T, R, n_head_kv, n_kv, sq_g, sq_t, sq_h, sk, k_rb, sv, v_rb, sm_g, sm_t, so, n_swa, scale, softcap,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    KQ8: tl.constexpr, VQ8: tl.constexpr, MASK_CELLS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Program (g·Hkv + hk, block of BM query rows, split s); row i is token i // R, head
    hk·R + i % R. SPLIT > 1 (decode over many cells): split s reads 1/SPLIT of the cells and
    leaves its running max, sum and unnormalised output in PART for attention_combine_kernel."""
    g, hk, rm, t, h = _query_rows(T, R, n_head_kv, BM)
    d, dv = tl.arange(0, BD), tl.arange(0, BDV)
    q = tl.load(Q + g * sq_g + t[:, None] * sq_t + h[:, None] * sq_h + d[None, :], mask=rm[:, None] & (d[None, :] < D))
    start = tl.load(STARTS + g)
    if MASK_CELLS:
        qpos = tl.load(QPOS + g * T + t, mask=rm, other=0)
        qseq = tl.load(QSEQ + g * T + t, mask=rm, other=0)
        # the last position a query may see: its own, or past every cell (no causality)
        qlim = tl.load(QLIM + g * T + t, mask=rm, other=0)
    m_i = tl.full([BM], _FLOOR, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    if SPLIT == 1:
        lo, hi = 0, n_kv
    else:
        span = tl.cdiv(tl.cdiv(n_kv, SPLIT), BN) * BN
        lo = tl.multiple_of(tl.program_id(2) * span, BN)
        hi = tl.minimum(lo + span, n_kv)
    for n0 in range(lo, hi, BN):
        if tl.load(VIS + n0 // CHUNK):  # some query of the ubatch sees a cell of this chunk
            cols = n0 + tl.arange(0, BN)
            cell = start + cols
            cm = cols < n_kv
            k = _load_kv(K, K8, K16, cell, cm, hk, sk, k_rb, D, BD, KQ8)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            if softcap > 0:  # gemma2: the raw scores capped first, then scaled (llama.cpp's order)
                s = (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * softcap
            s = s * scale
            if MASK_CELLS:
                cpos = tl.load(CPOS + g * n_kv + cols, mask=cm, other=-1)
                cseq = tl.load(CSEQ + g * n_kv + cols, mask=cm, other=0)
                vis = (cpos[None, :] >= 0) & ((cseq[None, :] & qseq[:, None]) != 0) & (cpos[None, :] <= qlim[:, None])
                if n_swa > 0:
                    vis = vis & (qpos[:, None] - cpos[None, :] < n_swa)
                s = tl.where(vis, s, float("-inf"))
            else:
                mk = tl.load(
                    MASK + g * sm_g + t[:, None] * sm_t + cols[None, :],
                    mask=rm[:, None] & cm[None, :],
                    other=float("-inf"),
                )
                s = s + mk.to(tl.float32)
            m_new = tl.maximum(tl.maximum(m_i, tl.max(s, axis=1)), _FLOOR)
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _load_kv(V, V8, V16, cell, cm, hk, sv, v_rb, DV, BDV, VQ8)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
    if SPLIT == 1:
        _store_rows(O, acc, l_i, g, t, h, rm, T, so, DV, BDV)
    else:
        rec = BM * (BDV + 2)
        base = (
            (tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * SPLIT + tl.program_id(2)
        ) * rec
        r = tl.arange(0, BM)
        tl.store(PART + base + r, m_i)
        tl.store(PART + base + BM + r, l_i)
        tl.store(PART + base + 2 * BM + r[:, None] * BDV + dv[None, :], acc)


@triton.jit
def attention_combine_kernel(
    PART,
    O,  # noqa: E741
    T,
    R,
    n_head_kv,
    so,
    DV: tl.constexpr,
    BDV: tl.constexpr,
    BM: tl.constexpr,
    SPLIT: tl.constexpr,  # noqa: E741
):
    """The SPLIT partial results of one program of attention_kernel, rescaled to their common
    running max and summed: the same softmax as one pass over all the cells."""
    g, _, rm, t, h = _query_rows(T, R, n_head_kv, BM)
    r, dv = tl.arange(0, BM), tl.arange(0, BDV)
    rec = BM * (BDV + 2)
    base = (tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * SPLIT * rec
    m = tl.max(tl.load(PART + base + tl.arange(0, SPLIT)[:, None] * rec + r[None, :]), axis=0)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    for s in tl.static_range(SPLIT):
        w = tl.exp(tl.load(PART + base + s * rec + r) - m)
        l_i += tl.load(PART + base + s * rec + BM + r) * w
        acc += tl.load(PART + base + s * rec + 2 * BM + r[:, None] * BDV + dv[None, :]) * w[:, None]
    _store_rows(O, acc, l_i, g, t, h, rm, T, so, DV, BDV)


def blocks(rows: int, d: int, interpreted: bool = False) -> tuple[int, int, int]:
    """(BM, BN, num_warps): query rows and cells per tile. The f32 (ieee) tl.dot runs on FMA
    units and holds its tiles in registers, so the tiles are the largest that compile for sm_90
    with (almost) no spill: checked with scripts/triton_compile_check.py's register column. The
    interpreter pays per operation, not per element: there one tile spans a 256-cell chunk."""
    if interpreted:
        return max(16, triton.next_power_of_2(rows)), KV_CHUNK, 4
    if d > 256:  # latent attention's 576-wide row (deepseek2): smaller tiles to fit sm_90's shared memory
        return 16, 16, 8
    if rows <= 16:  # decode
        return 16, 64 if d <= 64 else 32, 4
    return {64: (64, 64, 8), 128: (32, 32, 4)}.get(d, (32, 32, 8))


def splits(rows: int, n_kv: int, programs: int, interpreted: bool = False) -> int:
    """How many ways a decode's cells are split: until the GPU's 132 SMs have work, each split
    keeping at least 128 cells; 1 for prefill (its row blocks fill the GPU) and the interpreter."""
    s = 1
    while not interpreted and rows <= 16 and s < 8 and programs * s * 2 <= 132 and n_kv // (2 * s) >= 128:
        s *= 2
    return s


def _split(rows: int, d: int, n_kv: int, programs: int, kq8: bool) -> int:
    spills = kq8 and d > 128  # the Q8_0 tile loads spill there: keep one pass (for now)
    return splits(rows, n_kv, programs, mode.interpreted() or spills)


def partials(g: int, t: int, h: int, d: int, n_head_kv: int, n_kv: int, dv: int, kq8: bool) -> int:
    """f32 elements of a split decode's partial results (0 for one pass): what `attention`
    needs as `part` for these shapes with the default tiles and splits."""
    r = h // n_head_kv
    bm = blocks(t * r, d, mode.interpreted())[0]
    programs = g * n_head_kv * triton.cdiv(t * r, bm)
    sp = _split(t * r, d, n_kv, programs, kq8)
    return programs * sp * bm * (triton.next_power_of_2(dv) + 2) if sp > 1 else 0


def _views(kv: KVTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(float data, int8 view, int16 view, cell stride in elements, row bytes) of a store."""
    if kv.ggml_type == T.Q8_0:
        flat = kv.data.view(-1)
        return flat, flat.view(torch.int8), flat.view(torch.int16), 0, kv.data.shape[1]
    return kv.data, kv.data, kv.data, kv.n_head * kv.head_dim, 0


def attention(
    a: AttentionArgs[torch.Tensor],
    out: torch.Tensor,
    part: torch.Tensor | None = None,
    tiles: tuple[int, int, int] | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """q (G, T, H, D) with unit stride in D; out (G·T, H·Dv) contiguous. With `a.cells` the
    kernel computes the mask from them instead of reading `a.mask` (G, T, n_kv); a query's
    causal limit is its position, or INT32_MAX where attention is not causal, so a graph planned
    before it knows the attention type serves both. `part`: f32 scratch of at least `partials`
    elements for a split decode (the graph plans it in the workspace), else allocated here.
    `tiles` = (BM, BN, warps) overrides `blocks` and `split` overrides `splits` (tests run the
    GPU's choices in the interpreter)."""
    q, k, v, n_kv, cells = a.q, a.k, a.v, a.n_kv, a.cells
    g, t, h, d = q.shape
    r = h // k.n_head
    starts = a.starts.to(q.device)
    visible = (
        a.visible if a.visible is not None else torch.ones(-(-n_kv // KV_CHUNK), dtype=torch.bool, device=q.device)
    )
    bm, bn, nw = tiles or blocks(t * r, d, mode.interpreted())
    kf, k8, k16, sk, k_rb = _views(k)
    vf, v8, v16, sv, v_rb = _views(v)
    if cells is not None:
        cpos, cseq, qpos, qseq, qlim, n_swa = (
            cells.cell_pos, cells.cell_seq, cells.query_pos, cells.query_seq, cells.query_lim, cells.n_swa
        )  # fmt: skip
        mk, sm = starts, (0, 0)
    elif a.mask is not None:
        cpos = cseq = qpos = qlim = qseq = starts  # not read
        n_swa, mk, sm = 0, a.mask, (a.mask.stride(0), a.mask.stride(1))
    else:
        raise ValueError("attention needs a mask tensor or the cells to compute it from")
    grid = (g * k.n_head, triton.cdiv(t * r, bm))
    sp = split or _split(t * r, d, n_kv, grid[0] * grid[1], k.ggml_type == T.Q8_0)
    bdv = triton.next_power_of_2(v.head_dim)
    n_part = grid[0] * grid[1] * sp * bm * (bdv + 2) if sp > 1 else 0
    if n_part == 0:
        part = out
    elif part is None or part.numel() < n_part:
        part = torch.empty(n_part, device=q.device)
    attention_kernel[(*grid, sp)](
        q, kf, k8, k16, vf, v8, v16, starts, mk, visible, cpos, cseq, qpos, qlim, qseq, out, part,
        t, r, k.n_head, n_kv, q.stride(0), q.stride(1), q.stride(2), sk, k_rb, sv, v_rb, sm[0], sm[1],
        out.stride(0), n_swa, a.scale, a.softcap,
        D=d, DV=v.head_dim, BD=triton.next_power_of_2(d), BDV=bdv,
        KQ8=k.ggml_type == T.Q8_0, VQ8=v.ggml_type == T.Q8_0, MASK_CELLS=cells is not None,
        BM=bm, BN=bn, CHUNK=KV_CHUNK, SPLIT=sp, num_warps=nw,
    )  # fmt: skip
    if sp > 1:
        attention_combine_kernel[grid](
            part, out, t, r, k.n_head, out.stride(0), DV=v.head_dim, BDV=bdv, BM=bm, SPLIT=sp
        )
    return out


def _spec(d: int, kv: str, q8: bool, mask_cells: bool, rows: int, split: int = 1) -> tuple:
    bm, bn, nw = blocks(rows, d)
    kv = "u8" if q8 else kv
    ptr = {"K": f"*{kv}", "K8": "*i8", "K16": "*i16", "V": f"*{kv}", "V8": "*i8", "V16": "*i16"}
    sig = {"Q": "*fp32", **ptr, "STARTS": "*i64", "MASK": "*fp16", "VIS": "*i1", "CPOS": "*i32", "CSEQ": "*i64",
           "QPOS": "*i32", "QLIM": "*i32", "QSEQ": "*i64", "O": "*fp32", "PART": "*fp32"}  # fmt: skip
    sig |= {a: "i32" for a in ("T", "R", "n_head_kv", "n_kv", "sq_g", "sq_t", "sq_h", "sk", "k_rb", "sv", "v_rb",
                               "sm_g", "sm_t", "so", "n_swa")}  # fmt: skip
    sig["scale"] = sig["softcap"] = "fp32"
    bd = triton.next_power_of_2(d)
    const = {"D": d, "DV": d, "BD": bd, "BDV": bd, "KQ8": q8, "VQ8": q8, "MASK_CELLS": mask_cells,
             "BM": bm, "BN": bn, "CHUNK": KV_CHUNK, "SPLIT": split}  # fmt: skip
    sig |= {c: "constexpr" for c in const}
    name = f"attention_d{d}_{'q8_0' if q8 else kv}_{'cells' if mask_cells else 'mask'}_bm{bm}_split{split}"
    return (name, attention_kernel, sig, const, {"num_warps": nw})


def _combine_spec(d: int, split: int) -> tuple:
    sig = {"PART": "*fp32", "O": "*fp32", "T": "i32", "R": "i32", "n_head_kv": "i32", "so": "i32"}
    const = {"DV": d, "BDV": triton.next_power_of_2(d), "BM": 16, "SPLIT": split}
    return (
        f"attention_combine_d{d}_split{split}",
        attention_combine_kernel,
        sig | dict.fromkeys(const, "constexpr"),
        const,
    )


COMPILE_SPECS = [
    *[
        _spec(d, kv, q8, cells, rows)
        for d in (64, 128, 256)
        for kv, q8 in (("fp16", False), ("fp32", False), ("fp16", True))
        for cells in (False, True)
        for rows in (4, 512)
    ],
    *[
        _spec(d, "fp16", q8, cells, 4, sp)
        for d in (64, 128, 256)
        for q8 in (False, True)
        for cells in (False, True)
        for sp in (2, 4, 8)
    ],
    *[_combine_spec(d, sp) for d in (64, 128, 256) for sp in (2, 4, 8)],
    # DeepSeek-V2(-Lite)'s latent attention: one KV head of kv_lora_rank 512 + 64 RoPE dims, V = K
    *[_spec(576, "fp16", False, cells, 4) for cells in (False, True)],
    *[_spec(576, "fp16", False, True, 4, sp) for sp in (2, 4)],
    *[_combine_spec(576, sp) for sp in (2, 4)],
]
