// The engine view: what the server is doing, redrawn from each frame of GET /ui/events
// (kvserve/server/engine_view.py: two frames a second). It listens only while the view is shown.

import { api, AuthError, sseData } from "./api.js";
import { ago, renderPrefixTree } from "./prefix_tree.js";

const $ = (id) => document.getElementById(id);
const HISTORY = 120; // frames kept for the throughput chart (a minute at two a second)

const el = (tag, cls, text) => {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
};

const pct = (x) => `${(100 * x).toFixed(x > 0 && x < 0.1 ? 1 : 0)}%`;
const rate = (x) => (x >= 100 ? x.toFixed(0) : x.toFixed(1));

export class EngineView {
  constructor({ onAuthError }) {
    this.onAuthError = onAuthError;
    this.controller = null;
    this.history = [];
    this.frames = 0;
  }

  start() {
    if (this.controller) return;
    this.controller = new AbortController();
    this.listen(this.controller.signal);
  }

  stop() {
    this.controller?.abort();
    this.controller = null;
  }

  async listen(signal) {
    let delay = 500;
    while (!signal.aborted) {
      try {
        const res = await api("/ui/events?interval=0.5", { signal });
        this.setStatus(true);
        delay = 500;
        for await (const data of sseData(res)) this.render(JSON.parse(data));
      } catch (e) {
        if (signal.aborted) return;
        if (e instanceof AuthError) {
          this.stop();
          this.onAuthError();
          return;
        }
      }
      this.setStatus(false);
      await new Promise((r) => setTimeout(r, delay)); // the server restarted or went away: try again
      delay = Math.min(delay * 2, 5000);
    }
  }

  setStatus(connected) {
    $("engine-status").textContent = connected ? "live" : "reconnecting…";
    $("engine-status").classList.toggle("off", !connected);
  }

  render(frame) {
    this.frames += 1;
    document.body.dataset.engineFrames = String(this.frames); // for tests: frames drawn so far
    const s = frame.state;
    if (!frame.alive) $("engine-status").textContent = "engine stopped";
    this.history.push({ gen: frame.generation_tokens_per_s, prompt: frame.prompt_tokens_per_s,
                        kv: s ? s.blocks.used / s.blocks.total : 0 });
    if (this.history.length > HISTORY) this.history.shift();

    $("tile-running").textContent = s ? s.num_running : "–";
    $("tile-waiting").textContent = s ? s.num_waiting : "–";
    $("tile-gen").textContent = rate(frame.generation_tokens_per_s);
    $("tile-prompt").textContent = rate(frame.prompt_tokens_per_s);
    const p = frame.prefix;
    $("tile-hit").textContent = p.queried_tokens ? pct(p.hit_tokens / p.queried_tokens) : "–";
    $("tile-hit-sub").textContent = `${p.hit_tokens} of ${p.queried_tokens} prompt tokens`;
    $("tile-preempt").textContent = frame.preemptions;
    const sp = frame.spec;
    $("tile-spec").textContent = !sp.method ? "off" : sp.draft_tokens ? pct(sp.accepted_tokens / sp.draft_tokens) : "–";
    $("tile-spec-sub").textContent = !sp.method
      ? "--speculative-method"
      : `${sp.method} · ${sp.accepted_tokens}/${sp.draft_tokens} drafts` +
        (sp.verifies ? ` · ${(1 + sp.accepted_tokens / sp.verifies).toFixed(2)} tok/step` : "");
    $("totals").textContent =
      `${frame.prompt_tokens} prompt and ${frame.generation_tokens} generated tokens since start` +
      (frame.resident_memory_bytes ? ` · engine RSS ${(frame.resident_memory_bytes / 2 ** 30).toFixed(2)} GiB` : "");

    if (s) {
      this.renderKV(s);
      this.renderRequests(s);
      renderPrefixTree($("prefix-tree"), $("prefix-table"), $("prefix-summary"), s.prefix_tree);
      const cost = s.capture_ms < 1 ? `${Math.round(s.capture_ms * 1000)} µs` : `${s.capture_ms.toFixed(1)} ms`;
      $("capture").textContent = `state built in ${cost} between two engine steps (the tree summary is redone once a second)`;
    }
    this.renderTiers(frame.prefix);
    this.renderChart();
  }

  renderKV(s) {
    const b = s.blocks;
    for (const part of ["used", "cached", "free"]) {
      $(`kv-${part}`).style.flexBasis = `${(100 * b[part]) / b.total}%`;
      $(`kv-${part}-n`).textContent = b[part];
    }
    $("kv-usage").textContent =
      `${b.used} of ${b.total} blocks used (${pct(b.used / b.total)}) · ${b.cached} cached · ${b.free} free · ` +
      `${s.block_size} tokens per block`;
  }

