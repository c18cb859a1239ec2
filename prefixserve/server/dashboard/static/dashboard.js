// The page's main loop: poll the snapshot every second (the tree every other poll), draw what changed.
// Rates come from successive snapshots: the server only reports counters, exactly as /metrics does.
(() => {
"use strict";

const POLL_MS = 1000;
const RETRY_MS = 5000;
const TREE_EVERY = 2; // polls: the tree is the costly part of a snapshot
const WINDOW_S = 10; // hit rate and TTFT quantiles over the last seconds
const { el, fmt } = Dash;
const mode = document.body.dataset.mode;
const history = []; // recent snapshots, oldest first (trees dropped)
let charts = null;
let pollCount = 0;
let timer = null;

function setNotice(...parts) {
  const box = document.getElementById("notice");
  box.replaceChildren(...parts);
  box.hidden = parts.length === 0;
}

function setStatus(text) {
  document.getElementById("status").textContent = text;
}

function schedule(ms) {
  clearTimeout(timer);
  timer = setTimeout(poll, ms);
}

async function poll() {
  const path = mode === "fleet" ? "/dashboard/api/fleet" : `/dashboard/api/snapshot?tree=${pollCount % TREE_EVERY === 0}`;
  try {
    const snapshot = await Dash.getJson(path);
    pollCount += 1;
    setNotice();
    if (mode === "fleet") Dash.renderFleet(snapshot, history);
    else render(snapshot);
    document.body.dataset.updates = String(Number(document.body.dataset.updates) + 1);
    setStatus("updated " + new Date().toLocaleTimeString());
    schedule(POLL_MS);
  } catch (error) {
    explain(error);
  }
}

// Why there is no data, and what to do about it.
function explain(error) {
  const code = (text) => el("code", {}, text);
  if (!(error instanceof Dash.ApiError)) {
    setStatus("cannot reach the server; retrying");
    schedule(RETRY_MS);
    return;
  }
  if (error.code === "admin_disabled") {
    const command = mode === "fleet" ? "prefixserve route … --admin-api-key KEY" : "prefixserve serve … --admin-api-key KEY";
    setNotice("The dashboard's data needs the operator's admin key, and this server has none. Start it with ",
      code(command), ", then enter that key above.");
    setStatus("dashboard data off");
    schedule(RETRY_MS);
  } else if (error.status === 401) {
    setNotice("Enter the admin key above (the value of ", code("--admin-api-key"), "); it is kept for this tab only.");
    setStatus("waiting for the admin key");
  } else if (error.status === 403) {
    setNotice("That key was refused: the dashboard needs the operator's admin key, not a tenant's API key.");
    setStatus("key refused");
  } else {
    setStatus(`error ${error.status}: ${error.message}; retrying`);
    schedule(RETRY_MS);
  }
}

// The snapshot at least WINDOW_S before `now` (or the oldest kept).
function windowStart(now) {
  let start = history[0];
  for (const past of history) if (now.time - past.time >= WINDOW_S) start = past;
  return start;
}

function delta(now, before, key) {
  return before ? (now.metrics[key] || 0) - (before.metrics[key] || 0) : null;
}

function render(snap) {
  const m = snap.metrics;
  const previous = history[history.length - 1];
  const { tree, ...kept } = snap;
  history.push(kept);
  while (history.length > 2 && snap.time - history[1].time > WINDOW_S + 2) history.shift();
  const start = windowStart(snap);
  const seconds = previous ? Math.max(snap.time - previous.time, 1e-3) : null;
  const perSecond = (key) => (previous ? delta(snap, previous, key) / seconds : null);
  const queries = delta(snap, start, "prefixserve:prefix_cache_queries_total");
  const hitRate = queries ? delta(snap, start, "prefixserve:prefix_cache_hits_total") / queries : null;
  const windowQuantile = (outcome, q) => {
    const before = start && start !== snap ? start.ttft[outcome].buckets : null;
    return Dash.histogramQuantile(q, Dash.histogramDelta(snap.ttft[outcome].buckets, before));
  };
  const values = {
    hitRate,
    saved: perSecond("prefixserve:prefill_tokens_saved_total"),
    usage: snap.pool.usage,
    pressure: snap.pool.pressure,
    evicted: perSecond("prefixserve:evicted_blocks_total"),
    expired: perSecond("prefixserve:expired_blocks_total"),
    hitP50: windowQuantile("hit", 0.5), hitP99: windowQuantile("hit", 0.99),
    missP50: windowQuantile("miss", 0.5), missP99: windowQuantile("miss", 0.99),
    waiting: m["prefixserve:num_requests_waiting"], running: m["prefixserve:num_requests_running"],
  };
  for (const chart of charts) chart.push(snap.time, values);
  text("card-hit-rate", hitRate === null ? `idle · all time ${fmt.pct(m["prefixserve:prefix_cache_token_hit_rate"])}`
                                         : fmt.pct(hitRate));
  text("card-saved", fmt.rate(values.saved));
  text("card-pool", `${fmt.pct(snap.pool.usage)} · ${fmt.pct(snap.pool.pressure)}`);
  text("card-evictions", fmt.rate(values.evicted === null ? null : values.evicted + values.expired));
  text("card-ttft-hit", `${fmt.seconds(snap.ttft.hit.p50)} / ${fmt.seconds(snap.ttft.hit.p99)}`);
  text("card-ttft-miss", `${fmt.seconds(snap.ttft.miss.p50)} / ${fmt.seconds(snap.ttft.miss.p99)}`);
  text("card-queue", `${fmt.int(values.waiting)} · ${fmt.int(values.running)}`);
  renderTenants(snap.tenants);
  renderTotals(m);
  if (tree) renderTree(tree);
}

function text(id, value) {
  document.getElementById(id).textContent = value;
}

function renderTenants(tenants) {
  const tbody = document.querySelector("#tenants tbody");
  const held = new Map([...tbody.querySelectorAll("tr")].map((tr) => [tr.dataset.tenant, tr.lastChild.textContent]));
  Dash.fillRows(tbody, tenants.map((t) => el("tr", { dataset: { tenant: t.tenant } },
    el("td", {}, t.tenant), el("td", {}, fmt.int(t.num_requests)), el("td", {}, fmt.int(t.prompt_tokens)),
    el("td", {}, fmt.int(t.cached_tokens)), el("td", {}, fmt.pct(t.hit_rate)),
    el("td", {}, shareText(t.kv_share)), el("td", {}, pinsText(t.pins)),
    // blocks held come with the tree (every other poll): keep the last count in between
    el("td", {}, t.blocks_held === null ? held.get(t.tenant) || "–" : fmt.int(t.blocks_held)))));
}

// A tenant's share of the pool: "held (min N, max M)"; of the pin cap: "pinned / limit".
function shareText(share) {
  if (!share) return "–";
  const bounds = [share.min ? `min ${fmt.int(share.min)}` : "", share.max === null ? "" : `max ${fmt.int(share.max)}`];
  const said = bounds.filter(Boolean).join(", ");
  return fmt.int(share.held) + (said ? ` (${said})` : "");
}

function pinsText(pins) {
  if (!pins) return "–";
  return pins.limit === null ? fmt.int(pins.pinned) : `${fmt.int(pins.pinned)} / ${fmt.int(pins.limit)}`;
}

function renderTotals(metrics) {
  const rows = Object.keys(metrics).sort().map((key) => el("tr", {},
    el("td", {}, key), el("td", { dataset: { metric: key } }, fmt.exact(metrics[key]))));
  Dash.fillRows(document.querySelector("#totals tbody"), rows);
}

function renderTree(tree) {
  Dash.drawTree(document.getElementById("tree"), tree, document.getElementById("tree-detail"));
  text("tree-summary", `${fmt.int(tree.num_blocks)} blocks cached as ${fmt.int(tree.num_segments)} chains; `
    + `${tree.nodes.length} nodes drawn (at most ${tree.max_nodes}), ${fmt.int(tree.num_folded_blocks)} blocks folded`);
  Dash.fillRows(document.querySelector("#tiers tbody"), tree.tiers.map((t) => el("tr", { dataset: { tier: t.tier } },
    el("td", {}, t.tier), el("td", {}, fmt.int(t.num_blocks)), el("td", {}, fmt.int(t.num_only_here)))));
  document.body.dataset.treeUpdates = String(Number(document.body.dataset.treeUpdates || 0) + 1);
}

function serverCharts() {
  const box = document.getElementById("charts");
  const C = Dash.Chart;
  return [
    new C(box, "chart-hit-rate", "token hit rate (10 s window)", [{ key: "hitRate", label: "hit rate", colour: "#1a7f37" }],
      { format: fmt.pct, max: 1 }),
    new C(box, "chart-saved", "prefill tokens saved / s", [{ key: "saved", label: "saved", colour: "#0969da" }]),
    new C(box, "chart-pool", "KV pool", [{ key: "usage", label: "in use", colour: "#0969da" },
      { key: "pressure", label: "pressure", colour: "#cf222e" }], { format: fmt.pct, max: 1 }),
    new C(box, "chart-evictions", "evictions / s (churn)", [{ key: "evicted", label: "evicted", colour: "#cf222e" },
      { key: "expired", label: "expired", colour: "#8250df" }]),
    new C(box, "chart-ttft", "TTFT (10 s window)", [{ key: "hitP50", label: "hit p50", colour: "#1a7f37" },
      { key: "hitP99", label: "hit p99", colour: "#4ac26b" }, { key: "missP50", label: "miss p50", colour: "#cf222e" },
      { key: "missP99", label: "miss p99", colour: "#ff8182" }], { format: fmt.seconds }),
    new C(box, "chart-queue", "queue depth", [{ key: "waiting", label: "waiting", colour: "#bf8700" },
      { key: "running", label: "running", colour: "#0969da" }], { format: fmt.int }),
  ];
}

function start() {
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("admin-key");
    Dash.setAdminKey(input.value.trim());
    input.value = "";
    poll();
    if (mode !== "fleet") Dash.startWhatIf();
  });
  if (mode === "fleet") {
    document.getElementById("server-view").hidden = true;
    document.getElementById("fleet-view").hidden = false;
    document.getElementById("mode-label").textContent = "fleet dashboard (router)";
    Dash.startFleet();
  } else {
    charts = serverCharts();
    Dash.treeLegend(document.getElementById("tree-legend"));
    if (Dash.adminKey()) Dash.startWhatIf(); // else once a key is entered
  }
  poll();
}

start();
})();
