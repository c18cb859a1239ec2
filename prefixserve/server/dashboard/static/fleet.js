// Fleet mode (the router's /dashboard): one row per replica and the fleet's totals.
(() => {
"use strict";

const { el, fmt } = Dash;
let charts = null;

Dash.startFleet = () => {
  const box = document.getElementById("fleet-charts");
  charts = [
    new Dash.Chart(box, "chart-fleet-hit-rate", "fleet token hit rate (since each replica started)",
      [{ key: "hitRate", label: "hit rate", colour: "#1a7f37" }], { format: fmt.pct, max: 1 }),
    new Dash.Chart(box, "chart-fleet-load", "in flight", [{ key: "inFlight", label: "requests", colour: "#0969da" }],
      { format: fmt.int }),
    new Dash.Chart(box, "chart-fleet-routed", "routed / s", [{ key: "routed", label: "routed", colour: "#bf8700" }]),
  ];
};

Dash.renderFleet = (fleet, history) => {
  const previous = history[history.length - 1];
  history.push(fleet);
  if (history.length > 5) history.shift();
  const totals = fleet.totals;
  const seconds = previous ? Math.max(fleet.time - previous.time, 1e-3) : null;
  for (const chart of charts) {
    chart.push(fleet.time, {
      hitRate: totals.hit_rate, inFlight: totals.in_flight,
      routed: previous ? (totals.num_routed - previous.totals.num_routed) / seconds : null,
    });
  }
  const versions = Object.keys(fleet.model_versions || {}).length;
  document.getElementById("fleet-healthy").textContent = `${totals.num_healthy} / ${totals.num_replicas}` +
    (fleet.mixed_versions ? ` (mixed: ${versions} model versions)` : "");
  document.getElementById("fleet-hit-rate").textContent = fmt.pct(totals.hit_rate);
  document.getElementById("fleet-in-flight").textContent = fmt.int(totals.in_flight);
  document.getElementById("fleet-routed").textContent = fmt.int(totals.num_routed);
  document.getElementById("fleet-policy").textContent = `routing policy ${fleet.policy}`;
  const cells = (r) => [
    el("td", { dataset: { field: "health" }, class: r.healthy ? "healthy" : "down",
               title: r.last_down_reason || "" }, r.healthy ? "healthy" : "down"),
    el("td", { dataset: { field: "in_flight" } }, fmt.int(r.in_flight)),
    el("td", { dataset: { field: "load_seconds" } }, r.load_seconds.toFixed(2)),
    el("td", { dataset: { field: "hit_rate" } }, fmt.pct(r.hit_rate)),
    el("td", { dataset: { field: "num_routed" } }, fmt.int(r.num_routed)),
    el("td", { dataset: { field: "routed_share" } }, fmt.pct(r.routed_share)),
  ];
  Dash.fillRows(document.querySelector("#replicas tbody"), fleet.replicas.map((r) =>
    el("tr", { dataset: { replica: r.name } }, el("td", {}, r.name, el("div", { class: "source" }, r.url)), ...cells(r))));
  const total = { ...totals, healthy: totals.num_healthy === totals.num_replicas, routed_share: 1 };
  const footer = el("tr", { dataset: { replica: "(fleet)" } }, el("th", {}, "fleet"), ...cells(total));
  footer.children[1].textContent = `${totals.num_healthy} / ${totals.num_replicas} healthy`;
  document.querySelector("#replicas tfoot").replaceChildren(footer);
};
})();
