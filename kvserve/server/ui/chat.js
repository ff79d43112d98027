// The chat view: a conversation with the served model through POST /v1/chat/completions, streamed
// token by token. Stop aborts the fetch; the server sees the connection close and aborts the
// request in the engine (its KV blocks are freed at once). Each answer shows its token counts,
// the time to its first token and its decode speed, measured here in the browser.

import { api, AuthError, sseData } from "./api.js";

const $ = (id) => document.getElementById(id);

export class Chat {
  constructor({ onAuthError }) {
    this.model = null;
    this.history = []; // {role, content} of the finished turns
    this.controller = null; // the AbortController of the answer streaming now
    this.onAuthError = onAuthError;
    this.messages = $("messages");
    this.prompt = $("prompt");
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    this.prompt.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("new-chat").addEventListener("click", () => this.reset());
    const temperature = $("temperature");
    temperature.addEventListener("input", () => ($("temperature-value").textContent = Number(temperature.value).toFixed(2)));
    $("use-schema").addEventListener("change", () => this.checkSchema());
    $("schema").addEventListener("input", () => this.checkSchema());
    this.checkSchema();
  }

  get busy() {
    return this.controller !== null;
  }

  reset() {
    this.stop();
    this.history = [];
    this.messages.replaceChildren(emptyHint());
    this.prompt.focus();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  // The response_format to send (null: free text); throws with a message if the schema is not JSON.
  responseFormat() {
    if (!$("use-schema").checked) return null;
    const text = $("schema").value.trim();
    if (!text) throw new Error("write a JSON schema, or turn structured output off");
    let schema;
    try {
      schema = JSON.parse(text);
    } catch (e) {
      throw new Error(`the schema is not valid JSON: ${e.message}`);
    }
    return { type: "json_schema", json_schema: { name: "answer", schema, strict: true } };
  }

  checkSchema() {
    const on = $("use-schema").checked;
    $("schema").disabled = !on;
    let problem = "";
    try {
      this.responseFormat();
    } catch (e) {
      problem = on ? e.message : "";
    }
    $("schema-error").textContent = problem;
  }

  async send() {
    const text = this.prompt.value.trim();
    if (!text || this.busy || !this.model) return;
    let responseFormat;
    try {
      responseFormat = this.responseFormat();
    } catch (e) {
      $("schema-error").textContent = e.message;
      return;
    }
    this.messages.querySelector(".empty")?.remove();
    this.prompt.value = "";
    this.history.push({ role: "user", content: text });
    this.messages.append(messageNode("user", text));
    const answer = new Answer(this.messages);
    const system = $("system").value.trim();
    const body = {
      model: this.model,
      messages: [...(system ? [{ role: "system", content: system }] : []), ...this.history],
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number($("temperature").value),
      max_tokens: Number($("max-tokens").value) || 256,
    };
    if (responseFormat) body.response_format = responseFormat;

    this.controller = new AbortController();
    this.setBusy(true);
    try {
      const res = await api("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: this.controller.signal,
      });
      for await (const data of sseData(res)) {
        if (data === "[DONE]") break;
        answer.event(JSON.parse(data));
      }
      answer.finish({ structured: Boolean(responseFormat) });
    } catch (e) {
      if (e.name === "AbortError") answer.finish({ stopped: true });
      else {
        answer.fail(e.message);
        if (e instanceof AuthError) this.onAuthError();
      }
    } finally {
      this.controller = null;
      this.setBusy(false);
    }
    if (answer.text) this.history.push({ role: "assistant", content: answer.text });
    else this.history.pop(); // nothing came back: the question is not part of the conversation
  }

  setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    document.body.classList.toggle("streaming", busy);
    if (!busy) this.prompt.focus();
  }
}

function emptyHint() {
  const div = document.createElement("div");
  div.className = "empty";
  div.textContent = "Ask the model something. Answers stream token by token; the Engine tab shows what the server does meanwhile.";
  return div;
}

function messageNode(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = role === "user" ? "You" : "Assistant";
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  div.append(who, body);
  return div;
}

// One streaming answer: its text, and its numbers once it ends.
class Answer {
  constructor(container) {
    this.node = messageNode("assistant", "");
    this.node.dataset.testid = "answer";
    this.node.classList.add("live");
    this.textNode = this.node.querySelector(".text");
    this.meta = document.createElement("div");
    this.meta.className = "meta";
    this.meta.dataset.testid = "answer-meta";
    this.meta.textContent = "waiting for the first token…";
    this.node.append(this.meta);
    container.append(this.node);
    this.container = container;
    this.text = "";
    this.chunks = 0;
    this.start = performance.now();
    this.first = null;
    this.last = null;
    this.usage = null;
    this.finishReason = null;
    this.scroll();
  }

  event(chunk) {
    if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
    if (chunk.usage) this.usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (!choice) return;
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
    const piece = choice.delta?.content;
    if (!piece) return;
    const now = performance.now();
    this.first ??= now;
    this.last = now;
    this.chunks += 1;
    this.text += piece;
    this.textNode.textContent = this.text;
    this.meta.textContent = `streaming · ${this.chunks} chunks · TTFT ${ms(this.first - this.start)}`;
    this.scroll();
  }

  finish({ stopped = false, structured = false } = {}) {
    this.node.classList.remove("live");
    if (structured && !stopped) {
      try {
        this.textNode.textContent = JSON.stringify(JSON.parse(this.text), null, 2);
        this.textNode.classList.add("json");
      } catch {
        /* not complete JSON (max tokens reached): shown as it came */
      }
    }
    const parts = [];
    const u = this.usage;
    if (u) {
      const cached = u.prompt_tokens_details?.cached_tokens;
      parts.push(`${u.prompt_tokens} prompt tokens${cached ? ` (${cached} cached)` : ""}`);
      parts.push(`${u.completion_tokens} answer tokens`);
    } else if (this.chunks) {
      parts.push(`${this.chunks} chunks`);
    }
    if (this.first !== null) parts.push(`TTFT ${ms(this.first - this.start)}`);
    const tokens = u ? u.completion_tokens : this.chunks;
    if (this.first !== null && tokens > 1 && this.last > this.first) {
      parts.push(`${((tokens - 1) / ((this.last - this.first) / 1000)).toFixed(1)} tok/s`);
    }
    if (stopped) parts.push("stopped");
    else if (this.finishReason) parts.push(this.finishReason === "length" ? "max tokens reached" : this.finishReason);
    this.meta.textContent = parts.join(" · ");
    if (stopped) this.node.classList.add("stopped");
    this.scroll();
  }

  fail(message) {
    this.node.classList.remove("live");
    this.node.classList.add("error");
    this.meta.textContent = `error: ${message}`;
    this.scroll();
  }

  scroll() {
    this.container.scrollTop = this.container.scrollHeight;
  }
}

function ms(t) {
  return t >= 1000 ? `${(t / 1000).toFixed(2)} s` : `${Math.round(t)} ms`;
}
