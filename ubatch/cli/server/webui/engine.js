// The engine page: reads /engine/events (a `hello`, then a `state` a few times a second) and
// draws the slots, the KV cells, each decode call's rows and ubatches, the memory plan and the
// last minute's throughput. The server samples; this page only draws what it is sent.
"use strict";

(() => {
  const { el, headers, apiBase, readSSE, errorOf, setApiKey, apiKey, bytes, seqColor } = UB;
  const $ = (id) => document.getElementById(id);
  const WINDOW_S = 60;
  const MAX_DECODES = 40;

  const st = {
    hello: null,
    last: null, // previous state event
    samples: [], // {t, gen, prompt, rows, decodes}
    paused: false,
    abort: null,
    prevSlots: new Map(), // slot id -> {task, n_decoded, n_prompt_done}
    nDecodes: 0,
  };

  function notice(kind, text, id) {
    const box = $("notices");
    const old = box.querySelector('[data-id="' + id + '"]');
    if (old) old.remove();
    box.append(el("div", { class: "notice " + kind, "data-id": id }, [el("span", { text })]));
  }
  function clearNotice(id) { const n = $("notices").querySelector('[data-id="' + id + '"]'); if (n) n.remove(); }
  function setConn(text, cls) { const c = $("conn"); c.textContent = text; c.className = "conn " + (cls || ""); }

  // -- the stream ---------------------------------------------------------------------------
  async function connect() {
    st.abort = new AbortController();
    setConn("connecting\u2026");
    try {
      const res = await fetch(apiBase() + "engine/events", { headers: headers(), signal: st.abort.signal });
      if (!res.ok) {
        const e = await errorOf(res);
        if (res.status === 401) {
          notice("error", (apiKey() ? "The server refused the API key (401): " : "This server needs an API key (401): ") + e.message + ". Enter it under \u201cAPI key\u201d.", "auth");
          setConn("refused", "bad");
          openKey();
          return; // reconnect when a key is entered
        }
        throw e;
      }
      clearNotice("auth");
      clearNotice("conn");
      setConn("live", "ok");
      await readSSE(res, (ev, data) => {
        const j = JSON.parse(data);
        if (ev === "hello") onHello(j);
        else if (ev === "state" && !st.paused) onState(j);
      });
      throw new Error("the stream ended");
    } catch (e) {
      if (e.name === "AbortError") return;
      setConn("reconnecting", "bad");
      notice("warn", "Lost the engine's stream (" + e.message + "); reconnecting.", "conn");
      setTimeout(connect, 2000);
    }
  }

  function openKey() {
    const d = $("keydlg");
    if (d.open) return;
    $("key-input").value = apiKey();
    d.showModal();
  }

  // -- hello: what does not change -----------------------------------------------------------
  function onHello(h) {
    st.hello = h;
    const p = h.plan;
    $("model").textContent = (p.model_file || "").split(/[\\/]/).pop() + " \u00b7 " + p.backend + " \u00b7 " + p.device;
    drawMemory(p);
  }

  function drawMemory(p) {
    const parts = [["weights", p.weights, "#5b6b8c"]];
    p.kv.forEach((k, i) => parts.push(["KV " + k.name, k.bytes, i ? "#2e9e5b" : "#2f6fdf"]));
    parts.push(["compute buffer", p.compute, "#d9822b"], ["outputs", p.outputs, "#8e44ad"]);
    const total = parts.reduce((a, x) => a + x[1], 0);
    const bar = $("membar");
    bar.replaceChildren();
    bar.setAttribute("aria-label", "Memory: " + parts.map((x) => x[0] + " " + bytes(x[1])).join(", ") + "; total " + bytes(total));
    const legend = $("memlegend");
    legend.replaceChildren();
    for (const [name, b, color] of parts) {
      const seg = el("div", { class: "seg", title: name + ": " + bytes(b) });
      seg.style.flexGrow = String(Math.max(b, total * 0.004));
      seg.style.background = color;
      bar.append(seg);
      const sw = el("span", { class: "swatch" });
      sw.style.background = color;
      legend.append(el("span", { class: "item" }, [sw, name + " " + bytes(b) + " (" + (100 * b / total).toFixed(1) + "%)"]));
    }
    legend.append(el("span", { class: "item total", text: "total " + bytes(total) }));
    const rows = p.peak.map((t) => el("tr", {}, [el("td", { text: t.name }), el("td", { text: "[" + t.shape.join(", ") + "]" }), el("td", { class: "num", text: bytes(t.bytes) })]));
    const wc = p.worst_case;
    $("memdetail").replaceChildren(
      el("p", { class: "hint", text: "The compute buffer is one workspace reserved for the worst-case graph (" + wc[0] + " rows, " + wc[1] +
        " sequences, " + wc[2] + " outputs): prompt graph " + bytes(p.pp_bytes) + ", generation graph " + bytes(p.tg_bytes) +
        ". n_ctx " + p.n_ctx + " (" + p.n_ctx_seq + " per sequence), n_batch " + p.n_batch + ", n_ubatch " + p.n_ubatch +
        ", n_seq_max " + p.n_seq_max + (p.kv_unified ? ", unified KV" : ", one KV stream per sequence") + ", outputs for " + p.n_outputs_max + " rows." }),
      rows.length ? el("div", { class: "scroll" }, el("table", {}, [
        el("caption", { text: "Largest tensors live at the compute buffer's peak" }),
        el("thead", {}, el("tr", {}, [el("th", { scope: "col", text: "tensor" }), el("th", { scope: "col", text: "shape" }), el("th", { scope: "col", text: "bytes" })])),
        el("tbody", {}, rows),
      ])) : null,
    );
  }

  // -- state: what changes -------------------------------------------------------------------
  function onState(s) {
    drawSlots(s);
    drawKV(s.caches);
    addDecodes(s.decodes);
    sample(s);
    drawCharts();
    st.last = s;
  }

  function drawSlots(s) {
    const tb = $("slots").querySelector("tbody");
    tb.replaceChildren();
    for (const x of s.slots) {
      const chip = el("span", { class: "chip" });
      chip.style.background = seqColor(x.id);
      const tps = x.state === "processing_prompt" ? "" : x.gen_tps ? x.gen_tps.toFixed(1) : "";
      tb.append(el("tr", { class: "state-" + x.state }, [
        el("td", {}, [chip, String(x.id)]),
        el("td", { text: x.state.replace("_", " ") }),
        el("td", { text: x.task === null ? "" : String(x.task) }),
        el("td", { class: "num", text: x.n_prompt ? x.n_prompt_done + x.n_prompt_cache + " / " + x.n_prompt : "" }),
        el("td", { class: "num", text: x.n_prompt_cache ? String(x.n_prompt_cache) : "" }),
        el("td", { class: "num", text: x.n_decoded ? String(x.n_decoded) : "" }),
        el("td", { class: "num", text: x.n_cache + " / " + x.n_ctx }),
        el("td", { class: "num", text: tps }),
      ]));
    }
    const q = s.n_queued ? s.n_queued + " waiting for a slot: " + s.queue.map((t) => "task " + t.task + " (" + t.n_prompt + " tokens)").join(", ") : "Queue: empty.";
    $("queue").textContent = q + " Iteration " + s.iteration + ", " + s.totals.n_decode + " decode calls, " + s.totals.graphs_reused + " of " + s.totals.n_ubatch_ctx + " ubatches reused their graph.";
  }

  // The KV cells: one canvas per stream of each cache.
  const patterns = new Map();
  function stripes(ctx, seqs) {
    const key = seqs.join(",");
    if (patterns.has(key)) return patterns.get(key);
    const c = document.createElement("canvas");
    c.width = c.height = 6;
    const g = c.getContext("2d");
    seqs.forEach((s, i) => {
      g.fillStyle = seqColor(s);
      for (let k = -2; k < 3; k++) if ((k + 2) % seqs.length === i) { g.beginPath(); g.moveTo(k * 3, 6); g.lineTo(k * 3 + 6, 0); g.lineTo(k * 3 + 9, 0); g.lineTo(k * 3 + 3, 6); g.fill(); }
    });
    if (seqs.length === 1) { g.fillStyle = seqColor(seqs[0]); g.fillRect(0, 0, 6, 6); }
    const p = ctx.createPattern(c, "repeat");
    patterns.set(key, p);
    return p;
  }

  function drawKV(caches) {
    const box = $("kv");
    const seen = new Set();
    const legend = new Set();
    for (const c of caches) {
      for (const s of c.streams) {
        const id = "kv-" + c.name.replace(/\W/g, "") + "-" + s.stream;
        seen.add(id);
        let fig = document.getElementById(id);
        if (!fig) {
          fig = el("figure", { id, class: "kvfig" }, [el("figcaption"), el("canvas", { role: "img" })]);
          box.append(fig);
        }
        const pad = s.n_kv - s.used_max_p1;
        const caption = c.name + (c.streams.length > 1 ? " \u00b7 stream " + s.stream : "") + ": " + s.used + " of " + c.size +
          " cells used, n_kv " + s.n_kv + " (" + s.used_max_p1 + " + " + Math.max(pad, 0) + " padding to " + c.pad + ")" +
          (s.n_shared ? ", " + s.n_shared + " shared" : "") + (c.n_swa ? ", window " + c.n_swa : "");
        fig.querySelector("figcaption").textContent = caption;
        const cv = fig.querySelector("canvas");
        cv.setAttribute("aria-label", caption);
        drawCells(cv, c.size, s, legend);
      }
    }
    for (const f of Array.from(box.children)) if (!seen.has(f.id)) f.remove();
    const lg = $("kv-legend");
    lg.replaceChildren();
    const fixed = [["--cell-pad", "#f3d9a8", "padding up to n_kv (read, empty)"], ["--cell-empty", "#e4e6eb", "empty, past n_kv"]];
    const css = getComputedStyle(document.body);
    for (const [v, dflt, text] of fixed) {
      const sw = el("span", { class: "swatch" });
      sw.style.background = css.getPropertyValue(v).trim() || dflt;
      lg.append(el("span", { class: "item" }, [sw, text]));
    }
    lg.append(el("span", { class: "item" }, [el("span", { class: "swatch shared" }), "shared by several sequences (striped)"]));
    for (const sq of Array.from(legend).sort((a, b) => a - b)) {
      const sw = el("span", { class: "swatch" });
      sw.style.background = seqColor(sq);
      lg.append(el("span", { class: "item" }, [sw, "seq " + sq]));
    }
  }

  function drawCells(cv, size, s, legend) {
    const width = Math.max(200, cv.parentElement.clientWidth - 4);
    const cols = size <= 4096 ? Math.min(128, Math.max(32, Math.floor(width / 7))) : Math.ceil(size / 64);
    const px = Math.max(1, Math.floor(width / cols));
    const rows = Math.ceil(size / cols);
    const dpr = window.devicePixelRatio || 1;
    cv.width = cols * px * dpr;
    cv.height = rows * px * dpr;
    cv.style.width = cols * px + "px"; // the height follows (max-width: 100% on a narrow screen)
    const g = cv.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    const css = getComputedStyle(document.body);
    g.fillStyle = css.getPropertyValue("--cell-empty").trim() || "#e4e6eb";
    g.fillRect(0, 0, cols * px, rows * px);
    const gap = px >= 4 ? 1 : 0;
    const fillRange = (from, n, style) => {
      g.fillStyle = style;
      for (let i = from; i < from + n; i++) g.fillRect((i % cols) * px, Math.floor(i / cols) * px, px - gap, px - gap);
    };
    // padding up to n_kv: read by attention, empty
    fillRange(s.used_max_p1, Math.max(0, s.n_kv - s.used_max_p1), css.getPropertyValue("--cell-pad").trim() || "#f3d9a8");
    let i = 0;
    for (const [code, n] of s.runs) {
      if (code > 0) { fillRange(i, n, seqColor(code - 1)); legend.add(code - 1); }
      else if (code < 0) { const set = s.sets[-code - 1] || []; set.forEach((x) => legend.add(x)); fillRange(i, n, stripes(g, set)); }
      i += n;
    }
    // the n_kv frame
    if (s.n_kv > 0) {
      g.strokeStyle = css.getPropertyValue("--fg").trim() || "#111";
      g.lineWidth = 2;
      const r = Math.floor((s.n_kv - 1) / cols);
      const c = ((s.n_kv - 1) % cols) + 1;
      g.beginPath();
      g.moveTo(1, 1); g.lineTo(cols * px - 1, 1);
      g.lineTo(cols * px - 1, r * px + (c === cols ? px : 0));
      if (c !== cols) { g.lineTo(c * px, r * px); g.lineTo(c * px, (r + 1) * px - 1); }
      g.lineTo(1, (r + 1) * px - 1); g.closePath();
      g.stroke();
    }
  }

  // Decode calls, newest first.
  function addDecodes(ds) {
    const ol = $("decodes");
    for (const d of ds) {
      st.nDecodes++;
      const strip = el("div", { class: "strip" });
      strip.style.width = "min(100%, " + Math.max(1, d.n_tokens) * 12 + "px)";
      const reused = d.ubatches.filter((u) => u.reused).length;
      const ms = d.ubatches.reduce((a, u) => a + u.ms, 0);
      const kinds = { p: 0, g: 0, d: 0 };
      const seqs = new Set();
      for (const u of d.ubatches) {
        const ub = el("div", { class: "ub", title: u.n_tokens + " rows, n_kv " + u.n_kv.join("/") + (u.reused ? ", graph reused" : ", graph built") + ", " + u.ms.toFixed(1) + " ms" });
        ub.style.flexGrow = String(u.n_tokens);
        for (const [sq, k, n] of u.runs) {
          const r = el("span", { class: "run kind-" + k });
          r.style.flexGrow = String(n);
          r.style.setProperty("--c", seqColor(sq));
          ub.append(r);
          kinds[k] = (kinds[k] || 0) + n;
          seqs.add(sq);
        }
        strip.append(ub);
      }
      const what = [kinds.p ? kinds.p + " prompt" : "", kinds.g ? kinds.g + " generated" : "", kinds.d ? kinds.d + " drafted" : ""].filter(Boolean).join(", ");
      const label = "#" + d.id + ": " + d.n_tokens + " rows (" + what + ") from seq " + Array.from(seqs).sort((a, b) => a - b).join(", ") +
        "; " + d.ubatches.length + " ubatch" + (d.ubatches.length > 1 ? "es" : "") + ", n_kv " + d.ubatches.map((u) => u.n_kv.join("/")).join(" | ") +
        ", graph " + (reused === d.ubatches.length ? "reused" : reused ? reused + " reused" : "built") + ", " + ms.toFixed(1) + " ms";
      const li = el("li", { class: "decode", "data-seqs": Array.from(seqs).join(",") }, [strip, el("span", { class: "dlabel", text: label })]);
      ol.prepend(li);
    }
    while (ol.children.length > MAX_DECODES) ol.lastChild.remove();
  }

  // -- the last minute -----------------------------------------------------------------------
  function sample(s) {
    let gen = 0, prompt = 0;
    for (const x of s.slots) {
      const p = st.prevSlots.get(x.id);
      if (x.task !== null) {
        const same = p && p.task === x.task;
        gen += x.n_decoded - (same ? p.n_decoded : 0);
        prompt += x.n_prompt_done - (same ? p.n_prompt_done : 0);
      }
      st.prevSlots.set(x.id, { task: x.task, n_decoded: x.n_decoded, n_prompt_done: x.n_prompt_done });
    }
    const l = st.last;
    if (l) {
      const dt = Math.max(1e-3, s.t - l.t);
      const dd = s.totals.n_decode - l.totals.n_decode;
      const rows = dd > 0 ? (s.totals.n_rows - l.totals.n_rows) / dd : 0;
      st.samples.push({ t: s.t, gen: Math.max(0, gen) / dt, prompt: Math.max(0, prompt) / dt, rows, decodes: dd / dt });
    }
    while (st.samples.length && s.t - st.samples[0].t > WINDOW_S) st.samples.shift();
  }

  function chart(cv, series, now, fmt) {
    const w = Math.max(240, cv.parentElement.clientWidth - 4);
    const h = 110;
    const dpr = window.devicePixelRatio || 1;
    cv.width = w * dpr; cv.height = h * dpr;
    cv.style.width = w + "px"; cv.style.height = h + "px";
    const g = cv.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    const css = getComputedStyle(document.body);
    g.clearRect(0, 0, w, h);
    let max = 1;
    for (const s of series) for (const p of st.samples) max = Math.max(max, p[s.key]);
    g.strokeStyle = css.getPropertyValue("--grid").trim() || "#ccc";
    g.lineWidth = 1;
    g.beginPath(); g.moveTo(30, h - 14.5); g.lineTo(w, h - 14.5); g.moveTo(30, 4.5); g.lineTo(w, 4.5); g.stroke();
    g.fillStyle = css.getPropertyValue("--muted").trim() || "#555";
    g.font = "11px system-ui, sans-serif";
    g.fillText(fmt(max), 0, 12);
    g.fillText("0", 0, h - 14);
    g.fillText("-60 s", 30, h - 2);
    g.fillText("now", w - 24, h - 2);
    const x = (t) => 30 + (w - 30) * (1 - (now - t) / WINDOW_S);
    const y = (v) => h - 14 - (h - 20) * (v / max);
    for (const s of series) {
      g.strokeStyle = s.color; g.lineWidth = 2;
      g.beginPath();
      st.samples.forEach((p, i) => { if (i) g.lineTo(x(p.t), y(p[s.key])); else g.moveTo(x(p.t), y(p[s.key])); });
      g.stroke();
    }
  }

  function drawCharts() {
    if (!st.samples.length) return;
    const now = st.samples[st.samples.length - 1].t;
    const avg = (k) => st.samples.reduce((a, p) => a + p[k], 0) / st.samples.length;
    chart($("chart-tps"), [{ key: "gen", color: "#2f6fdf" }, { key: "prompt", color: "#d9822b" }], now, (v) => v.toFixed(0));
    chart($("chart-rows"), [{ key: "rows", color: "#2e9e5b" }], now, (v) => v.toFixed(1));
    const last = st.samples[st.samples.length - 1];
    $("cap-tps").textContent = "Tokens per second: generated (blue) " + last.gen.toFixed(1) + " now, " + avg("gen").toFixed(1) + " over the minute; prompt (orange) " + last.prompt.toFixed(1) + " now";
    $("cap-rows").textContent = "Rows per decode call (green): " + last.rows.toFixed(1) + " now, " + avg("rows").toFixed(1) + " over the minute; " + last.decodes.toFixed(1) + " decodes/s";
    $("chart-tps").setAttribute("aria-label", $("cap-tps").textContent);
    $("chart-rows").setAttribute("aria-label", $("cap-rows").textContent);
  }

  function init() {
    $("pause").addEventListener("click", () => {
      st.paused = !st.paused;
      $("pause").setAttribute("aria-pressed", String(st.paused));
      $("pause").textContent = st.paused ? "Resume" : "Pause";
    });
    $("open-key").addEventListener("click", openKey);
    $("key-form").addEventListener("submit", () => {
      setApiKey($("key-input").value.trim());
      if (st.abort) st.abort.abort();
      connect();
    });
    connect();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init); else init();
})();
