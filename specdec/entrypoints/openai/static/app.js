// specdec chat page: this server's /v1 API only; model output is inserted as text, never HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: "", history: [], busy: false };

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

function showError(message) {
  $("error").textContent = message || "";
}

async function errorMessage(res) {
  try {
    const body = await res.json();
    return body.error && body.error.message ? body.error.message : "HTTP " + res.status;
  } catch (e) {
    return "HTTP " + res.status;
  }
}

async function loadModel() {
  const res = await fetch("/v1/models", { headers: headers() });
  if (res.status === 401) {
    $("key_row").hidden = false;
    showError("This server needs an API key.");
    return;
  }
  if (!res.ok) return showError(await errorMessage(res));
  const body = await res.json();
  $("model").textContent = body.data && body.data[0] ? body.data[0].id : "";
  showError("");
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function requestBody(messages) {
  const body = {
    messages, stream: true, return_token_provenance: true,
    stream_options: { include_usage: true },
    temperature: number("temperature"), top_p: number("top_p"), max_tokens: number("max_tokens"),
  };
  const seed = number("seed");
  if (seed !== null) body.seed = seed;
  if (!$("spec_on").checked) body.num_speculative_tokens = 0;
  else if (number("spec_k") !== null) body.num_speculative_tokens = number("spec_k");
  return body;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  if (text) div.textContent = text;
  $("log").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// Live figures of one reply, from the tokens' provenance.
class Reply {
  constructor(div) {
    this.div = div; this.text = ""; this.tokens = 0; this.drafts = 0;
    this.start = performance.now(); this.first = null; this.shares = [];
  }
  add(content, provenance) {
    let at = 0;
    for (const [chars, fromDraft] of provenance) {
      const span = document.createElement("span");
      span.className = fromDraft ? "draft" : "target";
      span.textContent = content.slice(at, at + chars);
      at += chars;
      this.div.appendChild(span);
      this.tokens += 1;
      this.drafts += fromDraft ? 1 : 0;
      this.shares.push(this.drafts / this.tokens);
    }
    if (at < content.length) this.div.appendChild(document.createTextNode(content.slice(at)));
    this.text += content;
    if (this.first === null && this.tokens) this.first = performance.now();
    this.show();
  }
  show() {
    const secs = (performance.now() - this.start) / 1000;
    $("tps").textContent = secs > 0 ? (this.tokens / secs).toFixed(1) : "-";
    $("accepted").textContent = String(this.drafts);
    // NOTE: the acceptance rate (accepted / proposed drafts) and the mean acceptance length
    // (1 + accepted per verification step with drafts) need the drafts that were rejected and
    // the steps that carried drafts: the stream shows neither, so they wait for the server's
    // figures on the last chunk (finish); live, the share of tokens that came from drafts.
    $("rate").textContent = "-";
    $("mal").textContent = "-";
    $("share").textContent = this.tokens ? (100 * this.drafts / this.tokens).toFixed(0) + "%" : "-";
    drawChart(this.shares);
  }
  finish(chunk) {
    const t = chunk.timings || {};
    const spec = chunk.spec_decode || {};
    $("draft_n_accepted").textContent = String(t.draft_n_accepted || 0);
    if (t.predicted_per_second) $("tps").textContent = t.predicted_per_second.toFixed(1);
    if (t.draft_n) $("rate").textContent = (100 * t.draft_n_accepted / t.draft_n).toFixed(0) + "%";
    if (spec.mean_acceptance_length) $("mal").textContent = spec.mean_acceptance_length.toFixed(2);
  }
}

function drawChart(shares) {
  const canvas = $("chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = "#999";
  ctx.strokeRect(0.5, 0.5, w - 1, h - 1);
  if (shares.length < 2) return;
  ctx.strokeStyle = "#2a7d4f";
  ctx.lineWidth = 2;
  ctx.beginPath();
  shares.forEach((s, i) => {
    const x = (i / (shares.length - 1)) * (w - 4) + 2;
    const y = h - 2 - s * (h - 4);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

async function readStream(res, reply) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
      const chunk = JSON.parse(event.slice(6));
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        reply.add(choice.delta.content || "", choice.token_provenance || []);
      }
      if (chunk.timings) reply.finish(chunk);
    }
  }
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (state.busy || !prompt.trim()) return;
  state.key = $("api_key").value;
  state.busy = true;
  document.body.dataset.state = "streaming";
  $("send").disabled = true;
  showError("");
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(
    state.history, [{ role: "user", content: prompt }]);
  const asked = addMessage("user", prompt);
  const reply = new Reply(addMessage("assistant", ""));
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(messages)),
    });
    if (res.status === 401) $("key_row").hidden = false;
    if (!res.ok) throw new Error(await errorMessage(res));
    await readStream(res, reply);
    state.history.push({ role: "user", content: prompt }, { role: "assistant", content: reply.text });
    $("prompt").value = "";
  } catch (e) {
    if (!reply.tokens) asked.remove();
    reply.div.remove();
    showError(e.message);
  } finally {
    state.busy = false;
    $("send").disabled = false;
    document.body.dataset.state = "done";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("form").addEventListener("submit", send);
  $("api_key").addEventListener("change", () => { state.key = $("api_key").value; loadModel(); });
  loadModel().catch((e) => showError(e.message));
  drawChart([]);
});
