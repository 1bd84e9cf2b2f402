// Shared by both pages: where the API is, the API key, escaping, and reading a server-sent
// event stream from fetch (EventSource cannot send an Authorization header).
"use strict";

const UB = (() => {
  const KEY = "ubatch.apiKey";

  // The API lives beside the page: "/", "/index.html", "/engine" or "/prefix" (--api-prefix).
  function apiBase() {
    let p = location.pathname;
    p = p.replace(/(index\.html|engine)$/, "");
    if (!p.endsWith("/")) p += "/";
    return p;
  }

  function apiKey() {
    try { return localStorage.getItem(KEY) || ""; } catch (e) { return ""; }
  }

  function setApiKey(k) {
    try {
      if (k) localStorage.setItem(KEY, k); else localStorage.removeItem(KEY);
    } catch (e) { /* private mode: the key lasts this page */ }
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const k = apiKey();
    if (k) h["Authorization"] = "Bearer " + k;
    return h;
  }

  class HttpError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function errorOf(res) {
    let msg = res.status + " " + res.statusText;
    try {
      const j = await res.json();
      if (j && j.error && j.error.message) msg = j.error.message;
    } catch (e) { /* not JSON */ }
    return new HttpError(res.status, msg);
  }

  async function getJSON(path) {
    const res = await fetch(apiBase() + path, { headers: headers() });
    if (!res.ok) throw await errorOf(res);
    return res.json();
  }

  // Calls onEvent(eventName, dataString) for each event of a text/event-stream response.
  async function readSSE(res, onEvent) {
    const reader = res.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.search(/\r?\n\r?\n/)) >= 0) {
        const block = buf.slice(0, i);
        buf = buf.slice(i + (buf[i] === "\r" ? 4 : 2));
        let ev = "message";
        const data = [];
        for (const line of block.split(/\r?\n/)) {
          if (line.startsWith("event:")) ev = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) onEvent(ev, data.join("\n"));
      }
    }
  }

  function escapeHTML(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }

  // Element builder: el("div", {class: "x", text: "..."}, children). Text is never parsed as HTML.
  function el(tag, attrs, children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "text") e.textContent = v;
      else if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : v);
    }
    for (const c of [].concat(children || [])) if (c) e.append(c);
    return e;
  }

  function bytes(n) {
    if (n >= 1 << 30) return (n / (1 << 30)).toFixed(2) + " GiB";
    if (n >= 1 << 20) return (n / (1 << 20)).toFixed(1) + " MiB";
    if (n >= 1 << 10) return (n / (1 << 10)).toFixed(1) + " KiB";
    return n + " B";
  }

  // A colour per sequence id, distinct on light and dark backgrounds.
  const PALETTE = ["#2f6fdf", "#d9534f", "#2e9e5b", "#b8860b", "#8e44ad", "#e67e22", "#16a2b8", "#c2185b",
    "#5d8a00", "#795548", "#3f51b5", "#00897b"];
  function seqColor(s) { return PALETTE[((s % PALETTE.length) + PALETTE.length) % PALETTE.length]; }

  return { apiBase, apiKey, setApiKey, headers, HttpError, errorOf, getJSON, readSSE, escapeHTML, el, bytes, seqColor };
})();
