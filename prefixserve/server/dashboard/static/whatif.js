// What-if panels (price, tiers, TTL, capacity), drawn from /dashboard/api/{price,tiers,ttl,capacity}.
// Each endpoint computes from this server's own measurements and names its sources; the panels show them.
(() => {
"use strict";

const REFRESH_MS = 10000;
const { el, fmt } = Dash;
let priceTimer = null;
let sliderTouched = false;

let started = false;

// Start the panels (the first call), or refresh them now (a new admin key was entered).
Dash.startWhatIf = () => {
  if (started) {
    refreshAll();
    return;
  }
  started = true;
  const hit = document.getElementById("price-hit-rate");
  const tokens = document.getElementById("price-prompt-tokens");
  const onSlide = () => {
    sliderTouched = true;
    showSliderValues();
    clearTimeout(priceTimer);
    priceTimer = setTimeout(refreshPrice, 120);
  };
  hit.addEventListener("input", onSlide);
  tokens.addEventListener("input", onSlide);
  const sizes = document.getElementById("capacity-sizes");
  sizes.addEventListener("change", refreshCapacity);
  refreshAll();
  setInterval(refreshAll, REFRESH_MS);
};

function refreshAll() {
  refreshPrice();
  panel("tiers-body", "/dashboard/api/tiers", renderTiers);
  panel("ttl-body", "/dashboard/api/ttl", renderTtl);
  refreshCapacity();
}

function showSliderValues() {
  const hit = document.getElementById("price-hit-rate");
  const tokens = document.getElementById("price-prompt-tokens");
  document.getElementById("price-hit-rate-value").textContent = fmt.pct(Number(hit.value));
  document.getElementById("price-prompt-tokens-value").textContent = fmt.int(Number(tokens.value));
}

function refreshPrice() {
  const hit = document.getElementById("price-hit-rate");
  const tokens = document.getElementById("price-prompt-tokens");
  // Until someone moves a slider, the panel shows this server's measured hit rate and prompt length.
  const query = sliderTouched ? `?hit_rate=${hit.value}&prompt_tokens=${tokens.value}` : "";
  panel("price-body", "/dashboard/api/price" + query, (body) => {
    if (!sliderTouched) {
      hit.value = body.hit_rate;
      tokens.value = Math.min(Number(tokens.max), Math.max(Number(tokens.min), Math.round(body.prompt_tokens)));
      showSliderValues();
    }
    return renderPrice(body);
  });
}

function refreshCapacity() {
  const sizes = document.getElementById("capacity-sizes").value.replace(/\s+/g, "");
  panel("capacity-body", "/dashboard/api/capacity" + (sizes ? `?sizes=${encodeURIComponent(sizes)}` : ""), renderCapacity);
}

// Fetch one panel's JSON and draw it; a refusal or a missing endpoint says so in the panel.
// Only the latest request of a panel is drawn: an older answer arriving late is dropped.
const latest = new Map();
async function panel(id, path, render) {
  const body = document.getElementById(id);
  const ticket = (latest.get(id) || 0) + 1;
  latest.set(id, ticket);
  try {
    const data = await Dash.getJson(path);
    if (latest.get(id) !== ticket) return;
    body.replaceChildren(...[].concat(data.available === false
      ? el("p", { class: "unavailable" }, data.reason || "nothing measured yet")
      : render(data)));
    body.dataset.state = "ready";
  } catch (error) {
    if (latest.get(id) !== ticket) return;
    const text = error.status === 404 && error.code !== "admin_disabled"
      ? "This server has no what-if endpoint for this panel."
      : error.message;
    body.replaceChildren(el("p", { class: "unavailable" }, text));
    body.dataset.state = "error";
  }
}

function table(headers, rows) {
  return el("table", {}, el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, ...rows));
}

function sources(map) {
  if (!map) return null;
  return el("div", { class: "source" }, "Sources: " + Object.entries(map).map(([k, v]) => `${k}: ${v}`).join("; "));
}

function renderPrice(body) {
  const out = [];
  if (body.ttft) {
    out.push(el("p", { id: "price-ttft" }, `TTFT ≈ ${fmt.seconds(body.ttft.seconds)} at ${fmt.pct(body.hit_rate)} hits, `
      + `${fmt.seconds(body.ttft.miss_seconds)} with nothing cached (${fmt.int(body.prompt_tokens)}-token prompts)`));
  }
  const rows = body.vendors.map((v) => el("tr", { dataset: { vendor: v.vendor } },
    el("td", {}, v.vendor, el("div", { class: "source" }, v.model)),
    el("td", {}, v.fresh_usd_per_million), el("td", {}, v.cached_read_usd_per_million),
    el("td", {}, v.cache_write_usd_per_million === null ? "–" : v.cache_write_usd_per_million),
    el("td", { dataset: { field: "usd_per_request" } }, fmt.usd(v.usd_per_request)),
    el("td", { dataset: { field: "usd_per_million_input_tokens" } }, fmt.usd(v.usd_per_million_input_tokens)),
    el("td", { dataset: { field: "saving_fraction" } }, fmt.pct(v.saving_fraction)),
    el("td", { class: "source", dataset: { field: "source" } },
      el("a", { href: v.source, rel: "noreferrer" }, hostOf(v.source)), ` as of ${v.as_of}`)));
  out.push(table(["vendor", "fresh $/M", "cached $/M", "write $/M", "per request", "per M input", "saving",
                  "source, date"], rows));
  out.push(sources(body.sources));
  if (body.note) out.push(el("div", { class: "source" }, body.note));
  return out;
}

function hostOf(url) {
  try {
    return new URL(url).host;
  } catch (_) {
    return url;
  }
}

function renderTiers(body) {
  const rows = body.tiers.map((t) => el("tr", { dataset: { tier: t.tier } },
    el("td", {}, t.tier), el("td", {}, fmt.seconds(t.latency_seconds)),
    el("td", {}, `${(t.bytes_per_second / 2 ** 20).toFixed(0)} MiB/s`),
    el("td", {}, t.crossover_tokens === null ? "never" : fmt.int(t.crossover_tokens))));
  const series = [{ label: "recompute", colour: "#cf222e", ys: body.recompute_seconds }]
    .concat(body.tiers.map((t, i) => ({ label: `fetch from ${t.tier}`, colour: ["#0969da", "#1a7f37", "#8250df"][i % 3],
                                         ys: t.fetch_seconds })));
  return [xyChart(body.prefix_tokens, series, "prefix tokens", fmt.seconds),
          table(["tier", "latency", "bandwidth", "fetch pays off from (tokens)"], rows), sources(body.sources)];
}

function renderTtl(body) {
  const best = body.recommended ? body.recommended.ttl_seconds : null;
  const rows = body.rows.map((r) => el("tr", { class: r.ttl_seconds === best ? "recommended" : null },
    el("td", {}, `${r.ttl_seconds} s${r.ttl_seconds === best ? " ★" : ""}`), el("td", {}, fmt.pct(r.survival)),
    el("td", {}, fmt.seconds(r.extra_ttft_seconds_per_turn)), el("td", {}, fmt.usd(r.memory_usd_per_hour)),
    el("td", {}, fmt.usd(r.recompute_usd_per_hour))));
  return [el("p", {}, `${fmt.int(body.num_releases)} releases measured; ${fmt.pct(body.return_fraction)} came back. `
            + (best === null ? "" : `Recommended TTL: ${best} s.`)),
          table(["TTL", "next turn hits", "extra TTFT / turn", "memory $/h", "recompute $/h"], rows),
          sources(body.sources)];
}

function renderCapacity(body) {
  const rows = body.sizes.map((s) => el("tr", { dataset: { poolBlocks: s.pool_blocks } },
    el("td", {}, fmt.int(s.pool_blocks) + (s.pool_blocks === body.current_pool_blocks ? " (now)" : "")),
    el("td", {}, fmt.int(s.pool_tokens)), el("td", {}, fmt.pct(s.hit_rate)), el("td", {}, fmt.int(s.num_evicted_blocks)),
    el("td", {}, fmt.seconds(s.capacity_miss_seconds))));
  return [el("p", {}, `${fmt.int(body.num_requests)} recent requests replayed; working set `
            + `${fmt.int(body.working_set_blocks)} blocks.`),
          table(["pool blocks", "tokens", "hit rate", "evicted blocks", "prefill lost to evictions"], rows),
          sources(body.sources)];
}

// A static x/y line chart in SVG: series [{label, colour, ys}] over shared xs.
function xyChart(xs, series, xLabel, format) {
  const w = 400, h = 140, left = 46, bottom = 18;
  const top = Math.max(...series.flatMap((s) => s.ys).filter(isFinite), 1e-9);
  const xMax = Math.max(...xs, 1);
  const x = (v) => left + (v / xMax) * (w - left - 6);
  const y = (v) => h - bottom - (Math.min(v, top) / top) * (h - bottom - 6);
  const svg = Dash.svg("svg", { viewBox: `0 0 ${w} ${h}`, width: "100%", height: h });
  svg.append(Dash.svg("text", { class: "tick", x: 0, y: 12 }, format(top)),
             Dash.svg("text", { class: "tick", x: left, y: h - 3 }, `0 … ${fmt.int(xMax)} ${xLabel}`));
  for (const s of series) {
    svg.append(Dash.svg("polyline", { fill: "none", stroke: s.colour, "stroke-width": 1.6,
                                      points: xs.map((v, i) => `${x(v).toFixed(1)},${y(s.ys[i]).toFixed(1)}`).join(" ") }));
  }
  const legend = el("div", { class: "legend-row" }, ...series.map((s) =>
    el("span", {}, el("span", { class: "swatch", style: `background:${s.colour}` }), s.label)));
  return el("div", {}, svg, legend);
}
})();
