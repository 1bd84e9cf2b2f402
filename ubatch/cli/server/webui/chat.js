// The chat page: conversations in localStorage, answers streamed from /v1/chat/completions,
// a stop button, regenerate and edit, llama-server's sampling settings, the speed of each answer.
"use strict";

(() => {
  const { el, getJSON, headers, apiBase, readSSE, errorOf, setApiKey, apiKey } = UB;
  const $ = (id) => document.getElementById(id);
  const STORE = "ubatch.conversations";
  const SETTINGS = "ubatch.settings";
  const FIELDS = ["temperature", "top_k", "top_p", "min_p", "max_tokens"];

  const state = {
    convs: [],
    current: null, // id
    settings: { system: "", temperature: null, top_k: null, top_p: null, min_p: null, max_tokens: null },
    props: null,
    abort: null,
    busy: false,
  };

  // -- storage ------------------------------------------------------------------------------
  function load() {
    try { state.convs = JSON.parse(localStorage.getItem(STORE) || "[]"); } catch (e) { state.convs = []; }
    try { Object.assign(state.settings, JSON.parse(localStorage.getItem(SETTINGS) || "{}")); } catch (e) { /* defaults */ }
    state.current = state.convs.length ? state.convs[0].id : null;
  }
  function save() {
    try { localStorage.setItem(STORE, JSON.stringify(state.convs)); } catch (e) { notice("warn", "Could not save the conversation: " + e.message); }
  }
  function conv() { return state.convs.find((c) => c.id === state.current) || null; }
  function newConv() {
    const c = { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [], updated: Date.now() };
    state.convs.unshift(c);
    state.current = c.id;
    return c;
  }

  // -- notices ------------------------------------------------------------------------------
  function notice(kind, text, id) {
    const box = $("notices");
    if (id) { const old = box.querySelector('[data-id="' + id + '"]'); if (old) old.remove(); }
    const n = el("div", { class: "notice " + kind, "data-id": id || "" }, [
      el("span", { text }),
      el("button", { type: "button", class: "icon", "aria-label": "Dismiss", text: "\u00d7", onclick: () => n.remove() }),
    ]);
    box.append(n);
    return n;
  }
  function clearNotice(id) { const n = $("notices").querySelector('[data-id="' + id + '"]'); if (n) n.remove(); }

  function unauthorized(msg) {
    notice("error", (apiKey() ? "The server refused the API key (401): " : "This server needs an API key (401): ") + msg + ". Enter it under \u201cAPI key\u201d.", "auth");
    openKey();
  }

  // -- server properties ----------------------------------------------------------------------
  async function loadProps() {
    try {
      const p = await getJSON("props");
      state.props = p;
      clearNotice("auth");
      const name = p.model_alias || (p.model_path || "").split(/[\\/]/).pop() || "";
      $("model").textContent = name;
      document.title = name ? name + " \u2013 ubatch chat" : "ubatch chat";
      const tpl = String(p.chat_template || "");
      if (!/[{][%{]/.test(tpl)) {
        notice("warn", "This model's file has no chat template: the server formats messages with the built-in \u201c" + (tpl || "chatml") +
          "\u201d format. If it is a base model, its answers will not follow a conversation; use /completion for raw text.", "template");
      } else clearNotice("template");
      const d = (p.default_generation_settings || {}).params || {};
      for (const f of FIELDS) {
        const v = f === "max_tokens" ? d.n_predict : d[f];
        if (v !== undefined) $("s-" + f).placeholder = String(v);
      }
    } catch (e) {
      if (e.status === 401) unauthorized(e.message);
      else notice("error", "Could not reach the server: " + e.message, "props");
    }
  }

  // -- rendering ----------------------------------------------------------------------------
  function speedLine(t) {
    if (!t) return null;
    const f = (x) => (x === undefined || x === null || !isFinite(x) ? "-" : x.toFixed(1));
    const cached = t.cache_n ? ", " + t.cache_n + " cached" : "";
    return "Prompt: " + t.prompt_n + " tokens" + cached + ", " + f(t.prompt_per_second) + " t/s \u00b7 Generation: " +
      t.predicted_n + " tokens, " + f(t.predicted_per_second) + " t/s";
  }

  function renderSidebar() {
    const ul = $("conversations");
    ul.replaceChildren();
    for (const c of state.convs) {
      const cur = c.id === state.current;
      ul.append(el("li", { class: cur ? "current" : "" }, [
        el("button", { type: "button", class: "conv", "aria-current": cur ? "true" : null, text: c.title || "New chat",
          onclick: () => { if (state.busy) return; state.current = c.id; renderAll(); closeSidebarOnPhone(); } }),
        el("button", { type: "button", class: "icon", "aria-label": "Delete conversation: " + (c.title || "New chat"), title: "Delete", text: "\u00d7",
          onclick: () => { if (state.busy && cur) return; state.convs = state.convs.filter((x) => x !== c); if (cur) state.current = state.convs.length ? state.convs[0].id : null; save(); renderAll(); } }),
      ]));
    }
  }

  function messageNode(c, m, i) {
    const last = i === c.messages.length - 1;
    const body = el("div", { class: "content" });
    if (m.role === "assistant") body.innerHTML = Markdown.render(m.content); // escaped inside
    else body.textContent = m.content;
    const actions = el("div", { class: "actions" });
    actions.append(el("button", { type: "button", text: "Copy", onclick: () => navigator.clipboard && navigator.clipboard.writeText(m.content) }));
    if (m.role === "user") actions.append(el("button", { type: "button", class: "edit", text: "Edit", disabled: state.busy, onclick: () => editMessage(i) }));
    if (m.role === "assistant" && last) actions.append(el("button", { type: "button", class: "regenerate", text: "Regenerate", disabled: state.busy, onclick: regenerate }));
    const meta = [];
    if (m.stopped) meta.push(el("span", { class: "stopped", text: "Stopped." }));
    if (m.error) meta.push(el("span", { class: "error", role: "alert", text: m.error }));
    const sp = speedLine(m.timings);
    if (sp) meta.push(el("span", { class: "speed", text: sp }));
    return el("article", { class: "msg " + m.role, "data-index": String(i) }, [
      el("h2", { class: "role", text: m.role === "user" ? "You" : "Assistant" }),
      body,
      meta.length ? el("p", { class: "meta" }, meta) : null,
      actions,
    ]);
  }

  function renderMessages() {
    const box = $("messages");
    const c = conv();
    box.replaceChildren();
    if (!c || !c.messages.length) {
      box.append(el("p", { class: "empty", text: "Start a conversation below. Conversations stay in this browser." }));
      return;
    }
    c.messages.forEach((m, i) => box.append(messageNode(c, m, i)));
    box.scrollTop = box.scrollHeight;
  }

  function renderAll() {
    renderSidebar();
    renderMessages();
    $("messages").setAttribute("aria-busy", String(state.busy)); // read the answer once it is complete
    $("send").hidden = state.busy;
    $("stop").hidden = !state.busy;
  }

  // Redraw only the streaming message, once per frame.
  let pending = false;
  function redrawLast() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      const c = conv();
      const box = $("messages");
      if (!c || !c.messages.length) return;
      const i = c.messages.length - 1;
      const old = box.querySelector('article[data-index="' + i + '"]');
      const node = messageNode(c, c.messages[i], i);
      if (old) old.replaceWith(node); else box.append(node);
      const near = box.scrollHeight - box.scrollTop - box.clientHeight < 120;
      if (near) box.scrollTop = box.scrollHeight;
    });
  }

  // -- requests -----------------------------------------------------------------------------
  function requestBody(c) {
    const s = state.settings;
    const msgs = [];
    if (s.system && s.system.trim()) msgs.push({ role: "system", content: s.system });
    for (const m of c.messages.slice(0, -1)) if (!m.error || m.content) msgs.push({ role: m.role, content: m.content });
    const body = { messages: msgs, stream: true, cache_prompt: true, timings_per_token: false };
    for (const f of FIELDS) if (s[f] !== null && s[f] !== "" && s[f] !== undefined && isFinite(s[f])) body[f] = Number(s[f]);
    return body;
  }

  async function generate() {
    const c = conv();
    c.messages.push({ role: "assistant", content: "" });
    const m = c.messages[c.messages.length - 1];
    state.busy = true;
    state.abort = new AbortController();
    renderAll();
    try {
      const res = await fetch(apiBase() + "v1/chat/completions", {
        method: "POST",
        headers: headers({ "Content-Type": "application/json" }),
        body: JSON.stringify(requestBody(c)),
        signal: state.abort.signal,
      });
      if (!res.ok) {
        const e = await errorOf(res);
        if (res.status === 401) unauthorized(e.message);
        throw e;
      }
      await readSSE(res, (ev, data) => {
        if (data === "[DONE]") return;
        const j = JSON.parse(data);
        if (j.error) throw new Error(j.error.message || "error");
        const ch = (j.choices || [])[0];
        if (ch && ch.delta && typeof ch.delta.content === "string") m.content += ch.delta.content;
        if (j.timings) m.timings = j.timings;
        redrawLast();
      });
    } catch (e) {
      if (e.name === "AbortError") m.stopped = true;
      else m.error = (e.status ? e.status + ": " : "") + e.message;
    } finally {
      state.busy = false;
      state.abort = null;
      if (c.title === "New chat") {
        const first = c.messages.find((x) => x.role === "user");
        if (first) c.title = first.content.slice(0, 48);
      }
      c.updated = Date.now();
      save();
      renderAll();
      $("input").focus();
    }
  }

  function send(text) {
    if (state.busy || !text.trim()) return;
    const c = conv() || newConv();
    c.messages.push({ role: "user", content: text });
    generate();
  }

  function regenerate() {
    const c = conv();
    if (state.busy || !c) return;
    if (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
    generate();
  }

  function editMessage(i) {
    const c = conv();
    if (state.busy || !c) return;
    const node = $("messages").querySelector('article[data-index="' + i + '"]');
    const ta = el("textarea", { class: "edit-box", rows: "3", "aria-label": "Edit message" });
    ta.value = c.messages[i].content;
    const submit = () => {
      c.messages[i].content = ta.value;
      c.messages.length = i + 1;
      generate();
    };
    ta.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); submit(); }
      if (e.key === "Escape") renderMessages();
    });
    node.querySelector(".content").replaceWith(ta);
    node.querySelector(".actions").replaceChildren(
      el("button", { type: "button", class: "primary", text: "Save and send", onclick: submit }),
      el("button", { type: "button", text: "Cancel", onclick: renderMessages }),
    );
    ta.focus();
  }

  // -- dialogs ------------------------------------------------------------------------------
  function openSettings() {
    $("s-system").value = state.settings.system || "";
    for (const f of FIELDS) $("s-" + f).value = state.settings[f] === null || state.settings[f] === undefined ? "" : state.settings[f];
    $("settings").showModal();
  }
  function saveSettings() {
    state.settings.system = $("s-system").value;
    for (const f of FIELDS) {
      const v = $("s-" + f).value.trim();
      state.settings[f] = v === "" ? null : Number(v);
    }
    try { localStorage.setItem(SETTINGS, JSON.stringify(state.settings)); } catch (e) { /* this page only */ }
  }
  function openKey() {
    const d = $("keydlg");
    if (d.open) return;
    $("key-input").value = apiKey();
    d.showModal();
  }

  function closeSidebarOnPhone() {
    document.body.classList.remove("sidebar-open");
    $("toggle-sidebar").setAttribute("aria-expanded", "false");
  }

  // -- wiring -------------------------------------------------------------------------------
  function init() {
    load();
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const t = $("input").value;
      if (!t.trim() || state.busy) return;
      $("input").value = "";
      send(t);
    });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop").addEventListener("click", () => { if (state.abort) state.abort.abort(); });
    $("new-chat").addEventListener("click", () => { if (state.busy) return; newConv(); save(); renderAll(); closeSidebarOnPhone(); $("input").focus(); });
    $("open-settings").addEventListener("click", openSettings);
    $("settings-form").addEventListener("submit", saveSettings);
    $("settings-reset").addEventListener("click", () => {
      $("s-system").value = "";
      for (const f of FIELDS) $("s-" + f).value = "";
    });
    $("open-key").addEventListener("click", openKey);
    $("key-form").addEventListener("submit", () => { setApiKey($("key-input").value.trim()); loadProps(); });
    $("key-clear").addEventListener("click", () => { setApiKey(""); $("key-input").value = ""; $("keydlg").close(); loadProps(); });
    $("toggle-sidebar").addEventListener("click", () => {
      const open = document.body.classList.toggle("sidebar-open");
      $("toggle-sidebar").setAttribute("aria-expanded", String(open));
    });
    renderAll();
    loadProps();
    $("input").focus();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init); else init();
})();
