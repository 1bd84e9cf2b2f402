"""A context: the model plus its KV memory, decoding batches ubatch by ubatch.

`decode` follows llama_context::decode: validate the batch (llama.cpp's rules and messages),
apply pending memory work, split into ubatches and check they all fit, then for each ubatch
place it in the cache, run the forward pass and keep the logits of the slots flagged as
outputs, returned in batch order.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from ubatch.engine.batch import Batch, UBatch
from ubatch.engine.context.announce import Announce, OnChannel
from ubatch.engine.context.messages import Decode, NewContext, new_key
from ubatch.engine.context.mirror import MirroredMemory
from ubatch.engine.context.reserve import Reservation, check_fits, plan_sizes, reserve
from ubatch.engine.context.step_inputs import StepInputs
from ubatch.engine.errors import ContextError, allocate
from ubatch.engine.graph.cuda_graphs import run_step
from ubatch.engine.graph.forward import GraphShape, build_forward
from ubatch.engine.graph.graph import Graph, bind_output, input_views
from ubatch.engine.kv.memory import DecodeError, DecodeStatus, KVMemory
from ubatch.engine.model.hparams import POOLING_TYPES
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams, derive
from ubatch.kernels import backends
from ubatch.kernels.ops import Ops

# planned graphs kept by shape: speculative verifications come in many row counts (1 + draft), and
# rebuilding a graph costs about as much as running it
GRAPHS_KEPT = 32


@dataclass(slots=True)
class PerfCounters:
    """llama_perf_context's counters: multi-token decodes are prompt eval, 1-token ones eval."""

    n_p_eval: int = 0
    t_eval_ms: float = 0.0
    n_eval: int = 0
    n_decode: int = 0
    n_ubatch: int = 0
    graphs_reused: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())


@dataclass(slots=True)
class UBatchRecord:
    """What one ubatch did: the seam for `explain` and the server's per-iteration statistics."""

    n_tokens: int
    n_outputs: int
    n_seqs: int
    seq_ids: list[int]
    n_kv: tuple[int, ...]
    reused: bool
    ms: float
    # the LoRA adapters (index, scale) each sequence of the ubatch applied; empty: the base model
    loras: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)


InputViews = tuple[dict[str, torch.Tensor], dict[str, np.ndarray] | None]


@dataclass(slots=True)
class LastBound:
    """The last ubatch's graph as `Context._bound` left it: reused while a step repeats it."""

    shape: GraphShape
    workspace: torch.Tensor
    dest: tuple[int, torch.Size]  # the output rows' address and shape
    graph: Graph
    direct: bool
    views: InputViews


def make_backend(name: str, n_threads: int) -> Ops:
    """The op backend a context computes with, from the registry (errors as one line)."""
    try:
        return backends.create(name, n_threads)
    except backends.BackendError as e:
        raise ContextError(str(e)) from None


