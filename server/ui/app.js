// swaserve inspector: a streaming chat against /v1/chat/completions and a view of /v1/cache/state.
// Plain browser JavaScript, no build step, no dependencies; the messages come from chat_parts.js.
"use strict";

const $ = (id) => document.getElementById(id);
const REASONS = { no_match: "no match", window_evicted: "window evicted", page_alignment: "page alignment",
                  prompt_logprobs: "prompt logprobs" };
let conversation = [];  // OpenAI messages of the current chat (system prompt added per request)
let attached = [];  // data: URLs of the images attached to the next user message
let modelId = null;
let autoTimer = null;

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("apikey").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, options) {
  const r = await fetch(path, options);
  const text = await r.text();
  let body = null;
  try { body = JSON.parse(text); } catch (e) { body = null; }
  if (!r.ok) {
    const msg = body && body.error ? body.error.message : text || r.statusText;
    throw new Error(`${r.status}: ${msg}`);
  }
  return body;
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// ---- tabs ------------------------------------------------------------------------------------------
function showTab(name) {
  for (const b of document.querySelectorAll("header nav button")) b.classList.toggle("on", b.dataset.tab === name);
  $("chat").hidden = name !== "chat";
  $("cache").hidden = name !== "cache";
  if (name === "cache") refreshCache();
  setAuto();
}

function setAuto() {
  clearInterval(autoTimer);
  autoTimer = null;
  if (!$("cache").hidden && $("auto").checked) autoTimer = setInterval(refreshCache, 2000);
}

// ---- chat ------------------------------------------------------------------------------------------
async function loadModel() {
  try {
    const r = await api("/v1/models", { headers: headers(false) });
    modelId = r.data[0].id;
    $("model").textContent = modelId;
  } catch (e) {
    $("model").textContent = "models: " + e.message;
  }
}

function requestBody() {
  const messages = chatMessages($("system").value.trim(), conversation);
  const body = { model: modelId, messages, stream: true, stream_options: { include_usage: true },
                 max_tokens: parseInt($("maxtok").value, 10) || 256,
                 chat_template_kwargs: { enable_thinking: $("thinking").checked } };
  const tools = $("tools").value.trim();
  if (tools) {
    let parsed;
    try { parsed = JSON.parse(tools); } catch (e) { throw new Error("tools: not valid JSON (" + e.message + ")"); }
    if (!Array.isArray(parsed)) throw new Error("tools: expected a JSON array");
    body.tools = parsed;
  }
  return body;
}

// ---- attached images ----------------------------------------------------------------------------
function thumbs(urls, onRemove) {
  const box = el("div", { class: "thumbs" });
  urls.forEach((url, i) => {
    const t = el("span", { class: "thumb" }, el("img", { src: url, alt: `image ${i + 1}` }));
    if (onRemove) {
      const x = el("button", { title: "remove this image" }, "\u00d7");
      x.addEventListener("click", () => onRemove(i));
      t.append(x);
    }
    box.append(t);
  });
  return box;
}

function showAttached() {
  const box = $("attached");
  box.textContent = "";
  if (attached.length) box.append(thumbs(attached, (i) => { attached.splice(i, 1); showAttached(); }));
}

async function attach(files) {
  const images = imageFiles(files);
  try {
    for (const f of images) attached.push(await readDataUrl(f));
  } catch (e) {
    $("chat-status").textContent = "";
    $("chat-status").append(el("span", { class: "error" }, e.message));
  }
  showAttached();
  return images.length;
}

async function send() {
  const text = $("input").value.trim();
  if (!text && !attached.length) return;
  $("send").disabled = true;
  $("chat-status").textContent = "";
  const images = attached;
  conversation.push(userMessage(text, images));
  const userBox = el("div", { class: "msg user" });
  if (images.length) userBox.append(thumbs(images, null));
  userBox.append(text);
  $("log").append(userBox);
  $("input").value = "";
  attached = [];
  showAttached();
  const failed = (message) => {  // the server's (or the page's) error; the turn can be sent again
    meta.textContent = "";
    meta.append(el("span", { class: "error" }, message));
    conversation.pop();
    attached = images;
    showAttached();
    if (!$("input").value) $("input").value = text;
    $("send").disabled = false;
  };
  const reasoning = el("div", { class: "reasoning" });
  const content = el("div", {});
  const meta = el("div", { class: "meta" }, "waiting\u2026");
  const box = el("div", { class: "msg assistant" }, reasoning, content, meta);
  $("log").append(box);
  let body;
  try {
    if (!modelId) await loadModel();
    body = requestBody();
  } catch (e) {
    failed(e.message);
    return;
  }
  const t0 = performance.now();
  let ttft = null, usage = null, rid = null, answer = "", toolCalls = {};
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(body) });
    if (!r.ok) {
      const err = await r.json().catch(() => null);
      throw new Error(`${r.status}: ${err && err.error ? err.error.message : r.statusText}`);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          rid = chunk.id || rid;
          if (chunk.usage) usage = chunk.usage;
          for (const ch of chunk.choices || []) {
            const d = ch.delta || {};
            if ((d.content || d.reasoning_content || d.tool_calls) && ttft === null) ttft = performance.now() - t0;
            if (d.reasoning_content) reasoning.textContent += d.reasoning_content;
            if (d.content) { answer += d.content; content.textContent = answer; }
            for (const tc of d.tool_calls || []) {
              const cur = toolCalls[tc.index] || (toolCalls[tc.index] = { id: tc.id, type: "function",
                                                                           function: { name: "", arguments: "" } });
              if (tc.function && tc.function.name) cur.function.name += tc.function.name;
              if (tc.function && tc.function.arguments) cur.function.arguments += tc.function.arguments;
            }
          }
        }
      }
    }
  } catch (e) {
    failed(e.message);
    return;
  }
  const calls = Object.values(toolCalls);
  if (calls.length) content.textContent = answer + calls.map((c) => `\n\u2192 ${c.function.name}(${c.function.arguments})`).join("");
  const msg = { role: "assistant", content: answer };
  if (calls.length) msg.tool_calls = calls;
  conversation.push(msg);
  await showUsage(meta, usage, ttft, rid);
  $("send").disabled = false;
}

