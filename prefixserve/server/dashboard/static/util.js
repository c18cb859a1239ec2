// Shared helpers: the admin key, JSON fetches, DOM and SVG builders, number formats.
"use strict";

const Dash = (window.Dash = {});
const KEY_STORAGE = "prefixserve-admin-key";
const SVG_NS = "http://www.w3.org/2000/svg";

Dash.adminKey = () => sessionStorage.getItem(KEY_STORAGE) || "";
Dash.setAdminKey = (key) => {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
};

// An answer the server refused: its HTTP status and the OpenAI-style error code.
class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}
Dash.ApiError = ApiError;

// GET a JSON endpoint with the admin key; throws ApiError on a non-2xx answer.
Dash.getJson = async (path) => {
  const key = Dash.adminKey();
  const response = await fetch(path, {
    headers: key ? { Authorization: "Bearer " + key } : {},
    cache: "no-store",
  });
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    body = null;
  }
  if (!response.ok) {
    const error = (body && body.error) || {};
    throw new ApiError(response.status, error.code || null, error.message || response.statusText);
  }
  return body;
};

// el("td", {class: "x", dataset: {metric: "m"}}, "text", childNode)
Dash.el = (tag, attrs, ...children) => {
  const node = document.createElement(tag);
  setAttributes(node, attrs || {});
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
};

Dash.svg = (tag, attrs, text) => {
  const node = document.createElementNS(SVG_NS, tag);
  setAttributes(node, attrs || {});
  if (text !== undefined) node.textContent = text;
  return node;
};

function setAttributes(node, attrs) {
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
}

// Replace a table body's rows.
Dash.fillRows = (tbody, rows) => tbody.replaceChildren(...rows);

Dash.fmt = {
  int: (v) => (v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US")),
  pct: (v) => (v === null || v === undefined || !isFinite(v) ? "–" : (100 * v).toFixed(1) + "%"),
  rate: (v) => (v === null || v === undefined || !isFinite(v) ? "–" : v >= 100 ? v.toFixed(0) : v.toFixed(1)),
  seconds: (v) => {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    return v < 1 ? (1000 * v).toFixed(v < 0.01 ? 2 : 1) + " ms" : v.toFixed(2) + " s";
  },
  usd: (v) => (v === null || v === undefined ? "–" : "$" + (v < 0.01 ? v.toPrecision(3) : v.toFixed(4))),
  // a /metrics value exactly as JSON carried it (integers without separators), for comparing with /metrics
  exact: (v) => String(v),
};

// Prometheus' histogram_quantile over [[upper bound, cumulative count], ...] (+Inf last); null when empty.
Dash.histogramQuantile = (q, cumulative) => {
  if (!cumulative || !cumulative.length) return null;
  const total = cumulative[cumulative.length - 1][1];
  if (!total) return null;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const [bound, count] of cumulative) {
    const upper = bound === "+Inf" ? Infinity : bound; // JSON has no infinity
    if (count >= rank && count > below) {
      if (!isFinite(upper)) return lower;
      return lower + ((upper - lower) * (rank - below)) / (count - below);
    }
    lower = upper;
    below = count;
  }
  return lower;
};

// Bucket counts between two cumulative histograms of the same bounds (a window's own histogram).
Dash.histogramDelta = (now, before) => {
  if (!before || before.length !== now.length) return now;
  return now.map(([upper, count], i) => [upper, count - before[i][1]]);
};

// Recency 0 (old) .. 1 (just used) -> blue .. orange.
Dash.recencyColour = (recency) => {
  const r = Math.max(0, Math.min(1, recency));
  return `hsl(${Math.round(215 - 190 * r)}, 70%, ${Math.round(42 + 8 * r)}%)`;
};