  renderTiers(p) {
    const rows = Object.entries(p.by_tier).map(([tier, hits]) => {
      const row = el("div", "tier");
      const bar = el("div", "meter");
      const fill = el("div", "fill");
      fill.style.width = p.queried_tokens ? `${(100 * hits) / p.queried_tokens}%` : "0";
      bar.append(fill);
      row.append(el("span", "tier-name", tier), bar,
                 el("span", "num", p.queried_tokens ? pct(hits / p.queried_tokens) : "–"));
      row.title = `${hits} prompt tokens found in the ${tier} tier`;
      return row;
    });
    if (rows.length === 1) {
      rows.push(el("p", "muted small", "No offload tiers: evicted blocks are dropped. --kv-offload-memory-gb, " +
                   "--kv-offload-dir and --kv-offload-url add host, disk and Redis tiers behind the device cache."));
    }
    $("tiers").replaceChildren(...rows);
  }

  renderRequests(s) {
    const rows = [];
    const add = (r, waiting) => {
      const tr = el("tr");
      const prefill = r.num_computed_tokens < r.num_prompt_tokens;
      const phase = waiting ? (r.num_preemptions ? `preempted ×${r.num_preemptions}` : "waiting")
        : prefill ? `prefill ${pct(r.num_computed_tokens / r.num_prompt_tokens)}` : "decode";
      tr.append(el("td", "mono", r.request_id.slice(0, 8)), el("td", `phase ${waiting ? "waiting" : prefill ? "prefill" : "decode"}`, phase));
      const strip = el("td");
      strip.append(tokenStrip(r));
      tr.append(strip,
        el("td", "num", `${r.num_prompt_tokens}${r.num_cached_tokens ? ` (${r.num_cached_tokens} cached)` : ""}`),
        el("td", "num", `${r.num_output_tokens} / ${r.max_output_tokens}`),
        el("td", "num", ago(r.age_s).replace(" ago", "")));
      rows.push(tr);
    };
    s.running.forEach((r) => add(r, false));
    s.waiting.forEach((r) => add(r, true));
    const shown = s.running.length + s.waiting.length;
    const more = s.num_running + s.num_waiting - shown;
    if (!rows.length) {
      const tr = el("tr");
      const td = el("td", "muted", "No requests in the engine.");
      td.colSpan = 6;
      tr.append(td);
      rows.push(tr);
    } else if (more > 0) {
      const tr = el("tr");
      const td = el("td", "muted", `… and ${more} more`);
      td.colSpan = 6;
      tr.append(td);
      rows.push(tr);
    }
    $("requests").replaceChildren(...rows);
    $("requests-summary").textContent = `${s.num_running} running · ${s.num_waiting} waiting`;
  }

  renderChart() {
    const svg = $("chart");
    const w = 600, h = 120;
    const max = Math.max(1, ...this.history.map((x) => Math.max(x.gen, x.prompt)));
    const n = Math.max(2, this.history.length); // the frames so far fill the width, up to a minute of them
    const line = (key, scale) =>
      this.history.map((x, i) => `${(i / (n - 1)) * w},${h - 4 - (x[key] / scale) * (h - 8)}`).join(" ");
    $("chart-gen").setAttribute("points", line("gen", max));
    $("chart-prompt").setAttribute("points", line("prompt", max));
    $("chart-kv").setAttribute("points", line("kv", 1));
    $("chart-max").textContent = `last ${Math.round(this.history.length / 2)} s · top ${rate(max)} tok/s`;
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  }
}

// A request as a strip of its tokens: prompt (cached, computed, still to compute), then the answer
// so far, then what max_tokens still allows.
function tokenStrip(r) {
  const total = r.num_prompt_tokens + r.max_output_tokens;
  const computedPrompt = Math.min(r.num_computed_tokens, r.num_prompt_tokens);
  const parts = [
    ["cached", r.num_cached_tokens],
    ["computed", Math.max(0, computedPrompt - r.num_cached_tokens)],
    ["pending", r.num_prompt_tokens - computedPrompt],
    ["output", r.num_output_tokens],
  ];
  const strip = el("div", "strip");
  for (const [cls, n] of parts) {
    if (n <= 0) continue;
    const seg = el("div", `strip-${cls}`);
    seg.style.flexBasis = `${(100 * n) / total}%`;
    strip.append(seg);
  }
  strip.title = `prompt ${r.num_prompt_tokens} (${r.num_cached_tokens} cached, ${computedPrompt} computed) · ` +
    `answer ${r.num_output_tokens} of at most ${r.max_output_tokens}`;
  return strip;
}
