// The radix tree of resident prefixes as an icicle in plain SVG.
//
//   x: token position (a bar starts where its parent ends; its length is its own tokens)
//   y: each node's band is split among its children by the blocks below them, on a log scale
//      (log2(1 + blocks)), so a fold of 20,000 blocks does not squeeze its 39-block siblings to nothing
//
//   scope │ [shared prompt, 512 tok ]┬[tail 64]
//         │                          ├[tail 48]
//         │                          └[12 more]
//
// The server already merged single-child chains and folded small subtrees (cache/tree_view.py),
// so there are at most a few hundred nodes: redrawing them all every two seconds stays cheap.
(() => {
"use strict";

const WIDTH = 1200;
const HEIGHT = 560;
const SCOPE_WIDTH = 110; // the scope column (tenant or shared), before token 0
const MORE_WIDTH = 64; // a folded "N more" node has no single length: a fixed stub
const MIN_LABEL_WIDTH = 46;
const MIN_LABEL_HEIGHT = 13;

let selectedId = null;

Dash.drawTree = (svg, tree, detail) => {
  svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const nodes = new Map(tree.nodes.map((n) => [n.id, { ...n, children: [] }]));
  let root = null;
  for (const node of nodes.values()) {
    if (node.parent === null) root = node;
    else if (nodes.has(node.parent)) nodes.get(node.parent).children.push(node);
  }
  if (!root || !root.subtree_blocks) {
    svg.replaceChildren(Dash.svg("text", { x: 12, y: 24, class: "dark" }, "No cached prefixes yet."));
    return;
  }
  // Token offsets: a node starts where its parent ends.
  let maxTokens = 1;
  const place = (node, start) => {
    node.start = start;
    const end = node.kind === "prefix" ? start + node.num_tokens : start;
    maxTokens = Math.max(maxTokens, end);
    for (const child of node.children) place(child, end);
  };
  place(root, 0);
  const scale = (WIDTH - SCOPE_WIDTH - MORE_WIDTH - 4) / maxTokens;
  const shapes = [];
  const band = (node, y0, y1) => {
    if (node.kind !== "root") shapes.push(shape(node, y0, y1, scale));
    const children = [...node.children].sort((a, b) => b.subtree_blocks - a.subtree_blocks);
    const weight = (child) => Math.log2(1 + child.subtree_blocks);
    const total = children.reduce((sum, c) => sum + weight(c), 0) || 1;
    let y = y0;
    for (const child of children) {
      const height = ((y1 - y0) * weight(child)) / total;
      band(child, y, y + height);
      y += height;
    }
  };
  band(root, 0, HEIGHT);
  svg.replaceChildren(...shapes.flat());
  const show = (node, rect) => {
    for (const other of svg.querySelectorAll("rect.selected")) other.classList.remove("selected");
    rect.classList.add("selected");
    selectedId = node.id;
    detail.textContent = describe(node);
  };
  svg.onmouseover = svg.onclick = (event) => {
    const rect = event.target.closest("rect");
    if (rect && nodes.has(rect.dataset.id)) show(nodes.get(rect.dataset.id), rect);
  };
  const again = selectedId && svg.querySelector(`rect[data-id="${selectedId}"]`);
  if (again) show(nodes.get(selectedId), again);
};

function shape(node, y0, y1, scale) {
  let x;
  let width;
  if (node.kind === "scope") {
    x = 0;
    width = SCOPE_WIDTH - 2;
  } else {
    x = SCOPE_WIDTH + node.start * scale;
    width = node.kind === "more" ? MORE_WIDTH : Math.max(2, node.num_tokens * scale);
  }
  const classes = [node.kind];
  if (y1 - y0 < 3) classes.push("thin"); // no white outline: it would hide the colour
  if (node.pinned) classes.push("pinned");
  if (node.ref_count > 0) classes.push("hot");
  if (node.expiring) classes.push("expiring");
  const rect = Dash.svg("rect", {
    x: x.toFixed(1), y: y0.toFixed(2), width: width.toFixed(1), height: Math.max(0.5, y1 - y0).toFixed(2),
    class: classes.join(" "),
    fill: node.kind === "prefix" ? Dash.recencyColour(node.recency) : null,
    dataset: { id: node.id, kind: node.kind, key: node.label, tokens: node.num_tokens, blocks: node.num_blocks,
               subtreeBlocks: node.subtree_blocks },
  });
  rect.append(Dash.svg("title", {}, describe(node)));
  const out = [rect];
  if (width >= MIN_LABEL_WIDTH && y1 - y0 >= MIN_LABEL_HEIGHT) {
    out.push(Dash.svg("text", { x: (x + 4).toFixed(1), y: ((y0 + y1) / 2 + 4).toFixed(1) }, label(node, width)));
  }
  return out;
}

function label(node, width) {
  if (node.kind === "scope") return node.label.slice(0, 16);
  if (node.kind === "more") return node.label;
  const tokens = `${node.num_tokens} tok`;
  return width > 150 ? `${tokens} · ${node.label}` : tokens;
}

function describe(node) {
  if (node.kind === "scope") {
    return `scope ${node.label}: ${node.subtree_blocks} blocks cached`;
  }
  const parts = node.kind === "more"
    ? [`${node.num_folded} smaller subtrees folded: ${node.num_blocks} blocks (${node.num_tokens} tokens)`]
    : [`key ${node.label}…`, `${node.num_blocks} blocks (${node.num_tokens} tokens)`,
       `${node.subtree_blocks} blocks in its subtree`];
  parts.push(node.ticks_since_use === 0 ? "just used" : `used ${node.ticks_since_use} LRU ticks ago`);
  if (node.ref_count > 0) parts.push(`in use by ${node.ref_count} running request(s)`);
  if (node.pinned) parts.push("pinned");
  if (node.expiring) {
    parts.push(node.expires_in === null ? "has a TTL" : `expires in ${Math.max(0, node.expires_in).toFixed(0)} s`);
  }
  parts.push(`tier ${node.tier}` + (node.copies && node.copies.length ? `, copies in ${node.copies.join(", ")}` : ""));
  return parts.join(" · ");
}

Dash.treeLegend = (container) => {
  const swatch = (style) => Dash.el("span", { class: "swatch", style });
  container.replaceChildren(
    Dash.el("span", {}, swatch(`background:${Dash.recencyColour(0)}`), "least recently used"),
    Dash.el("span", {}, swatch(`background:${Dash.recencyColour(0.5)}`), "…"),
    Dash.el("span", {}, swatch(`background:${Dash.recencyColour(1)}`), "just used"),
    Dash.el("span", {}, swatch("border:2px solid #e3b100"), "hot: in use by running requests"),
    Dash.el("span", {}, swatch("border:2px solid #111"), "pinned"),
    Dash.el("span", {}, swatch("border:2px dashed #6e40c9"), "expiring (TTL)"),
    Dash.el("span", {}, swatch("background:#aab4be"), "folded subtrees"),
  );
};
})();
