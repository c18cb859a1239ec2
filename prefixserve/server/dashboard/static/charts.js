// Small time-series line charts in plain SVG: the last two minutes of a few series.
(() => {
"use strict";

const CHART_POINTS = 120; // one a second: two minutes
const W = 360;
const H = 120;
const PAD = { left: 44, right: 6, top: 8, bottom: 16 };

Dash.Chart = class {
  // series: [{key, label, colour}]; options: {format(v) -> text, max: a fixed top (e.g. 1 for fractions)}
  constructor(container, id, title, series, options) {
    this.series = series;
    this.format = (options && options.format) || Dash.fmt.rate;
    this.fixedMax = options && options.max;
    this.points = []; // [{t, values: {key: number|null}}]
    this.svg = Dash.svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
    this.legend = Dash.el("div", { class: "legend-row" });
    this.node = Dash.el("div", { class: "chart", id }, Dash.el("h3", {}, title), this.svg, this.legend);
    container.append(this.node);
  }

  push(time, values) {
    this.points.push({ t: time, values });
    if (this.points.length > CHART_POINTS) this.points.shift();
    this.draw();
  }

  draw() {
    const points = this.points;
    const values = points.flatMap((p) => this.series.map((s) => p.values[s.key])).filter((v) => isFinite(v) && v !== null);
    const top = this.fixedMax || niceCeiling(Math.max(0, ...values));
    const t0 = points.length ? points[0].t : 0;
    const t1 = points.length ? points[points.length - 1].t : 1;
    const span = Math.max(t1 - t0, 1);
    const x = (t) => PAD.left + ((t - t0) / span) * (W - PAD.left - PAD.right);
    const y = (v) => H - PAD.bottom - (v / top) * (H - PAD.top - PAD.bottom);
    const nodes = [
      Dash.svg("line", { class: "axis", x1: PAD.left, x2: W - PAD.right, y1: y(0), y2: y(0) }),
      Dash.svg("line", { class: "axis", x1: PAD.left, x2: W - PAD.right, y1: y(top), y2: y(top) }),
      Dash.svg("text", { class: "tick", x: 2, y: y(top) + 4 }, this.format(top)),
      Dash.svg("text", { class: "tick", x: 2, y: y(0) + 3 }, this.format(0)),
      Dash.svg("text", { class: "tick", x: PAD.left, y: H - 2 }, points.length ? `−${Math.round(span)} s` : ""),
    ];
    for (const s of this.series) {
      // a null value (nothing measured then) breaks the line
      let run = [];
      const flush = () => {
        if (run.length) nodes.push(Dash.svg("polyline", { points: run.join(" "), stroke: s.colour }));
        run = [];
      };
      for (const p of points) {
        const v = p.values[s.key];
        if (v === null || v === undefined || !isFinite(v)) flush();
        else run.push(`${x(p.t).toFixed(1)},${y(Math.min(v, top)).toFixed(1)}`);
      }
      flush();
    }
    this.svg.replaceChildren(...nodes);
    const last = points.length ? points[points.length - 1].values : {};
    this.legend.replaceChildren(
      ...this.series.map((s) =>
        Dash.el("span", { dataset: { series: s.key } },
          Dash.el("span", { class: "swatch", style: `background:${s.colour}` }),
          `${s.label} ${this.format(last[s.key] === undefined ? null : last[s.key])}`)
      )
    );
  }
};

// 1, 2 or 5 times a power of ten, at or above v (and above 0).
function niceCeiling(v) {
  if (!(v > 0)) return 1;
  const power = Math.pow(10, Math.floor(Math.log10(v)));
  for (const step of [1, 2, 5, 10]) if (step * power >= v) return step * power;
  return 10 * power;
}
})();
