// sequoia-offload's chat page: conversations kept in this browser's local storage, answers streamed
// from the server's /v1/chat/completions. Every text from a user or the model goes into the page
// as text (textContent, text nodes), never as HTML.
"use strict";

const STORE = "sequoia-offload.chats";
const SETTINGS = "sequoia-offload.settings";
const $ = (id) => document.getElementById(id);

let storageProblem = "";  // shown once the page is up: stored data that could not be used
let state = load(STORE, { order: [], chats: {}, active: null }, validChats);
// maxTokens "": no limit sent, the answer may use the rest of the context (the server's default)
let settings = load(SETTINGS, { system: "", temperature: 0.7, maxTokens: "", apiKey: "" }, validSettings);
let modelName = null;
let controller = null;  // the AbortController of the answer being streamed

function validChats(v) {
  if (!Array.isArray(v.order) || !v.chats || typeof v.chats !== "object") return false;
  return Object.values(v.chats).every((c) => c && typeof c.title === "string" && Array.isArray(c.messages) &&
    c.messages.every((m) => m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string"));
}

function validSettings(v) {
  return typeof v.system === "string" && typeof v.apiKey === "string" && Number.isFinite(Number(v.temperature)) &&
    (v.maxTokens === "" || Number.isFinite(Number(v.maxTokens)));
}

function load(key, fallback, valid) {
  const raw = localStorage.getItem(key);
  if (raw === null) return fallback;
  try {
    const value = Object.assign({}, fallback, JSON.parse(raw));
    if (valid(value)) return value;
  } catch (e) { /* not JSON */ }
  // another page on this origin, or an older version, wrote something else: keep a copy, start afresh
  localStorage.setItem(key + ".unreadable", raw);
  storageProblem = "Stored " + (key === STORE ? "conversations" : "settings") + " could not be read and were " +
    "set aside (kept in local storage as " + key + ".unreadable).";
  return fallback;
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(state));
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
    return true;
  } catch (e) {  // QuotaExceededError: the browser's storage for this page is full
    showError("This browser's storage is full, so the conversation is not saved: delete old conversations.");
    return false;
  }
}

function newChat() {
  const id = "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 7);
  state.chats[id] = { id, title: "New chat", messages: [] };
  state.order.unshift(id);
  state.active = id;
  save();
  render();
}

function active() {
  if (!state.active || !state.chats[state.active]) newChat();
  return state.chats[state.active];
}

// --- rendering: text as text, ``` fences as code blocks, `inline` as code ---

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function inline(parent, text) {
  const parts = text.split(/`([^`\n]+)`/);
  parts.forEach((part, i) => {
    if (i % 2) parent.appendChild(el("code", null, part));
    else if (part) parent.appendChild(document.createTextNode(part));
  });
}

function renderText(container, text) {
  container.replaceChildren();
  const fence = /```([^\n`]*)\n?([\s\S]*?)(?:```|$)/g;
  let last = 0;
  const prose = (chunk) => {
    for (const para of chunk.split(/\n{2,}/)) {
      if (!para.trim()) continue;
      const p = el("p");
      inline(p, para.replace(/^\n+|\n+$/g, ""));
      container.appendChild(p);
    }
  };
  for (let m; (m = fence.exec(text)) !== null;) {
    if (m[0] === "") { fence.lastIndex++; continue; }
    prose(text.slice(last, m.index));
    const pre = el("pre");
    const code = el("code", null, m[2].replace(/\n$/, ""));
    if (m[1].trim()) code.dataset.lang = m[1].trim();
    pre.appendChild(code);
    container.appendChild(pre);
    last = fence.lastIndex;
  }
  prose(text.slice(last));
}

function statsLine(s) {
  if (!s) return "";
  const parts = [];
  if (s.tokens_per_second != null) parts.push(s.tokens_per_second.toFixed(1) + " tokens/s");
  if (s.tokens_per_step != null) parts.push(s.tokens_per_step.toFixed(2) + " tokens/step");
  if (s.trees) parts.push("trees " + s.trees);  // --tree auto: "(8,3) x 30 steps, plain x 4"
  else if (s.tree) parts.push("tree " + s.tree);
  if (s.completion_tokens != null) parts.push(s.completion_tokens + " tokens");
  if (s.cached_tokens != null) parts.push(s.cached_tokens + " prompt tokens reused");
  return parts.join(" \u00b7 ");
}

function messageNode(m) {
  const node = el("div", "msg " + m.role);
  node.dataset.role = m.role;
  node.appendChild(el("div", "role", m.role === "user" ? "You" : (m.model || modelName || "Assistant")));
  const text = el("div", "text");
  renderText(text, m.content);
  node.appendChild(text);
  const notes = [statsLine(m.stats), m.stopped ? "stopped" : "", m.cut ? "cut off: " + m.cut : ""];
  const stats = el("div", "stats", notes.filter(Boolean).join(" \u00b7 "));
  if (m.role === "assistant") node.appendChild(stats);
  return node;
}

