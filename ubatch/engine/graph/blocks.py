"""The shared blocks every architecture's layer is written with (engine/model/archs/base.py
`Blocks`), recorded as graph nodes: norms, attention with its variants, the gated FFN, the
residual adds. Each block carries its tensor-parallel all-reduce, so an architecture's layer reads
the same with and without -tp. Node names follow llama.cpp's graph (`Qcur-0`, `ffn_out-17`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from ubatch.engine.graph.builder import GraphBuilder
from ubatch.engine.graph.graph import Sym
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.model.archs.base import HParams
from ubatch.engine.model.model import Model
from ubatch.kernels.ops import AttentionArgs, BiasArgs, MaskCells


@dataclass
class GraphBlocks:
    """The blocks over one graph: the builder, the model, the step's inputs per KV cache."""

    b: GraphBuilder
    model: Model
    mem: KVMemory
    n: int  # rows of the ubatch
    n_groups: tuple[int, ...]
    n_kv: tuple[int, ...]
    ropes: dict[tuple[float, float], tuple[Sym, Sym]]
    masks: list[Sym | MaskCells[Sym]]
    slots: list[Sym]
    starts: list[Sym]
    visible: list[Sym]
    out_ids: Sym | None
    # each row's LoRA adapters and scales (n, lora_slots), where some row applies one
    lora_rows: tuple[Sym, Sym] | None = None
    # (n, n_head) int32: each row's head numbers, for latent attention's per-head products
    head_ids: Sym | None = None

    @property
    def hp(self) -> HParams:
        return self.model.hparams

    def norm(self, x: Sym, il: int, field: str, name: str) -> Sym:
        w = self.model.layers[il].vec(field)
        if w is None:
            raise ValueError(f"layer {il} lacks the norm weight {field!r}, which its architecture requires")
        return self.b.rms_norm(x, w, self.model.hparams.rms_eps, name)

    def _reduced(self, x: Sym, name: str) -> Sym:
        """A row-split product's partial sums made whole on every rank (nothing without -tp)."""
        tp = self.model.shard
        return x if tp is None else self.b.all_reduce(x, tp.comm, name)

    def linear(self, x: Sym, il: int, w: str, name: str) -> Sym:
        """x times the layer's matrix `w`, plus each applied LoRA adapter's low-rank product on it."""
        y = self.b.linear(x, self.model.layers[il].mat(w), name)
        return self.lora(x, y, (il, w), f"{name}_lora")

    def lora(self, x: Sym, y: Sym, key: tuple[int, str], name: str) -> Sym:
        """y plus the low-rank products of the adapters x's rows apply to matrix `key`: one
        segmented node for all of them; past the last layer's cut x's rows are the output rows."""
        stack = self.model.lora_stacks.get(key)
        if self.lora_rows is None or stack is None:
            return y
        idx, scale = self.lora_rows
        sel = self.out_ids if x.shape[0] != idx.shape[0] else None
        return self.b.lora(y, x, stack, idx, scale, sel, name)

    def _proj(self, x: Sym, il: int, w: str, bias: str, name: str) -> Sym:
        """x times the layer's matrix `w`, plus its bias where the layer has one."""
        y = self.linear(x, il, w, name)
        bv = self.model.layers[il].vec(bias)
        return y if bv is None else self.b.op(BiasArgs(y, bv), f"{name}_biased")

    def attention(self, x: Sym, il: int) -> Sym:
        hp, b, n = self.model.hparams, self.b, self.n
        if hp.mla is not None:
            return self._mla_attention(x, il)
        ci = self.mem.layer_cache[il]
        cache, g, n_kv = self.mem.caches[ci], self.n_groups[ci], self.n_kv[ci]
        q, k = self._proj(x, il, "wq", "bq", f"Qcur-{il}"), self._proj(x, il, "wk", "bk", f"Kcur-{il}")
        if hp.qk_norm_full:  # over the whole projection, before the heads (olmo2)
            q = self.norm(q, il, "q_norm", f"Qcur_normed-{il}")
            k = self.norm(k, il, "k_norm", f"Kcur_normed-{il}")
        q = b.view(q, (n, hp.n_head, hp.n_embd_head_k))
        k = b.view(k, (n, hp.n_head_kv, hp.n_embd_head_k))
        v = b.view(self._proj(x, il, "wv", "bv", f"Vcur-{il}"), (n, hp.n_head_kv, hp.n_embd_head_v))
        if hp.qk_norm:
            q = self.norm(q, il, "q_norm", f"Qcur_normed-{il}")
            k = self.norm(k, il, "k_norm", f"Kcur_normed-{il}")
        cos, sin = self.ropes[hp.rope_params(il)]
        rope = hp.has_rope(il)  # smollm3 leaves some layers unrotated
        q = b.rope(q, cos, sin, hp.rope_neox, f"Qcur_rope-{il}") if rope else q
        q = b.scale(q, hp.attn_scale, f"Qcur_scaled-{il}")
        k = b.rope(k, cos, sin, hp.rope_neox, f"Kcur_rope-{il}") if rope else k
        ks = b.kv_store(cache.k[il], self.slots[ci], k, f"k_store-{il}")
        vs = b.kv_store(cache.v[il], self.slots[ci], v, f"v_store-{il}")
        qg = b.view(q, (g, n // g, hp.n_head, hp.n_embd_head_k))
        m = self.masks[ci]
        cells, mask = (m, None) if isinstance(m, MaskCells) else (None, m)
        kv, vis = (cache.k[il], cache.v[il]), self.visible[ci]
        att = AttentionArgs(
            qg,
            *kv,
            self.starts[ci],
            n_kv,
            mask,
            1.0,
            vis,
            cells,
            hp.attn_softcap,
            self.model.layers[il].vec("attn_sinks"),
        )
        a = b.attention(att, (ks, vs), f"kqv_out-{il}")
        a = self._proj(a, il, "wo", "bo", f"attn_out-{il}")
        return self._reduced(a, f"attn_out_sum-{il}")

    def _mla_attention(self, x: Sym, il: int) -> Sym:
        """Multi-head latent attention with k_b and v_b absorbed (llama.cpp's deepseek2 graph):
        one compressed K row per token, [normed latent, RoPE'd part], which every head reads as
        its key and as its value. The value is the row's latent only, so attention runs with V =
        K and each head's output past the latent (the RoPE part's weighted sum) is dropped before
        v_b: a few columns of work instead of a second cache."""
        hp, b, n, L = self.model.hparams, self.b, self.n, self.model.layers[il]
        m = hp.mla
        assert m is not None
        ci = self.mem.layer_cache[il]
        cache, g, n_kv = self.mem.caches[ci], self.n_groups[ci], self.n_kv[ci]
        h, r, rot = hp.n_head, m.kv_lora_rank, hp.n_rot
        nope = m.n_embd_head_k - rot
        if m.q_lora_rank:
            q = self.linear(x, il, "wq_a", f"q_a-{il}")
            q = self.linear(self.norm(q, il, "q_a_norm", f"q_a_norm-{il}"), il, "wq_b", f"q-{il}")
        else:
            q = self.linear(x, il, "wq", f"q-{il}")
        q = b.view(q, (n, h, m.n_embd_head_k))
        cos, sin = self.ropes[hp.rope_params(il)]
        q_pe = b.rope(b.cols(q, nope, rot, f"q_pe-{il}"), cos, sin, hp.rope_neox, f"q_pe_rope-{il}")
        heads = self.head_ids  # mul_mat_id with the per-head 3-D k_b / v_b as experts: per-head products
        assert heads is not None
        q_abs = b.mul_mat_id(b.cols(q, 0, nope, f"q_nope-{il}"), L.mat("wk_b"), heads, None, f"q_nope_absorbed-{il}")
        q = b.scale(b.concat(q_abs, q_pe, f"Qcur-{il}"), hp.attn_scale, f"Qcur_scaled-{il}")
        kv = self.linear(x, il, "wkv_a", f"kv_cmpr_pe-{il}")
        kv_c = self.norm(b.cols(kv, 0, r, f"kv_cmpr-{il}"), il, "kv_a_norm", f"kv_cmpr_norm-{il}")
        k_pe = b.rope(b.view(b.cols(kv, r, rot, f"k_pe-{il}"), (n, 1, rot)), cos, sin, hp.rope_neox, f"k_pe_rope-{il}")
        k = b.concat(b.view(kv_c, (n, 1, r)), k_pe, f"Kcur-{il}")
        ks = b.kv_store(cache.k[il], self.slots[ci], k, f"k_store-{il}")
        qg = b.view(q, (g, n // g, h, r + rot))
        mk = self.masks[ci]
        cells, mask = (mk, None) if isinstance(mk, MaskCells) else (None, mk)
        kc = cache.k[il]
        att = AttentionArgs(qg, kc, kc, self.starts[ci], n_kv, mask, 1.0, self.visible[ci], cells)
        a = b.view(b.attention(att, (ks, ks), f"kqv_out-{il}"), (n, h, r + rot))
        lat = b.cols(a, 0, r, f"kqv_latent-{il}")
        v = b.view(b.mul_mat_id(lat, L.mat("wv_b"), heads, None, f"kqv_v-{il}"), (n, h * m.n_embd_head_v))
        return self._reduced(self.linear(v, il, "wo", f"attn_out-{il}"), f"attn_out_sum-{il}")

    def ffn(self, x: Sym, il: int) -> Sym:
        hp, b = self.model.hparams, self.b
        gate = self.linear(x, il, "ffn_gate", f"ffn_gate-{il}")
        f = b.glu(gate, self.linear(x, il, "ffn_up", f"ffn_up-{il}"), hp.ffn_act, f"ffn_glu-{il}")
        return self._reduced(self.linear(f, il, "ffn_down", f"ffn_out-{il}"), f"ffn_out_sum-{il}")

    def moe(self, x: Sym, il: int) -> Sym:
        """llama.cpp's build_moe_ffn: router logits, each row's top-k experts and their weights,
        the chosen experts' gate and up (mul_mat_id), the gated activation, their down
        projections, summed with the weights."""
        hp, b, L, n = self.model.hparams, self.b, self.model.layers[il], x.shape[0]  # the last layer: output rows
        moe = hp.moe
        assert moe is not None
        logits = self._proj(x, il, "ffn_gate_inp", "ffn_gate_inp_b", f"ffn_moe_logits-{il}")
        groups = (moe.n_group, moe.n_group_used)
        ids = b.moe_topk(logits, moe.n_expert_used, moe.gating, L.vec("exp_probs_b"), groups, f"ffn_moe_topk-{il}")
        w = b.moe_weights(logits, ids, moe.gating, moe.norm_w, moe.w_scale, f"ffn_moe_weights-{il}")
        x3 = b.view(x, (n, 1, hp.n_embd))
        if "ffn_gate_up_exps" in L.mats:  # gate and up in one matrix per expert: one product, then its halves
            gate_up = b.mul_mat_id(x3, L.mat("ffn_gate_up_exps"), ids, None, f"ffn_moe_gate_up-{il}")
            f_exp = gate_up.shape[2] // 2
            gate = b.cols(gate_up, 0, f_exp, f"ffn_moe_gate-{il}")
            up = b.cols(gate_up, f_exp, f_exp, f"ffn_moe_up-{il}")
        else:
            gate = b.mul_mat_id(x3, L.mat("ffn_gate_exps"), ids, L.vec("ffn_gate_exps_b"), f"ffn_moe_gate-{il}")
            up = b.mul_mat_id(x3, L.mat("ffn_up_exps"), ids, L.vec("ffn_up_exps_b"), f"ffn_moe_up-{il}")
        f = b.glu(gate, up, hp.ffn_act, f"ffn_moe_swiglu-{il}")
        down = b.mul_mat_id(f, L.mat("ffn_down_exps"), ids, L.vec("ffn_down_exps_b"), f"ffn_moe_down-{il}")
        out = b.moe_sum(down, w, f"ffn_moe_out-{il}")
        if "ffn_gate_shexp" in L.mats:  # shared experts: every token's (deepseek2), gated (qwen2moe)
            sg = self.linear(x, il, "ffn_gate_shexp", f"ffn_shexp_gate-{il}")
            sf = b.glu(sg, self.linear(x, il, "ffn_up_shexp", f"ffn_shexp_up-{il}"), hp.ffn_act, f"ffn_shexp_glu-{il}")
            sh = self.linear(sf, il, "ffn_down_shexp", f"ffn_shexp-{il}")
            if "ffn_gate_inp_shexp" in L.mats:  # its output times sigmoid of its own gate logit
                g = self.linear(x, il, "ffn_gate_inp_shexp", f"ffn_shexp_gate_inp-{il}")
                sh = b.sigmoid_scale(sh, g, f"ffn_shexp_out-{il}")
            out = b.add(out, sh, f"ffn_out-{il}")
        return self._reduced(out, f"ffn_moe_out_sum-{il}")

    def residual(self, x: Sym, a: Sym, il: int) -> Sym:
        if il == self.model.hparams.n_layer - 1 and self.out_ids is not None:  # only output rows pay for the rest
            x = self.b.rows(x, self.out_ids, f"inpSA_out-{il}")
            a = self.b.rows(a, self.out_ids, f"attn_out_rows-{il}")
        return self.b.add(x, a, f"ffn_inp-{il}")

    def scale(self, x: Sym, s: float, name: str) -> Sym:
        return self.b.scale(x, s, name)

    def add(self, a: Sym, b: Sym, name: str) -> Sym:
        return self.b.add(a, b, name)
