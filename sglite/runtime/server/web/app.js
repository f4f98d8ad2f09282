// sglite's page: chat playground, radix cache view and live metrics.
// Everything the model or the server says is put in the page as text (textContent), never as
// HTML, so an answer containing <script> shows those characters and runs nothing.
"use strict";

const POLL_MS = 1500;
const HISTORY_MS = 5 * 60 * 1000;
const TREE_QUERY = "depth=8&max_nodes=150&text_tokens=24";

const state = {
  apiKey: sessionStorage.getItem("sglite-api-key") || "",
  authorized: false,
  messages: [], // the conversation sent with each request: {role, content}
  controller: null, // AbortController of the answer streaming now
  history: [], // metric samples: {t, generated, matched, queried, running, queued}
};

const $ = (id) => document.getElementById(id);

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (state.apiKey) h["Authorization"] = "Bearer " + state.apiKey;
  return h;
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

// ------------------------------------------------------------------ connection and API key
async function connect() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers(false) });
  } catch (err) {
    setStatus("server unreachable");
    return;
  }
  if (response.status === 401) {
    state.authorized = false;
    $("key-panel").hidden = false;
    $("model-name").textContent = state.apiKey ? "the API key was refused" : "API key required";
    setChatEnabled(false);
    return;
  }
  const body = await response.json();
  state.authorized = true;
  $("key-panel").hidden = true;
  $("model-name").textContent = body.data && body.data.length ? body.data[0].id : "(no model)";
  setChatEnabled(true);
  pollCache();
}

function setStatus(text) {
  $("status").textContent = text;
}

function setChatEnabled(on) {
  $("send").disabled = !on || state.controller !== null;
  $("prompt").disabled = !on;
}

// ------------------------------------------------------------------ chat
function addMessage(role, text) {
  const box = element("div", "message " + role);
  box.append(element("div", "content", text));
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function samplingBody() {
  const body = {
    model: $("model-name").textContent,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  const kind = $("constraint-kind").value;
  const text = $("constraint").value.trim();
  if (kind === "json_schema" && text) {
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "answer", schema: JSON.parse(text) },
    };
  } else if (kind === "regex" && text) {
    body.regex = text;
  }
  return body;
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim() || state.controller || !state.authorized) return;
  let body;
  try {
    body = samplingBody();
  } catch (err) {
    addMessage("assistant", "").append(element("div", "error", "The JSON schema is not valid JSON: " + err.message));
    return;
  }
  const system = $("system").value.trim();
  state.messages.push({ role: "user", content: prompt });
  body.messages = (system ? [{ role: "system", content: system }] : []).concat(state.messages);
  addMessage("user", prompt);
  $("prompt").value = "";
  const box = addMessage("assistant", "");
  box.classList.add("streaming");
  const answer = await stream(body, box);
  box.classList.remove("streaming");
  if (answer !== null) state.messages.push({ role: "assistant", content: answer });
  else state.messages.pop(); // failed or stopped: the question is not part of the conversation
}

// Streams one answer into `box`; returns its text, or null when it failed or was stopped.
async function stream(body, box) {
  const content = box.querySelector(".content");
  const stats = element("div", "stats", "waiting…");
  box.append(stats);
  const controller = new AbortController();
  state.controller = controller;
  $("stop").disabled = false;
  setChatEnabled(true);
  const start = performance.now();
  let first = null;
  let usage = null;
  let text = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(true),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || "HTTP " + response.status);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      const events = buffered.split("\n\n");
      buffered = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]" || !data.trim()) continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          if (first === null) first = performance.now();
          text += delta.content;
          content.textContent = text;
          box.scrollIntoView({ block: "end" });
        }
      }
    }
    stats.textContent = describe(usage, start, first, performance.now());
    return text;
  } catch (err) {
    if (err.name === "AbortError") {
      stats.textContent = "stopped";
    } else {
      stats.textContent = "";
      box.append(element("div", "error", err.message));
    }
    return null;
  } finally {
    state.controller = null;
    $("stop").disabled = true;
    setChatEnabled(state.authorized);
  }
}