function render() {
  const list = $("conversations");
  list.replaceChildren();
  for (const id of state.order) {
    const chat = state.chats[id];
    if (!chat) continue;
    const li = el("li", id === state.active ? "active" : null);
    const open = el("button", "open", chat.title);
    open.type = "button";
    open.title = chat.title;
    open.addEventListener("click", () => { if (!controller) { state.active = id; save(); render(); } });
    const del = el("button", "delete", "\u00d7");
    del.type = "button";
    del.setAttribute("aria-label", "Delete " + chat.title);
    del.addEventListener("click", () => removeChat(id));
    li.append(open, del);
    list.appendChild(li);
  }
  const box = $("messages");
  box.replaceChildren(...active().messages.map(messageNode));
  box.scrollTop = box.scrollHeight;
}

function removeChat(id) {
  if (controller) return;  // (a re-render would detach the answer being streamed)
  delete state.chats[id];
  state.order = state.order.filter((x) => x !== id);
  if (state.active === id) state.active = state.order[0] || null;
  save();
  render();
}

// --- talking to the server ---

function headers() {
  const h = { "Content-Type": "application/json" };
  if (settings.apiKey) h.Authorization = "Bearer " + settings.apiKey;
  return h;
}

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

async function explain(response) {
  let message = "";
  try {
    message = (await response.json()).error.message;
  } catch (e) { /* not our JSON */ }
  if (response.status === 401) {
    return (settings.apiKey ? "The API key given is wrong" : "The server needs an API key") +
      " (" + (message || "401") + "): set it under Settings.";
  }
  if (response.status === 429) return "The server is busy with other answers (its queue is full). Try again in a moment.";
  return "The server answered " + response.status + (message ? ": " + message : "");
}

async function refreshStatus() {
  try {
    const r = await fetch("/health");
    const h = await r.json();
    modelName = h.model;
    $("model-name").textContent = h.model;
    $("server-status").textContent = "Model " + h.model + (h.busy ? " \u00b7 answering" : " \u00b7 idle") +
      (h.waiting ? " \u00b7 " + h.waiting + " waiting" : "");
  } catch (e) {
    $("server-status").textContent = "The server cannot be reached.";
  }
}

async function send(text) {
  showError("");
  if (modelName === null) await refreshStatus();
  const chat = active();
  if (!chat.messages.length) chat.title = text.slice(0, 40) || "New chat";
  const answer = { role: "assistant", content: "", model: modelName };  // who answered, kept with it
  chat.messages.push({ role: "user", content: text }, answer);
  save();
  render();
  const node = $("messages").lastElementChild;
  const history = chat.messages.slice(0, -1).map((m) => ({ role: m.role, content: m.content }));
  const messages = settings.system.trim() ? [{ role: "system", content: settings.system }, ...history] : history;
  const body = {
    model: modelName || "", messages, stream: true, stream_options: { include_usage: true },
    temperature: Number(settings.temperature),
  };
  if (settings.maxTokens !== "") body.max_tokens = Number(settings.maxTokens);
  controller = new AbortController();
  busy(true);
  let failed = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      failed = await explain(r);
    } else {
      failed = await readStream(r, answer, node);
    }
  } catch (e) {
    if (e.name === "AbortError") answer.stopped = true;
    else if (e instanceof SyntaxError) failed = "The server sent something that is not an answer stream.";
    else failed = "Cannot reach the server: is `sequoia-offload serve` still running?";
  }
  if (failed && answer.content) answer.cut = failed;  // part of an answer came: keep it, marked
  controller = null;
  busy(false);
  if (failed && !answer.content) {  // nothing came: take the turn back, so that it can be sent again
    chat.messages.splice(-2, 2);
    $("input").value = text;
  }
  if (failed) showError(failed);
  save();
  render();
  refreshStatus();
}

async function readStream(response, answer, node) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const text = node.querySelector(".text");
  let buffer = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return "the stream ended before the answer did";
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;  // ": keep-alive" comments
        const data = line.slice(6);
        if (data === "[DONE]") return null;
        const chunk = JSON.parse(data);
        if (chunk.error) return "The server stopped the answer: " + chunk.error.message;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          answer.content += delta.content;
          renderText(text, answer.content);
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        if (chunk.usage) {
          const s = chunk.sequoia || {};
          answer.stats = {
            tokens_per_second: s.tokens_per_second, tokens_per_step: s.tokens_per_step, tree: s.tree, trees: s.trees,
            completion_tokens: chunk.usage.completion_tokens,
            cached_tokens: (chunk.usage.prompt_tokens_details || {}).cached_tokens,
          };
        }
      }
    }
  }
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("input").disabled = on;
}

// --- wiring ---

function bindSetting(id, key, parse) {
  const input = $(id);
  input.value = settings[key];
  input.addEventListener("input", () => { settings[key] = parse(input.value); save(); });
}

document.addEventListener("DOMContentLoaded", () => {
  bindSetting("system", "system", String);
  bindSetting("temperature", "temperature", (v) => Math.min(2, Math.max(0, Number(v) || 0)));
  bindSetting("max-tokens", "maxTokens", (v) => (v.trim() === "" ? "" : Math.max(1, Math.floor(Number(v)) || 1)));
  bindSetting("api-key", "apiKey", (v) => v.trim());
  $("new-chat").addEventListener("click", () => { if (!controller) newChat(); });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("toggle-side").addEventListener("click", () => $("app").classList.toggle("show-side"));
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value;
    if (!text.trim() || controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  render();
  refreshStatus();
  if (storageProblem) showError(storageProblem);
});
