// The jaxserve playground: a chat over the public OpenAI-compatible API (/v1/models,
// /v1/chat/completions, streamed), with the sampling settings, a JSON schema for structured
// output, tools, and per message the time to first token and the generation speed.
// Plain browser JavaScript: no build step, nothing loaded from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "jaxserve-playground-api-key";
const history = []; // the conversation sent with each request (OpenAI message objects)
let controller = null; // AbortController of the request in flight

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text, isError) {
  const s = $("status");
  s.textContent = text;
  s.className = isError ? "error" : "";
}

// The error envelope {"error": {"message", "type", "code"}} as one line for a person.
function errorText(body, httpStatus) {
  const e = body && body.error;
  if (e && typeof e === "object") {
    const code = e.code || httpStatus;
    return (code ? code + " " : "") + (e.type ? e.type + ": " : "") + (e.message || "error");
  }
  if (typeof e === "string") return e;
  return "HTTP " + httpStatus;
}

async function readError(resp) {
  try {
    return errorText(await resp.json(), resp.status);
  } catch (_) {
    return "HTTP " + resp.status + " " + resp.statusText;
  }
}

async function loadModels() {
  const select = $("model");
  try {
    const resp = await fetch("/v1/models", { headers: headers() });
    if (!resp.ok) {
      setStatus("Cannot list models: " + (await readError(resp)), true);
      return;
    }
    const data = (await resp.json()).data || [];
    const previous = select.value;
    select.replaceChildren();
    for (const m of data) {
      const opt = document.createElement("option");
      opt.value = opt.textContent = m.id;
      select.appendChild(opt);
    }
    if (data.some((m) => m.id === previous)) select.value = previous;
    const card = data.find((m) => m.id === select.value);
    setStatus(card ? "max_model_len " + card.max_model_len : "no model served", !card);
  } catch (err) {
    setStatus("Cannot reach the server: " + err, true);
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "content";
  body.textContent = text || "";
  div.append(who, body);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function showError(container, text) {
  const e = document.createElement("div");
  e.className = "error-text";
  e.textContent = text;
  container.classList.add("error");
  container.appendChild(e);
}

function number(id, parse) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const v = parse(raw);
  if (Number.isNaN(v)) throw new Error(id + " is not a number: " + raw);
  return v;
}

function jsonField(id, what) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  try {
    return JSON.parse(raw);
  } catch (err) {
    throw new Error(what + " is not valid JSON: " + err.message);
  }
}

// The request body from the settings panel; fields left empty take the server's defaults.
function requestBody() {
  const body = {
    model: $("model").value,
    messages: [],
    stream: true,
    stream_options: { include_usage: true },
  };
  const system = $("system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  body.messages.push(...history);
  const floats = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"];
  for (const f of floats) {
    const v = number(f, parseFloat);
    if (v !== undefined) body[f] = v;
  }
  for (const f of ["top_k", "max_tokens", "seed"]) {
    const v = number(f, (s) => parseInt(s, 10));
    if (v !== undefined) body[f] = v;
  }
  const stops = $("stop_strings").value.split("\n").filter((s) => s !== "");
  if (stops.length) body.stop = stops;
  const schema = jsonField("json_schema", "The JSON schema");
  if (schema !== undefined) {
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: schema } };
  }
  const tools = jsonField("tools", "The tools");
  if (tools !== undefined) {
    if (!Array.isArray(tools)) throw new Error("The tools must be a JSON array.");
    body.tools = tools;
  }
  if ($("tool_choice").value) body.tool_choice = $("tool_choice").value;
  return body;
}

function renderToolCalls(container, calls) {
  let box = container.querySelector(".tool-calls");
  if (!box) {
    box = document.createElement("div");
    box.className = "tool-calls";
    container.appendChild(box);
  }
  box.replaceChildren();
  for (const call of calls) {
    if (!call) continue;
    const div = document.createElement("div");
    div.className = "tool-call";
    const name = document.createElement("span");
    name.className = "tool-name";
    name.textContent = (call.function.name || "?") + "(";
    const args = document.createElement("code");
    args.className = "tool-arguments";
    args.textContent = call.function.arguments;
    div.append("tool call: ", name, args, ")");
    box.appendChild(div);
  }
}