async function showUsage(meta, usage, ttft, rid) {
  let cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null;
  let why = "";
  try {  // the engine's record of this request: reused length and why reuse stopped
    const st = await api("/v1/cache/state?top=1", { headers: headers(false) });
    const rec = (st.recent_requests || []).find((r) => r.request_id === rid);
    if (rec) {
      if (cached === null) cached = rec.cached_tokens;
      why = `, reuse stopped: ${REASONS[rec.reason] || rec.reason}`;
    }
  } catch (e) { /* the numbers from usage stand alone */ }
  const p = usage ? usage.prompt_tokens : "?";
  const g = usage ? usage.completion_tokens : "?";
  const t = ttft === null ? "?" : (ttft / 1000).toFixed(3) + " s";
  meta.textContent = `prompt ${p} \u00b7 cached ${cached === null ? "?" : cached} \u00b7 generated ${g} \u00b7 TTFT ${t}${why}`;
  meta.dataset.cached = cached === null ? "" : String(cached);
  meta.dataset.prompt = String(p);
}

// ---- cache -----------------------------------------------------------------------------------------
function swaBar(node) {
  const bar = el("span", { class: "bar", title: "sliding-window KV per page: green live, grey evicted" });
  for (const [, pages, live] of node.swa_runs) {
    bar.append(el("span", { class: live ? "live" : "gone", style: `width:${(100 * pages) / node.pages}%` }));
  }
  return bar;
}

function renderTree(st) {
  const byParent = new Map();
  for (const n of st.nodes) {
    const k = n.parent === null ? -1 : n.parent;
    if (!byParent.has(k)) byParent.set(k, []);
    byParent.get(k).push(n);
  }
  const clock = st.counters ? st.counters.clock : 0;
  const build = (parentKey) => {
    const ul = el("ul", { class: "tree" });
    for (const n of byParent.get(parentKey) || []) {
      const locks = n.locks ? el("span", { class: "lock", title: "requests holding this prefix" }, `\u{1F512}${n.locks}`) : "";
      const row = el("div", { class: "node", "data-tokens": n.tokens, "data-start": n.start_token },
        el("span", { class: "len", title: "tokens on this edge (the prefix starts at token " + n.start_token + ")" },
           `+${n.tokens} tok`),
        swaBar(n),
        el("span", { class: "preview", title: n.preview }, n.preview),
        el("span", { class: "meta" }, `${n.subtree_tokens} tok in subtree \u00b7 used ${clock - n.last_access} ops ago` +
           (n.reusable_end ? " \u00b7 reusable end" : " \u00b7 window gone at end")),
        locks);
      const li = el("li", {}, row);
      if (byParent.has(n.id)) li.append(build(n.id));
      if (n.hidden_nodes > 0) {
        li.append(el("div", { class: "hidden-note", style: "padding-left:1.2em" },
                     `\u2026 ${n.hidden_nodes} more node(s), ${n.hidden_tokens} tokens`));
      }
      ul.append(li);
    }
    return ul;
  };
  const tree = $("tree");
  tree.textContent = "";
  if (!st.tree) { tree.append(el("div", { class: "meta" }, "this cache type keeps no prefixes (--cache-type naive)")); return; }
  if (!st.nodes.length) { tree.append(el("div", { class: "meta" }, "the cache is empty")); return; }
  tree.append(build(-1));
  $("tree-note").textContent = `(${st.nodes.length} of ${st.totals.nodes} nodes shown, largest first` +
    (st.hidden.nodes ? `; ${st.hidden.nodes} nodes / ${st.hidden.tokens} tokens collapsed` : "") +
    (st.consistent ? ")" : "; read across steps, approximate)");
}