function describe(usage, start, first, end) {
  const parts = [];
  if (usage) {
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    parts.push(usage.prompt_tokens + " prompt tokens", cached + " cached");
  }
  if (first !== null) {
    parts.push("first token " + Math.round(first - start) + " ms");
    if (usage && usage.completion_tokens > 1 && end > first) {
      const rate = (usage.completion_tokens - 1) / ((end - first) / 1000);
      parts.push(rate.toFixed(1) + " tokens/s");
    }
  }
  if (usage) parts.push(usage.completion_tokens + " tokens");
  return parts.join(" · ");
}

function stop() {
  if (state.controller) state.controller.abort(); // the server aborts a request whose client left
}

function clearChat() {
  stop();
  state.messages = [];
  $("messages").replaceChildren();
}

// ------------------------------------------------------------------ cache view and metrics
let polling = false;

async function pollCache() {
  if (polling) return;
  polling = true;
  while (state.authorized) {
    try {
      const response = await fetch("/cache/tree?" + TREE_QUERY, { headers: headers(false) });
      if (response.status === 401) {
        state.authorized = false;
        connect();
        break;
      }
      if (response.ok) {
        const snapshot = await response.json();
        renderCache(snapshot);
        recordMetrics(snapshot.stats);
        setStatus("");
      } else {
        setStatus("cache view: HTTP " + response.status);
      }
    } catch (err) {
      setStatus("server unreachable");
    }
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
  polling = false;
}

const percent = (x) => (100 * x).toFixed(1) + "%";

// What a request that reused cached segments took from them (docs/segments.md).
function segmentNote(segments) {
  if (!segments) return "";
  return " Reused segments gave " + segments.reused + " more (" + segments.recomputed +
    " of their tokens recomputed); " + segments.computed + " were computed.";
}

function renderCache(snapshot) {
  const s = snapshot.stats;
  $("hit-rate").textContent = percent(s.cache_hit_rate);
  $("pool-usage").textContent = percent(s.pool_usage);
  $("cache-size").textContent = s.cache_size_tokens;
  $("evicted").textContent = s.evicted_tokens;
  $("segment-reused").textContent = s.segment_reused_tokens +
    (s.segment_recomputed_tokens ? " (+" + s.segment_recomputed_tokens + " recomputed)" : "");
  const tiers = Object.entries(s.hicache || {}).filter(([name]) => name !== "device");
  $("tiers").hidden = tiers.length === 0;
  $("tiers").textContent = "Lower tiers: " +
    tiers.map(([name, tier]) => name + " " + tier.tokens + " tokens").join(" · ") +
    " (disk pages live outside the tree; host-only nodes are drawn as host).";
  const last = snapshot.last_request;
  $("last-request").textContent = last
    ? "Last request: " + last.cached_tokens + " of its " + last.prompt_tokens +
      " prompt tokens came from the cache (highlighted path)." + segmentNote(last.segment_tokens)
    : "No request admitted yet.";
  const onPath = new Set(snapshot.highlight);
  const items = new Map();
  const root = $("tree");
  const fresh = element("ul", "tree");
  fresh.id = "tree";
  for (const node of snapshot.nodes) {
    const item = element("li");
    item.append(nodeLabel(node, onPath.has(node.id)));
    if (node.hidden_children) item.append(element("div", "more", "+" + node.hidden_children + " more"));
    items.set(node.id, item);
    const parent = node.parent === null ? null : items.get(node.parent);
    if (!parent) {
      fresh.append(item);
      continue;
    }
    let list = parent.querySelector(":scope > ul");
    if (!list) {
      list = element("ul");
      parent.insertBefore(list, parent.querySelector(":scope > .more"));
    }
    list.append(item);
  }
  root.replaceWith(fresh);
  $("tree-note").textContent =
    snapshot.nodes.length + " nodes shown" + (snapshot.truncated ? " (the tree has more)" : "") +
    (snapshot.replicas > 1 ? "; replica " + (snapshot.replica + 1) + " of " + snapshot.replicas : "");
}

function nodeLabel(node, onPath) {
  const label = element("span", "node" + (onPath ? " on-path" : ""));
  label.dataset.nodeId = node.id;
  if (node.tier === "root") {
    label.append(element("span", "tier tier-root", "root"));
    return label;
  }
  const shown = node.text.replace(/\n/g, "⏎") + (node.text_truncated ? "…" : "");
  const text = element("span", "text", JSON.stringify(shown));
  text.title = node.text;
  label.append(text);
  label.append(element("span", "badge", node.tokens + " tok"));
  label.append(element("span", "badge", node.hits + " hits"));
  label.append(element("span", "tier tier-" + node.tier, node.tier));
  if (node.lock_ref > 0) label.append(element("span", "lock", "locked ×" + node.lock_ref));
  return label;
}

function recordMetrics(stats) {
  const now = Date.now();
  state.history.push({
    t: now,
    generated: stats.generated_tokens,
    matched: stats.cached_prompt_tokens,
    queried: stats.queried_prompt_tokens,
    running: stats.num_running_reqs,
    queued: stats.num_queued_reqs,
  });
  while (state.history.length && state.history[0].t < now - HISTORY_MS) state.history.shift();
  const h = state.history;
  const rates = h.slice(1).map((p, i) => ({
    t: p.t,
    v: Math.max(0, p.generated - h[i].generated) / ((p.t - h[i].t) / 1000),
  }));
  const latest = h[h.length - 1];
  $("throughput-now").textContent = rates.length ? rates[rates.length - 1].v.toFixed(1) : "–";
  $("running-now").textContent = latest.running;
  $("queued-now").textContent = latest.queued;
  const queried = latest.queried - h[0].queried;
  $("hit-rate-window").textContent = queried > 0 ? percent((latest.matched - h[0].matched) / queried) : "–";
  const hitRates = h.slice(1).map((p, i) => {
    const q = p.queried - h[i].queried;
    return { t: p.t, v: q > 0 ? (p.matched - h[i].matched) / q : null };
  });
  drawChart($("chart-throughput"), [{ points: rates, color: "#2f6fdb" }], null);
  drawChart($("chart-requests"), [
    { points: h.map((p) => ({ t: p.t, v: p.running })), color: "#2b8a3e" },
    { points: h.map((p) => ({ t: p.t, v: p.queued })), color: "#e8590c" },
  ], null);
  drawChart($("chart-hit-rate"), [{ points: hitRates, color: "#7048e8" }], 1);
}

function drawChart(canvas, series, fixedMax) {
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  const now = Date.now();
  const values = series.flatMap((s) => s.points.map((p) => p.v)).filter((v) => v !== null);
  const max = fixedMax || Math.max(1, ...values);
  ctx.fillStyle = "#67717c";
  ctx.font = "10px sans-serif";
  ctx.fillText(fixedMax ? "100%" : max.toFixed(max < 10 ? 1 : 0), 3, 10);
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    for (const p of s.points) {
      if (p.v === null) {
        drawing = false;
        continue;
      }
      const x = width - ((now - p.t) / HISTORY_MS) * width;
      const y = height - 2 - (p.v / max) * (height - 14);
      if (drawing) ctx.lineTo(x, y);
      else ctx.moveTo(x, y);
      drawing = true;
    }
    ctx.stroke();
  }
}

// ------------------------------------------------------------------ wiring
function init() {
  $("chat-form").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clearChat);
  $("constraint-kind").addEventListener("change", () => {
    $("constraint").hidden = $("constraint-kind").value === "none";
  });
  $("key-panel").addEventListener("submit", (e) => {
    e.preventDefault();
    state.apiKey = $("api-key").value.trim();
    sessionStorage.setItem("sglite-api-key", state.apiKey);
    connect();
  });
  setChatEnabled(false);
  connect();
}

document.addEventListener("DOMContentLoaded", init);
