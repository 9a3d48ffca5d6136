"""The page ``atoll dashboard`` serves: HTML, CSS and a script in one document, drawing ``/api/state`` in SVG.

It loads nothing else and fetches only ``/api/state`` from where it came from. Every figure that came from the
network (peer ids, device names) is put in the page as text (``textContent``), never as markup."""

import base64
import hashlib
import re

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>atoll dashboard</title>
<style>
body { font: 13px/1.45 system-ui, sans-serif; margin: 16px 20px; color: #222; background: #f7f7f7; }
h1 { font-size: 18px; margin: 0 0 2px; }
h2 { font-size: 13px; margin: 0 0 4px; font-weight: 600; }
.sub { color: #555; margin-bottom: 10px; }
.error { color: #b00020; }
table { border-collapse: collapse; background: #fff; margin: 8px 0 16px; border: 1px solid #e2e2e2; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; font-weight: 600; }
.l { text-align: left; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(580px, 1fr)); gap: 12px; }
.card { background: #fff; border: 1px solid #e2e2e2; padding: 8px 10px; }
svg text { font-size: 10px; fill: #555; }
.legend span { margin-right: 12px; white-space: nowrap; }
.swatch { display: inline-block; width: 12px; height: 3px; vertical-align: middle; margin-right: 4px; }
label { font-weight: normal; color: #555; margin-left: 8px; }
.foot { color: #777; margin-top: 12px; }
</style>
</head>
<body>
<h1>atoll &middot; run <span id="run-id">?</span></h1>
<div class="sub" id="totals">waiting for the first read of the run&hellip;</div>
<div class="sub error" id="error"></div>
<table id="islands">
<thead><tr>
<th class="l">island</th><th class="l">status</th><th class="l">device</th><th>ranks</th><th>step</th>
<th>tokens/s</th><th class="l">versions</th><th>last round</th><th>rounds</th><th>skipped</th><th>loss</th>
<th>held-out</th><th>sent MB</th><th>recv MB</th><th>rejected</th><th>forks healed</th><th>tokens lost</th><th>tokens carried</th>
</tr></thead>
<tbody></tbody>
</table>
<div class="grid">
<div class="card"><h2>Training loss (smoothed; raw, faint) and held-out loss (a point per evaluation)</h2>
<svg id="loss-chart" width="580" height="260"></svg><div class="legend" id="loss-legend"></div></div>
<div class="card"><h2>Tokens trained, run total <label><input type="checkbox" id="log-tokens"> log scale</label></h2>
<svg id="tokens-chart" width="580" height="260"></svg></div>
<div class="card"><h2>Rounds: newest replica version, rounds merged, rounds skipped</h2>
<svg id="rounds-chart" width="580" height="260"></svg><div class="legend" id="rounds-legend"></div></div>
<div class="card"><h2>Bytes on the wire, run total (MB)</h2>
<svg id="bytes-chart" width="580" height="260"></svg><div class="legend" id="bytes-legend"></div></div>
<div class="card"><h2>Rejected input and forks healed, run total</h2>
<svg id="faults-chart" width="580" height="260"></svg><div class="legend" id="faults-legend"></div></div>
</div>
<div class="foot" id="foot"></div>
<script>
"use strict";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf"];
const NS = "http://www.w3.org/2000/svg";
let last = null;

function node(tag, attrs, parent, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(NS, tag.slice(4)) : document.createElement(tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
// Colours through the CSSOM, not a style attribute: the page's CSP allows no inline style attributes.
function swatch(parent, color) { node("span", {class: "swatch"}, parent).style.background = color; }
function clear(e) { while (e.firstChild) e.removeChild(e.firstChild); }
function fixed(x, d) { return x === null || x === undefined ? "-" : Number(x).toFixed(d); }
function human(x) {
  const a = Math.abs(x);
  if (a < 1e-9) return "0";
  if (a >= 1e9) return (x / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (x / 1e6).toFixed(1) + "M";
  if (a >= 1e3) return (x / 1e3).toFixed(1) + "k";
  return a >= 10 || x === 0 ? x.toFixed(0) : x.toPrecision(3);
}
function clock(t) { return new Date(t * 1000).toTimeString().slice(0, 8); }
function ago(s) {
  if (s === null || s === undefined) return "-";
  return s < 120 ? s.toFixed(0) + " s ago" : (s / 60).toFixed(0) + " min ago";
}

// Round values for an axis from lo to hi: steps of 1, 2 or 5 times a power of ten, about five of them; on a log
// axis (lo and hi are log10s), the whole powers of ten between, when there are at least two.
function ticks(lo, hi, log) {
  if (log) {
    const out = [];
    for (let e = Math.ceil(lo); e <= hi; e++) out.push(e);
    if (out.length >= 2) return out;
  }
  const raw = (hi - lo) / 5, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

// series: [{x, y, color, width, opacity, cls, dots}]. Points that are null, or not positive on a log scale, are
// left out, not drawn as zero.
function chart(svg, series, log) {
  clear(svg);
  const W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), L = 58, R = 12, T = 8, B = 24;
  const ok = y => y !== null && isFinite(y) && (!log || y > 0);
  const f = y => log ? Math.log10(y) : y;
  const xs = [], ys = [];
  for (const s of series) s.x.forEach((x, i) => { if (ok(s.y[i])) { xs.push(x); ys.push(f(s.y[i])); } });
  if (!xs.length) { node("svg:text", {x: W / 2, y: H / 2, "text-anchor": "middle"}, svg, "no data yet"); return; }
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1;
  const counts = !log && y0 >= 0;  // a count's axis does not go below zero
  if (y1 === y0) {
    if (counts && y0 === 0) y1 = 1; else { y0 -= 0.5; y1 += 0.5; }
  }
  const pad = (y1 - y0) * 0.05;
  y0 = counts ? Math.max(0, y0 - pad) : y0 - pad;
  y1 += pad;
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  node("svg:line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}, svg);
  node("svg:line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}, svg);
  for (const v of ticks(y0, y1, log)) {
    const y = sy(v);
    node("svg:line", {x1: L, y1: y, x2: W - R, y2: y, stroke: "#eee"}, svg);
    node("svg:text", {x: L - 4, y: y + 3, "text-anchor": "end"}, svg, human(log ? Math.pow(10, v) : v));
  }
  for (let i = 0; i <= 4; i++) {
    const t = x0 + (x1 - x0) * i / 4, anchor = i === 0 ? "start" : i === 4 ? "end" : "middle";
    node("svg:text", {x: sx(t), y: H - B + 14, "text-anchor": anchor}, svg, clock(t));
  }
  for (const s of series) {
    const pts = [];
    s.x.forEach((x, i) => { if (ok(s.y[i])) pts.push([sx(x), sy(f(s.y[i]))]); });
    if (!pts.length) continue;
    if (s.dots) {
      for (const [x, y] of pts) node("svg:circle", {cx: x, cy: y, r: 3.5, fill: s.color, stroke: "#fff",
                                                   class: s.cls}, svg);
    } else {
      node("svg:path", {d: "M" + pts.map(p => p[0].toFixed(1) + "," + p[1].toFixed(1)).join("L"), fill: "none",
                        stroke: s.color, "stroke-width": s.width || 1.6, "stroke-opacity": s.opacity || 1,
                        "stroke-dasharray": s.dash || "none", class: s.cls, "data-points": pts.length}, svg);
    }
  }
}

function legend(div, items) {
  clear(div);
  for (const [label, color] of items) {
    const s = node("span", {}, div);
    swatch(s, color);
    s.appendChild(document.createTextNode(label));
  }
}

function render(s) {
  last = s;
  document.getElementById("run-id").textContent = s.run_id === null ? "?" : s.run_id;
  document.getElementById("error").textContent = s.error || "";
  const t = s.totals;
  if (t) {
    document.getElementById("totals").textContent =
      t.peers + " islands, " + t.ranks + " ranks, " + human(t.tokens) + " tokens, " + human(t.tokens_per_s) +
      " tokens/s, newest version " + t.max_version + " (from " + (s.summary ? s.summary.source : "-") + ", read " +
      clock(s.time) + ")";
  }
  const color = {};
  s.seen.forEach((pid, i) => { color[pid] = COLORS[i % COLORS.length]; });
  const body = document.querySelector("#islands tbody");
  clear(body);
  for (const p of s.islands) {
    const tr = node("tr", {"data-peer": p.peer_id}, body);
    const name = node("td", {class: "l", title: p.peer_id}, tr);
    swatch(name, color[p.peer_id]);
    name.appendChild(document.createTextNode("\u2026" + p.peer_id.slice(-8)));
    node("td", {class: "l"}, tr, p.status + (p.reachable ? "" : " (NAT)"));
    node("td", {class: "l"}, tr, p.device);
    for (const v of [p.ranks, p.step, human(p.tokens_per_s)]) node("td", {}, tr, String(v));
    node("td", {class: "l"}, tr, p.fragment_versions.join("/"));
    for (const v of [ago(p.last_round_s), p.rounds, p.rounds_skipped, fixed(p.loss, 4), fixed(p.held_out_loss, 4),
                     fixed(p.bytes_sent / 1e6, 1), fixed(p.bytes_received / 1e6, 1), p.rejected, p.forks_healed,
                     human(p.tokens_lost), human(p.tokens_carried || 0)])
      node("td", {}, tr, String(v));
  }
  const loss = [];
  for (const l of s.loss) {
    loss.push({x: l.t, y: l.raw, color: color[l.peer_id], width: 1, opacity: 0.25, cls: "raw"});
    loss.push({x: l.t, y: l.smooth, color: color[l.peer_id], width: 2, cls: "smooth"});
  }
  for (const h of s.held_out) loss.push({x: h.t, y: h.value, color: color[h.peer_id], dots: true, cls: "held-out"});
  chart(document.getElementById("loss-chart"), loss, false);
  legend(document.getElementById("loss-legend"), s.seen.map(pid => ["\u2026" + pid.slice(-8), color[pid]]));
  const r = s.run, mb = ys => ys.map(y => y === null || y === undefined ? null : y / 1e6);
  // items: [key of s.run, label, color, transform, dash]; a later line is dashed where it may lie on an earlier one.
  const runChart = (id, items, log) => {
    chart(document.getElementById(id), items.map(([k, , c, f, dash]) => ({x: r.t, y: f ? f(r[k]) : r[k],
                                                                          color: c, cls: k, dash})), log);
    const div = document.getElementById(id.replace("chart", "legend"));
    if (div) legend(div, items.map(([, label, c]) => [label, c]));
  };
  runChart("tokens-chart", [["tokens", "tokens", COLORS[0]]], document.getElementById("log-tokens").checked);
  runChart("rounds-chart", [["version", "newest replica version", COLORS[0]],
                            ["rounds", "rounds merged (sum over islands)", COLORS[2]],
                            ["rounds_skipped", "rounds skipped (sum)", COLORS[3], null, "5,3"]], false);
  runChart("bytes-chart", [["bytes_sent", "sent", COLORS[0], mb],
                           ["bytes_received", "received", COLORS[1], mb, "5,3"]], false);
  runChart("faults-chart", [["rejected", "input rejected", COLORS[3]],
                            ["forks_healed", "forks healed", COLORS[4], null, "5,3"]], false);
  document.getElementById("foot").textContent =
    s.polls + " reads since " + (s.first_poll ? clock(s.first_poll) : "-") + ". The curves hold what this dashboard " +
    "read since it started; run totals count every island it has seen, at its newest figures. " +
    (s.verified ? "It shows only records whose certificates the run key signed (--join-token or --run-key)."
                : "Unverified: it shows any signed record of the run's DHT (--join-token or --run-key checks " +
                  "certificates).") +
    (s.summary && s.summary.implausible ? " " + s.summary.implausible + " record(s) with impossible figures " +
                                          "left out." : "");
  document.body.dataset.polls = s.polls;
}

async function refresh() {
  let wait = 5000, s = null;
  try {
    const response = await fetch("/api/state", {cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    s = await response.json();
    wait = Math.max(1000, s.interval * 1000);
  } catch (e) {
    document.getElementById("error").textContent = "the dashboard did not answer: " + e.message;
  }
  if (s !== null) {
    try {
      render(s);
    } catch (e) {
      document.getElementById("error").textContent = "this page could not draw the run's state: " + e.message;
    }
  }
  setTimeout(refresh, wait);
}
document.getElementById("log-tokens").addEventListener("change", () => { if (last) render(last); });
refresh();
</script>
</body>
</html>
"""


def _hash(tag: str) -> str:
    """The CSP source of the page's one ``tag`` element: the sha256 of its text, so that the browser runs this
    script and applies this style and nothing else inline."""
    text = re.search(f"<{tag}>(.*?)</{tag}>", PAGE, re.S).group(1)  # type: ignore[union-attr]
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


# The page may load nothing but itself and fetch nothing but its server's /api/state.
CSP = (f"default-src 'none'; script-src {_hash('script')}; style-src {_hash('style')}; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