// Reads a server-sent-events body and calls onEvent with each event's data (a string).
async function readEvents(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data && onEvent(data) === false) return;
    }
  }
}

function formatStats(stats) {
  const parts = [];
  if (stats.ttftMs !== null) parts.push("TTFT " + (stats.ttftMs / 1000).toFixed(2) + " s");
  parts.push(stats.tokens + " tokens");
  if (stats.tokensPerSecond !== null) parts.push(stats.tokensPerSecond.toFixed(1) + " tok/s");
  if (stats.finishReason) parts.push("finish: " + stats.finishReason);
  return parts.join(" · ");
}

async function send(text) {
  let body;
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  const content = out.querySelector(".content");
  try {
    body = requestBody();
  } catch (err) {
    history.pop();
    showError(out, err.message);
    return;
  }
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const t0 = performance.now();
  let tFirst = null;
  let tLast = null;
  let tokens = 0; // chunks with new output (usage, when sent, replaces it)
  let usageTokens = null;
  let finishReason = null;
  let failed = false;
  const calls = [];
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!resp.ok) {
      failed = true;
      showError(out, await readError(resp));
      return;
    }
    await readEvents(resp, (data) => {
      if (data === "[DONE]") return false;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        failed = true;
        showError(out, errorText(chunk, chunk.error.code));
        return true;
      }
      if (chunk.usage) usageTokens = chunk.usage.completion_tokens;
      const choice = (chunk.choices || [])[0];
      if (!choice) return true;
      const now = performance.now();
      if (tFirst === null) tFirst = now; // the first chunk comes with the first token
      const delta = choice.delta || {};
      if (delta.content) {
        content.textContent += delta.content;
      }
      if (delta.content || delta.tool_calls) {
        tokens += 1;
        tLast = now;
      }
      for (const tc of delta.tool_calls || []) {
        const call = (calls[tc.index] = calls[tc.index] || { id: "", type: "function", function: { name: "", arguments: "" } });
        if (tc.id) call.id = tc.id;
        if (tc.function && tc.function.name) call.function.name += tc.function.name;
        if (tc.function && tc.function.arguments) call.function.arguments += tc.function.arguments;
        renderToolCalls(out, calls);
      }
      if (choice.finish_reason) finishReason = choice.finish_reason;
      out.scrollIntoView({ block: "end" });
      return true;
    });
  } catch (err) {
    failed = true;
    showError(out, err.name === "AbortError" ? "stopped" : "request failed: " + err.message);
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    const n = usageTokens !== null ? usageTokens : tokens;
    const end = tLast !== null ? tLast : performance.now();
    const stats = {
      ttftMs: tFirst === null ? null : tFirst - t0,
      tokens: n,
      // generation speed after the first token (the first one's wait is the TTFT)
      tokensPerSecond: tFirst !== null && n > 1 && end > tFirst ? ((n - 1) * 1000) / (end - tFirst) : null,
      finishReason: finishReason,
    };
    const line = document.createElement("div");
    line.className = "stats";
    line.textContent = formatStats(stats);
    if (stats.ttftMs !== null) line.dataset.ttftMs = stats.ttftMs.toFixed(1);
    line.dataset.tokens = String(n);
    line.dataset.chunks = String(tokens);
    out.appendChild(line);
    if (failed) {
      history.pop(); // the failed turn is not part of the conversation
    } else {
      const msg = { role: "assistant", content: content.textContent || null };
      const made = calls.filter(Boolean);
      if (made.length) msg.tool_calls = made;
      history.push(msg);
    }
  }
}

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
    loadModels();
  });
  $("reload-models").addEventListener("click", loadModels);
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("clear").addEventListener("click", () => {
    history.length = 0;
    $("messages").replaceChildren();
  });
  loadModels();
}

init();
