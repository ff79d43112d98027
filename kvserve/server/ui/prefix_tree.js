// The prefix cache drawn as an icicle: one row per level of the radix tree's summary
// (kvserve/kv/prefix_view.py), each bar as wide as the cached tokens in it and below it. A prefix
// that many requests share is one wide bar at the top with its branches under it; its colour
// deepens with its hits. Beside it, the largest prefixes as a table.

const el = (tag, cls, text) => {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
};

export function heat(hits, maxHits) {
  // teal, from pale (never reused) to deep (the most reused prefix on screen)
  const t = maxHits > 0 ? Math.log1p(hits) / Math.log1p(maxHits) : 0;
  const light = 90 - 55 * t;
  return `hsl(173 ${45 + 35 * t}% ${light}%)`;
}

export function ago(seconds) {
  if (seconds < 1) return "now";
  if (seconds < 60) return `${Math.round(seconds)} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

function describe(seg) {
  const end = seg.start_token + seg.num_tokens;
  return (
    `tokens ${seg.start_token}–${end} of the prefix (${seg.num_tokens} here, ${seg.subtree_tokens} cached from here down)\n` +
    `${seg.hits} hits · ${seg.in_use} requests use it now · last used ${ago(seg.idle_s)}`
  );
}

function segmentNode(seg, parentTokens, maxHits) {
  const node = el("div", "ice-node");
  node.style.flexBasis = `${(100 * seg.subtree_tokens) / parentTokens}%`;
  const bar = el("div", "ice-bar");
  bar.style.background = heat(seg.hits, maxHits);
  if (seg.hits / Math.max(1, maxHits) > 0.6) bar.classList.add("dark");
  if (seg.in_use > 0) bar.classList.add("in-use");
  bar.title = describe(seg);
  bar.append(el("span", "ice-label", `${seg.num_tokens} tok · ${seg.hits} hits`));
  node.append(bar);
  if (seg.children.length || seg.hidden_branches) {
    const row = el("div", "ice-children");
    for (const child of seg.children) row.append(segmentNode(child, seg.subtree_tokens, maxHits));
    hiddenNode(row, seg.hidden_branches, seg.hidden_tokens, seg.subtree_tokens);
    node.append(row);
  }
  return node;
}

// the smaller branches left out of the summary, as one grey bar, so that the row still adds up
function hiddenNode(row, branches, tokens, parentTokens) {
  if (!branches) return;
  const node = el("div", "ice-node");
  node.style.flexBasis = `${(100 * tokens) / parentTokens}%`;
  const bar = el("div", "ice-bar ice-hidden");
  bar.title = `${branches} smaller branches (${tokens} cached tokens) not drawn`;
  bar.append(el("span", "ice-label", `+${branches}`));
  node.append(bar);
  row.append(node);
}

function* walk(segments) {
  for (const seg of segments) {
    yield seg;
    yield* walk(seg.children);
  }
}

export function renderPrefixTree(container, table, summary, tree) {
  if (!tree) {
    container.replaceChildren(el("p", "muted", "Prefix caching is off (--no-enable-prefix-caching)."));
    table.replaceChildren();
    summary.textContent = "";
    return;
  }
  const all = [...walk(tree.roots)];
  const total = tree.num_blocks * tree.block_size;
  const maxHits = Math.max(0, ...all.map((s) => s.hits));
  summary.textContent =
    `${tree.num_blocks} blocks (${total} tokens) in the tree` +
    (tree.hidden_branches ? ` · ${tree.hidden_branches} smaller prefixes not drawn` : "") +
    (tree.complete ? "" : " · partial: the tree is larger than one look covers");
  if (!all.length) {
    container.replaceChildren(el("p", "muted", "Nothing cached yet: prompts are cached block by block as they run."));
    table.replaceChildren();
    return;
  }
  const row = el("div", "ice-children ice-root");
  for (const seg of tree.roots) row.append(segmentNode(seg, total, maxHits));
  hiddenNode(row, tree.hidden_branches, tree.hidden_tokens, total);
  container.replaceChildren(row);

  // the largest prefixes: whole prefixes (root to the end of a segment), most cached tokens below first
  const top = all.sort((a, b) => b.subtree_tokens - a.subtree_tokens || b.hits - a.hits).slice(0, 8);
  const head = el("tr");
  for (const h of ["", "Prefix length", "Tokens in subtree", "Hits", "Used by", "Last used"]) {
    head.append(el("th", h ? "num" : "", h));
  }
  const rows = top.map((seg) => {
    const tr = el("tr");
    const swatch = el("span", "swatch");
    swatch.style.background = heat(seg.hits, maxHits);
    const first = el("td");
    first.append(swatch);
    tr.append(
      first,
      el("td", "num", `${seg.start_token + seg.num_tokens}`),
      el("td", "num", `${seg.subtree_tokens}`),
      el("td", "num", `${seg.hits}`),
      el("td", "num", `${seg.in_use}`),
      el("td", "num", ago(seg.idle_s)),
    );
    tr.title = describe(seg);
    return tr;
  });
  table.replaceChildren(el("thead"), el("tbody"));
  table.tHead.append(head);
  table.tBodies[0].append(...rows);
}