function renderCards(st) {
  const cards = $("cards");
  cards.textContent = "";
  const ps = st.page_size || 1;
  const add = (label, value) => cards.append(el("div", { class: "card" }, el("b", {}, value), label));
  add("cached nodes", st.totals.nodes);
  add("full-KV tokens cached", st.totals.full_pages * ps);
  add("live SWA tokens cached", st.totals.swa_live_pages * ps);
  for (const [name, label] of [["full_pool", "full pool"], ["swa_pool", "SWA pool"]]) {
    const p = st.pools[name];
    add(`${label}: used / cached / total pages`, `${p.used} / ${p.cached} / ${p.total}`);
  }
  add("running / waiting", `${st.running} / ${st.waiting}`);
}

function renderChart(st) {
  const c = $("chart");
  const ctx = c.getContext("2d");
  ctx.clearRect(0, 0, c.width, c.height);
  const h = st.pool_history || [];
  if (h.length < 1) return;
  const t1 = h[h.length - 1].time, t0 = Math.min(h[0].time, t1 - 60);
  let top = 0;  // the y axis ends at a round share above the highest point (small caches stay visible)
  for (const s of h) for (const name of ["full_pool", "swa_pool"]) top = Math.max(top, (s[name].used + s[name].cached) / s[name].total);
  const ymax = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1].find((v) => v >= top * 1.1) || 1;
  const x = (t) => 40 + ((c.width - 50) * (t - t0)) / Math.max(1, t1 - t0);
  const y = (v) => c.height - 20 - ((c.height - 30) * v) / ymax;
  ctx.strokeStyle = "#d9dde5"; ctx.fillStyle = "#667085"; ctx.font = "11px sans-serif";
  for (const v of [0, ymax / 2, ymax]) {
    ctx.beginPath(); ctx.moveTo(40, y(v)); ctx.lineTo(c.width - 10, y(v)); ctx.stroke();
    ctx.fillText(`${+(v * 100).toFixed(1)}%`, 4, y(v) + 4);
  }
  ctx.fillText(`${Math.round(t1 - t0)} s`, 40, c.height - 5);
  ctx.fillText("now", c.width - 30, c.height - 5);
  for (const [name, color] of [["full_pool", "#2f6fde"], ["swa_pool", "#2e9d5b"]]) {
    for (const [dash, f] of [[[], (p) => (p.used + p.cached) / p.total], [[4, 3], (p) => p.used / p.total]]) {
      ctx.setLineDash(dash); ctx.strokeStyle = color; ctx.beginPath();
      h.forEach((s, i) => { const v = f(s[name]); if (i) ctx.lineTo(x(s.time), y(v)); else ctx.moveTo(x(s.time), y(v)); });
      ctx.stroke();
    }
  }
  ctx.setLineDash([]);
}

function renderRecent(st) {
  const tb = $("recent").querySelector("tbody");
  tb.textContent = "";
  for (const r of st.recent_requests || []) {
    tb.append(el("tr", { "data-request": r.request_id }, el("td", {}, r.request_id), el("td", {}, r.prompt_tokens),
                 el("td", {}, r.cached_tokens), el("td", {}, r.matched_tokens),
                 el("td", {}, REASONS[r.reason] || r.reason)));
  }
}

async function refreshCache() {
  try {
    const st = await api("/v1/cache/state?top=64", { headers: headers(false) });
    renderCards(st);
    renderChart(st);
    renderTree(st);
    renderRecent(st);
    $("cache-status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.cacheLoaded = "1";
  } catch (e) {
    $("cache-status").textContent = "";
    $("cache-status").append(el("span", { class: "error" }, e.message));
  }
}

async function flush() {
  try {
    await api("/flush_cache", { method: "POST", headers: headers(false) });
    $("cache-status").textContent = "cache flushed";
  } catch (e) {
    $("cache-status").textContent = "";
    $("cache-status").append(el("span", { class: "error" }, "flush: " + e.message));
  }
  refreshCache();
}

// ---- wiring ----------------------------------------------------------------------------------------
for (const b of document.querySelectorAll("header nav button")) b.addEventListener("click", () => showTab(b.dataset.tab));
$("send").addEventListener("click", send);
$("input").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(); });
$("newchat").addEventListener("click", () => { conversation = []; $("log").textContent = ""; attached = []; showAttached(); });
$("images").addEventListener("change", async (e) => { await attach(e.target.files); e.target.value = ""; });
$("input").addEventListener("paste", (e) => {  // an image pasted into the message box is attached
  const files = e.clipboardData ? e.clipboardData.files : null;
  if (imageFiles(files).length) { e.preventDefault(); attach(files); }
});
$("chat").addEventListener("dragover", (e) => e.preventDefault());
$("chat").addEventListener("drop", (e) => { e.preventDefault(); attach(e.dataTransfer && e.dataTransfer.files); });
$("refresh").addEventListener("click", refreshCache);
$("auto").addEventListener("change", setAuto);
$("flush").addEventListener("click", flush);
$("apikey").value = localStorage.getItem("swaserve-key") || "";
$("apikey").addEventListener("change", () => { localStorage.setItem("swaserve-key", $("apikey").value.trim()); loadModel(); });
loadModel();