class Context:
    def __init__(
        self,
        model: Model,
        params: ContextParams | None = None,
        ops: Ops | None = None,
        *,
        embeddings: bool = False,
        pooling: str | None = None,
        announce: Announce | None = None,
    ) -> None:
        """`embeddings`: reserve hidden-state rows next to the logits (llama.cpp's
        params.embeddings); `pooling`: none|mean|cls|last|rank, None = the model's own type;
        `announce`: the hook the context's work is told through first (engine/context/announce.py;
        by default rank 0's channel of a tensor-parallel model, else none)."""
        self.model = model
        self.params = params or ContextParams()
        if not model.hparams.causal_attn:  # llama.cpp takes the attention type from the model
            self.params = replace(self.params, causal_attn=False)
        self.pooling = pooling or model.hparams.pooling_type
        if self.pooling not in POOLING_TYPES:
            raise ContextError(f"unknown pooling type {pooling!r}; use one of {', '.join(POOLING_TYPES)}")
        if model.shard is not None and self.params.n_threads <= 0:  # ranks on one machine split its cores
            cores = derive(self.params, model.hparams).n_threads
            self.params = replace(self.params, n_threads=max(1, cores // model.shard.threads_share))
        self.cparams = derive(self.params, model.hparams)
        # tensor parallelism, rank 0: the other ranks build the same context from this message
        shard = model.shard
        if announce is None and shard is not None and shard.channel is not None:
            announce = OnChannel(shard.channel)
        self.announce = announce
        self.tp_key = new_key()  # what rank 0's messages call this context
        if announce is not None:
            with announce(NewContext(self.tp_key, shard.key if shard is not None else 0, params, embeddings, pooling)):
                pass
            weakref.finalize(self, announce.dropped, self.tp_key)
        torch.set_num_threads(self.cparams.n_threads)
        self.ops = ops or make_backend(self.params.backend, self.cparams.n_threads)
        self.ops.prepare_weights(model.matrices())
        # sized first, from shapes alone; refused in one line if the machine cannot hold it
        _, self.reservation, self.sizes = plan_sizes(model, self.cparams, self.ops)
        check_fits(self.sizes, self.cparams, model.device)
        if announce is None:
            self.memory = KVMemory.build(model.hparams, self.cparams, model.device)
        else:
            mirrored = MirroredMemory.build(model.hparams, self.cparams, model.device)
            assert isinstance(mirrored, MirroredMemory)
            self.memory = mirrored.attach(announce, self.tp_key)
        # the per-pair RoPE divisors this context uses (LongRoPE's long or short ones by n_ctx_seq)
        self.rope_freqs = model.rope_factors(self.cparams.n_ctx_seq)
        self.step_inputs = StepInputs(model, self.ops, self.cparams.causal_attn, self.rope_freqs)
        self.perf = PerfCounters()
        self.logits = torch.empty(0, model.hparams.n_vocab)
        self.output_ids: list[int] = []  # batch index of each logits row
        self.records: list[UBatchRecord] = []  # ubatches of the last decode
        # called after each ubatch as observer(batch, ubatch, record): `explain` keeps what it sees
        self.observers: list[Callable[[Batch, UBatch, UBatchRecord], None]] = []
        # LoRA adapters of model.adapters applied, by index: the context's scales (llama.cpp's
        # llama_set_adapters_lora), and per sequence where a request sets its own (the server's `lora`)
        if model.adapters and model.shard is not None:
            raise ContextError("LoRA adapters are not supported with -tp; run without -tp")
        self.lora: dict[int, float] = {}
        self.seq_lora: dict[int, dict[int, float]] = {}
        self._prev_shape: dict[bool, GraphShape] = {}  # llama.cpp keeps one graph with outputs, one without
        self._graphs: OrderedDict[GraphShape, Graph] = OrderedDict()
        self._rows_view: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (buffer, n, its first n rows)
        self._last_bound: LastBound | None = None
        self.workspace = allocate(
            "compute buffer",
            self.reservation.bytes,
            lambda: torch.empty(self.reservation.bytes, dtype=torch.uint8, device=model.device),
        )
        self.workspace_regrows = 0
        # the output buffer: n_seq_max logits rows at start, grown to the largest batch's outputs
        # as llama.cpp's output_reserve does; a decode's logits are valid until the next decode
        self._outputs = self._output_buffer(self.cparams.n_seq_max)
        # llama_set_embeddings: while on, every row is an output and a decode fills `embd` with
        # final-norm hidden states instead of `logits` (engine/generation/embedding.py pools them)
        self.embeddings = False
        self._embd_out = self._output_buffer(self.cparams.n_seq_max if embeddings else 0, model.hparams.n_embd)
        self.embd = self._embd_out[:0]

    def _output_buffer(self, rows: int, width: int = 0) -> torch.Tensor:
        width = width or self.model.hparams.n_vocab
        return allocate("output buffer", rows * width * 4, lambda: torch.empty(rows, width))

    @property
    def embd_bytes(self) -> int:
        """The hidden-state rows of the output buffer (0 unless embeddings were reserved or used)."""
        return self._embd_out.numel() * 4

    @property
    def output_rows(self) -> int:
        """Logits rows the output buffer holds (what the startup log's output buffer line says)."""
        return self._outputs.shape[0]

    @property
    def n_ctx(self) -> int:
        return self.cparams.n_ctx

    def warmup(self) -> None:
        """Run a 2-token decode, as llama.cpp warms up (pages in the weights, binds the graphs)."""
        v = self.model.vocab
        self.decode(Batch.from_tokens([v.bos, v.eos], 0))
        self.memory.clear()
        self.perf.reset()
        self._prev_shape.clear()

    def validate(self, batch: Batch) -> None:
        """llama_batch_allocr::init's checks; a failure leaves the memory untouched (code -1)."""
        if self._one_row_each(batch):
            return
        cp, n_vocab = self.cparams, self.model.hparams.n_vocab
        if batch.n_tokens == 0:
            raise DecodeError(DecodeStatus.INVALID, "n_tokens == 0")
        if batch.n_tokens > cp.n_batch:
            raise DecodeError(
                DecodeStatus.INVALID,
                f"n_tokens = {batch.n_tokens} > n_batch = {cp.n_batch}: a decode takes at most n_batch tokens; split the batch or raise -b",
            )
        n = batch.n_tokens
        if not (len(batch.pos) == len(batch.seq_id) == len(batch.logits) == n):
            raise DecodeError(DecodeStatus.INVALID, "batch arrays (token, pos, seq_id, logits) differ in length")
        tok = np.asarray(batch.token)
        bad = np.flatnonzero((tok < 0) | (tok >= n_vocab))
        if bad.size:
            raise DecodeError(DecodeStatus.INVALID, f"invalid token[{bad[0]}] = {tok[bad[0]]}")
        seen: dict[int, list[int]] = {}
        sets: dict[int, frozenset[int]] = {}
        for i, sids in enumerate(batch.seq_id):
            if not sids:
                raise DecodeError(DecodeStatus.INVALID, f"entry {i} has no sequence id")
            for j, s in enumerate(sids):
                if not 0 <= s < cp.n_seq_max:
                    raise DecodeError(DecodeStatus.INVALID, f"invalid seq_id[{i}][{j}] = {s} >= {cp.n_seq_max}")
            fs = frozenset(sids)
            for s in sids:
                if s in sets and sets[s] != fs and (sets[s] & fs) != min((sets[s], fs), key=len):
                    raise DecodeError(
                        DecodeStatus.INVALID, f"sequence {s} belongs to incompatible sequence sets (not allowed)"
                    )
                sets.setdefault(s, fs)
                seen.setdefault(s, []).append(batch.pos[i])
        for s, ps in seen.items():
            if any(b < a for a, b in zip(ps, ps[1:])):
                raise DecodeError(DecodeStatus.INVALID, f"sequence {s} positions are decreasing (not allowed)")
            if max(ps) - min(ps) + 1 > len(set(ps)):
                raise DecodeError(DecodeStatus.INVALID, f"sequence {s} positions are not continuous")
            x = self.memory.seq_pos_max(s)
            if x >= 0 and min(ps) != x + 1:
                raise DecodeError(
                    DecodeStatus.INVALID,
                    f"the tokens of sequence {s} in the input batch have inconsistent sequence "
                    f"positions:\n - the last position stored in the memory module of the "
                    f"context (i.e. the KV cache) for sequence {s} is X = {x}\n - the tokens "
                    f"for sequence {s} in the input batch have a starting position of Y = "
                    f"{min(ps)}\n it is required that the sequence positions remain "
                    f"consecutive: Y = X + 1",
                )

    def _check_lora(self, scales: dict[int, float]) -> dict[int, float]:
        n = len(self.model.adapters)
        for i in scales:
            if not 0 <= i < n:
                raise ContextError(f"LoRA adapter id {i} does not exist; {n} adapter(s) are loaded (ids 0..{n - 1})")
        return {i: float(v) for i, v in sorted(scales.items())}

    def set_adapters(self, scales: dict[int, float]) -> None:
        """The adapters every sequence applies unless it has its own (llama_set_adapters_lora)."""
        self.lora = self._check_lora(scales)

    def set_seq_adapters(self, seq_id: int, scales: dict[int, float] | None) -> None:
        """Sequence seq_id's own adapters and scales (None: the context's again)."""
        if scales is None:
            self.seq_lora.pop(seq_id, None)
        else:
            self.seq_lora[seq_id] = self._check_lora(scales)

    def adapters_of(self, seq_id: int) -> tuple[tuple[int, float], ...]:
        """The (adapter, scale) pairs sequence seq_id applies; a zero scale applies nothing."""
        return tuple((i, s) for i, s in self.seq_lora.get(seq_id, self.lora).items() if s != 0.0)

    def _lora_rows(
        self, ub: UBatch
    ) -> tuple[dict[int, tuple[tuple[int, float], ...]], tuple[np.ndarray, np.ndarray] | None]:
        """Per sequence of the ubatch its adapters, and each row's adapters and scales (n, slots),
        -1 padded, for the segmented kernel (None: no row applies one)."""
        if not self.model.adapters:
            return {}, None
        seqs = {int(s): p for s in np.unique(ub.seq_id0) if (p := self.adapters_of(int(s)))}
        m = max((len(p) for p in seqs.values()), default=0)
        if not m:
            return {}, None
        idx = np.full((ub.n_tokens, m), -1, dtype=np.int32)
        scale = np.zeros((ub.n_tokens, m), dtype=np.float32)
        for s, pairs in seqs.items():
            rows = ub.seq_id0 == s
            for j, (i, v) in enumerate(pairs):
                idx[rows, j], scale[rows, j] = i, v
        return seqs, (idx, scale)

    def _one_row_each(self, batch: Batch) -> bool:
        """A decode step's batch passes `validate`: at most a few rows, each of one sequence and
        no two of the same one, each right after its sequence's last cell. False sends any other
        batch (and every faulty one, for its message) through the full checks."""
        n = batch.n_tokens
        if not 0 < n <= min(self.cparams.n_batch, 64) or not len(batch.pos) == len(batch.seq_id) == n:
            return False
        if min(batch.token) < 0 or max(batch.token) >= self.model.hparams.n_vocab:
            return False
        seen = set()
        n_seq_max, memory = self.cparams.n_seq_max, self.memory
        for sids, pos in zip(batch.seq_id, batch.pos):
            if len(sids) != 1 or not 0 <= (s := sids[0]) < n_seq_max or s in seen:
                return False
            seen.add(s)
            x = memory.seq_pos_max(s)
            if x >= 0 and pos != x + 1:
                return False
        return len(batch.logits) == n

    def _rows_of(self, buffer: torch.Tensor, n: int) -> torch.Tensor:
        """The first n rows of an output buffer, the view kept while the buffer and n repeat."""
        kept = self._rows_view
        if kept is None or kept[0] is not buffer or kept[1] != n:
            kept = self._rows_view = (buffer, n, buffer[:n])
        return kept[2]

    def _bound(self, shape: GraphShape, dest: torch.Tensor) -> tuple[Graph, bool, InputViews]:
        """The ubatch's graph, bound to the workspace, its output pointed at `dest` where it can
        be (`direct`: then no copy follows the step), and its input views. A decode step repeats
        the last step's shape, workspace and destination: then they are the last step's."""
        at = (dest.data_ptr(), dest.shape)
        last = self._last_bound
        if last is not None and last.shape == shape and last.workspace is self.workspace and last.dest == at:
            if self._graphs.get(shape) is last.graph:
                self._graphs.move_to_end(shape)
                return last.graph, last.direct, last.views
        graph = self.graph_for(shape)
        if graph.size > self.workspace.numel():  # cannot happen for shapes within the reservation
            self.workspace = torch.empty(graph.size, dtype=torch.uint8, device=self.model.device)
            self.workspace_regrows += 1
        # without CUDA graphs the last node writes the output rows itself: no copy after
        direct = (
            dest.shape[0] > 0 and self.ops.graph_runner is None and bind_output(graph, self.ops, self.workspace, dest)
        )
        views = input_views(graph, self.ops, self.workspace)
        self._last_bound = LastBound(shape, self.workspace, at, graph, direct, views)
        return graph, direct, views

    def graph_for(self, shape: GraphShape) -> Graph:
        """The planned graph of a shape, built on first use (kept for the last few shapes)."""
        g = self._graphs.get(shape)
        if g is None:
            g = self._graphs[shape] = build_forward(self.model, self.memory, shape, self.ops)
            while len(self._graphs) > GRAPHS_KEPT:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(shape)
        return g

    def reserve(self) -> Reservation:
        """The worst-case graphs of this context's shapes (engine/context/reserve.py)."""
        return reserve(self.model, self.memory, self.cparams, self.ops)

    def decode(self, batch: Batch) -> None:
        """Run a batch; afterwards `self.logits[i]` holds the i-th output slot's logits, a view of
        the output buffer that the next decode overwrites (as llama_get_logits; clone to keep).
        With `embeddings` on, `self.embd[i]` holds row i's final-norm hidden state instead.
        Under tensor parallelism rank 0 announces the batch first and every rank runs it."""
        if self.announce is None:
            return self._decode(batch)
        with self.announce(Decode(self.tp_key, batch, self.embeddings)):
            return self._decode(batch)

    def _decode(self, batch: Batch) -> None:
        embd = self.embeddings
        if embd:  # llama.cpp's output_all: embeddings need every row
            batch = replace(batch, logits=[True] * batch.n_tokens)
        self.validate(batch)
        n_outputs = sum(batch.logits)
        if n_outputs > self.cparams.n_outputs_max and not embd:
            raise DecodeError(
                DecodeStatus.INVALID,
                f"batch requests {n_outputs} outputs but n_outputs_max = {self.cparams.n_outputs_max}; raise --n-outputs-max",
            )
        t0 = time.perf_counter()
        hp = self.model.hparams
        if self.memory.update(hp, self.ops, self.rope_freqs):
            self._prev_shape.clear()  # llama.cpp rebuilds graphs after a memory update
        ubatches = self.memory.init_batch(batch, self.cparams.n_ubatch)
        if embd and n_outputs > self._embd_out.shape[0]:
            self._embd_out = self._output_buffer(n_outputs, hp.n_embd)
        elif not embd and n_outputs > self.output_rows:
            self._outputs = self._output_buffer(n_outputs)
        output = self._rows_of(self._embd_out if embd else self._outputs, n_outputs)
        order: list[np.ndarray] = []
        self.records = []
        row = 0
        # one ubatch of output rows only (a decode step): the rows are the batch's, in order
        every = len(ubatches) == 1 and n_outputs == batch.n_tokens
        for ub in ubatches:
            tu = time.perf_counter()
            slots = self.memory.place(ub)
            if every:
                n_out, out_idx = ub.n_tokens, ub.batch_idx
            else:
                out_rows = np.flatnonzero(ub.output)
                n_out, out_idx = len(out_rows), ub.batch_idx[out_rows]
            groups = [c.ubatch_streams(ub) for c in self.memory.caches]
            seq_loras, lora_rows = self._lora_rows(ub)
            shape = GraphShape(
                ub.n_tokens,
                n_out,
                tuple(len(g) for g in groups),
                tuple(c.n_kv_of(g) for c, g in zip(self.memory.caches, groups)),
                embd,
                0 if lora_rows is None else lora_rows[0].shape[1],
                len(self.model.adapters) if lora_rows is not None else 0,
            )
            reused = self._prev_shape.get(n_out > 0) == shape
            self._prev_shape[n_out > 0] = shape
            self.perf.graphs_reused += reused
            dest = output if every else output[row : row + n_out]
            # the server's engine thread runs in inference mode throughout: entering it costs per ubatch
            mode = nullcontext() if torch.is_inference_mode_enabled() else torch.inference_mode()
            with mode:
                graph, direct, views = self._bound(shape, dest)
                self.step_inputs.fill(self.memory, ub, slots, shape, *views, lora_rows)
                logits = run_step(graph, self.ops, self.workspace, {})  # CUDA graphs if the backend asks
                if n_out and not direct:
                    dest.copy_(logits)
            row += n_out
            order.append(out_idx)
            self.perf.n_ubatch += 1
            rec = UBatchRecord(
                ub.n_tokens,
                n_out,
                ub.n_seqs,
                sorted(set(ub.seq_id0.tolist())),
                shape.n_kv,
                reused,
                (time.perf_counter() - tu) * 1e3,
                seq_loras,
            )
            self.records.append(rec)
            for obs in self.observers:
                obs(batch, ub, rec)
        idx = order[0] if len(order) == 1 else np.concatenate(order)
        logits = output if row == n_outputs else output[:row]
        if idx.size > 1 and not np.all(idx[:-1] < idx[1:]):  # split_equal reorders slots: restore batch order
            logits = logits[torch.from_numpy(np.argsort(idx, kind="stable"))]
            idx = np.sort(idx)
        if embd:
            self.embd, self.logits = logits, self._outputs[:0]
        else:
            self.logits = logits
        self.output_ids = idx.tolist()
        dt = (time.perf_counter() - t0) * 1e3
        self.perf.n_decode += 1
        if batch.n_tokens == 1:
            self.perf.t_eval_ms += dt
            self.perf.n_eval += 1
        else:
            self.perf.n_p_eval += batch.n_tokens

    def prefill(
        self,
        tokens: list[int],
        pos0: int = 0,
        seq_id: int = 0,
        all_logits: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Decode tokens of one sequence from position pos0, in chunks of n_batch (each split
        into ubatches by `decode`); each chunk's last token is an output (every token with `all_logits`).

        With `progress`, it is called as progress(ubatches_done, ubatches_total) after each
        ubatch; the chunks are then n_ubatch tokens long. One sequence's batch is split into
        consecutive n_ubatch-token ubatches anyway, so the forward passes are the same ones.
        """
        step = self.cparams.n_batch
        if progress is not None:
            step = min(step, self.cparams.n_ubatch)
            total, done = -(-len(tokens) // self.cparams.n_ubatch), 0
        for i in range(0, len(tokens), step):
            self.decode(Batch.from_tokens(tokens[i : i + step], pos0 + i, seq_id, all_logits))
            if progress is not None:
                done += len(self.records)
                progress(done, total)
