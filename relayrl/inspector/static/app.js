// relayrl inspect: the page over runs' saved rollouts and metrics (vanilla JS, no dependencies).
// Served, data arrive as JSON (data/manifest.json, data/rR/step_NNNNNN.json: readable by this origin only);
// exported and opened as file://, as scripts calling relayrlData(key, value) (the .js files next to the page).
"use strict";

const $ = (id) => document.getElementById(id);
const RUN_COLOURS = ["#2f6fdb", "#e0622a", "#2e9d55", "#9b4dca", "#c99a06", "#d24b8c"];
// the charts a page opens with, each the first of its metrics a run logged (preferred first)
const DEFAULT_CURVES = [
  ["rollout/reward"], ["eval/accuracy_mean", "eval/accuracy"], ["rollout/completion_len"], ["actor/kl_loss"],
  ["mismatch/abs_diff_mean", "actor/behav_kl"], ["rollout/staleness_mean"], ["perf/samples_per_s"], ["actor/entropy"],
];
const PAGE = 120; // rollouts rendered at a time (more on demand)
const pending = {};
const cache = {};
const state = { manifest: null, run: 0, step: null, rows: [], byI: new Map(), shown: PAGE, curves: [] };

window.relayrlData = (key, value) => {
  const waiting = pending[key];
  delete pending[key];
  if (waiting) waiting(value);
};

function load(key, src) {
  if (cache[key]) return Promise.resolve(cache[key]);
  if (location.protocol !== "file:") { // served: JSON that only this page's origin may read
    return fetch(src.replace(/\.js$/, ".json"), { credentials: "omit" }).then((r) => {
      if (!r.ok) throw new Error(`cannot load ${src}: HTTP ${r.status}`);
      return r.json();
    }).then((value) => { cache[key] = value; return value; });
  }
  return new Promise((resolve, reject) => { // exported, opened from file:// (no fetch there)
    pending[key] = (value) => { cache[key] = value; resolve(value); };
    const s = document.createElement("script");
    s.src = src;
    s.onload = () => s.remove();
    s.onerror = () => { delete pending[key]; s.remove(); reject(new Error("cannot load " + src)); };
    document.head.appendChild(s);
  });
}

const pad6 = (n) => String(n).padStart(6, "0");
const fmt = (v, d = 3) => (v === undefined || v === null || Number.isNaN(v) ? "–" : Number.isInteger(v) ? String(v) : v.toFixed(d));
const at = (field, k) => (field === undefined ? undefined : Array.isArray(field) ? field[k] : field);
const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; };

// ------------------------------------------------------------------ rollouts: derived fields

function prepare(r, index) {
  if (!r.tokens) { // saved before token-level fields existed: the completion as one piece
    r.tokens = { ids: [null], text: [r.completion], mask: [1] };
    r.i ??= index; r.len ??= r.completion.length; r.lag ??= 0; r.stop ??= "?";
  }
  const t = r.tokens, n = t.ids.length;
  let adv = 0, lp = 0, m = 0, dmax = 0;
  for (let k = 0; k < n; k++) {
    if (!t.mask[k]) continue;
    m++;
    adv += at(t.adv, k) ?? 0;
    lp += at(t.logp, k) ?? 0;
    if (t.tlogp !== undefined && generated(t, k)) dmax = Math.max(dmax, Math.abs(at(t.tlogp, k) - at(t.logp, k)));
  }
  r.adv = m ? adv / m : 0;
  r.logp = m ? lp / m : 0;
  r.delta = t.tlogp !== undefined ? dmax : null;
  r.correct = (r.raw_rewards ?? r.reward) > 0;
  r.group = r.group_id ?? r.prompt;
  r.search = (r.prompt + "\n" + r.completion).toLowerCase();
  return r;
}

// Tokens the policy did not generate (tool / environment turns: version -1) have no generator logprob.
const generated = (t, k) => at(t.ver, k) === undefined || at(t.ver, k) >= 0;

function tokenValue(t, k, q) {
  if ((q === "logp" || q === "delta") && !generated(t, k)) return undefined;
  if (q === "delta") return t.tlogp === undefined ? undefined : Math.abs(at(t.tlogp, k) - at(t.logp, k));
  return at(t[q], k);
}

// ------------------------------------------------------------------ colour scales

function scaleFor(rows, q) {
  let lo = Infinity, hi = -Infinity;
  for (const r of rows) {
    const t = r.tokens;
    for (let k = 0; k < t.ids.length; k++) {
      const v = tokenValue(t, k, q);
      if (v === undefined || !t.mask[k]) continue;
      lo = Math.min(lo, v); hi = Math.max(hi, v);
    }
  }
  if (lo === Infinity) return null;
  if (q === "adv") { const a = Math.max(Math.abs(lo), Math.abs(hi), 1e-6); return { q, lo: -a, hi: a }; }
  if (q === "logp") return { q, lo: Math.min(lo, hi - 1e-3), hi };
  if (q === "ver") return { q, lo, hi };
  return { q, lo: 0, hi: Math.max(hi, 1e-6) };
}

const mix = (a, b, f) => a.map((x, i) => Math.round(x + (b[i] - x) * f));
const rgb = (c) => `rgb(${c[0]},${c[1]},${c[2]})`;
const WHITE = [255, 255, 255], RED = [226, 74, 74], BLUE = [58, 118, 226], GREEN = [70, 170, 100], PURPLE = [140, 80, 200];
const VERSION_PALETTE = ["#cfe3ff", "#ffd9b8", "#cdeccf", "#ead5f5", "#fff0b0", "#f8cfe0", "#d5f0f0"];

function colour(s, v) {
  if (!s || v === undefined) return "";
  if (s.q === "ver") return VERSION_PALETTE[((v % VERSION_PALETTE.length) + VERSION_PALETTE.length) % VERSION_PALETTE.length];
  const f = Math.min(1, Math.max(0, (v - s.lo) / (s.hi - s.lo || 1)));
  if (s.q === "adv") return f < 0.5 ? rgb(mix(RED, WHITE, f * 2)) : rgb(mix(WHITE, BLUE, (f - 0.5) * 2));
  if (s.q === "logp") return rgb(mix(RED, WHITE, f)); // the step's least likely tokens reddest
  if (s.q === "ent") return rgb(mix(WHITE, PURPLE, f));
  return rgb(mix(WHITE, RED, f)); // |Δ logprob|
}

function drawScale(s) {
  const box = $("scale");
  box.replaceChildren();
  if (!s) { box.append(el("span", "", "not saved for this run")); return; }
  if (s.q === "ver") {
    for (let v = s.lo; v <= s.hi && v - s.lo < 12; v++) {
      const sw = el("span", "swatch"); sw.style.background = colour(s, v); box.append(sw, el("span", "", "v" + v));
    }
    return;
  }
  const ramp = el("span", "ramp");
  const stops = [0, 0.25, 0.5, 0.75, 1].map((f) => colour(s, s.lo + f * (s.hi - s.lo)));
  ramp.style.background = `linear-gradient(90deg, ${stops.join(",")})`;
  box.append(el("span", "", fmt(s.lo, 2)), ramp, el("span", "", fmt(s.hi, 2)));
}

// ------------------------------------------------------------------ rollouts: rendering

function tokensView(r, s, q) {
  const t = r.tokens, box = el("div", "tokens");
  let turn = 1, prevMask = 1, prevVer = null;
  for (let k = 0; k < t.ids.length; k++) {
    const masked = !t.mask[k];
    if (!masked && prevMask === 0) box.append(el("span", "turn", "turn " + ++turn));
    prevMask = masked ? 0 : 1;
    const span = el("span", masked ? "tok masked" : "tok", t.text[k]);
    span.dataset.k = k;
    if (!masked) {
      span.style.background = colour(s, tokenValue(t, k, q));
      const v = at(t.ver, k);
      if (prevVer !== null && v !== undefined && v !== prevVer) span.classList.add("verchange");
      if (v !== undefined) prevVer = v;
    }
    box.append(span);
  }
  return box;
}

function rolloutCard(r, s, q, withPrompt) {
  const card = el("div", "rollout " + (r.correct ? "correct" : "wrong"));
  card.dataset.i = r.i;
  card.rollout = r;
  const stats = el("div", "stats");
  const stat = (name, value) => { const b = el("span"); b.append(name + " ", el("b", "", value)); stats.append(b); };
  stat("reward", fmt(r.reward));
  stat("adv", fmt(r.adv));
  stat("len", String(r.len));
  stat("stop", r.stop);
  stat("lag", String(r.lag));
  stat("v", r.versions.join(","));
  if (r.delta !== null) stat("max|Δ|", fmt(r.delta));
  if (r.num_turns !== undefined) stat("turns", String(r.num_turns));
  if (r.n_images) stat("images", String(r.n_images));
  card.append(stats);
  if (withPrompt) card.append(el("div", "prompt", r.prompt));
  if (withPrompt && imagesOf(r).length) card.append(imageStrip(imagesOf(r)));
  card.append(tokensView(r, s, q));
  return card;
}

// A group's members share their prompt's images, saved with the first of them (images_of: its index).
function imagesOf(r) {
  if (r.images) return r.images;
  const owner = r.images_of === undefined ? undefined : state.byI.get(r.images_of);
  return (owner && owner.images) || [];
}

function imageStrip(urls) {
  const strip = el("div", "images");
  for (const url of urls) { const img = el("img"); img.src = url; img.alt = "episode image"; strip.append(img); }
  return strip;
}

function passes(r, f) {
  if (f.rmin !== null && r.reward < f.rmin) return false;
  if (f.rmax !== null && r.reward > f.rmax) return false;
  if (f.correct === "correct" && !r.correct) return false;
  if (f.correct === "wrong" && r.correct) return false;
  if (f.stop && r.stop !== f.stop) return false;
  if (f.lmin !== null && r.len < f.lmin) return false;
  if (f.lmax !== null && r.len > f.lmax) return false;
  if (f.lag !== null && r.lag > f.lag) return false;
  if (f.text && !r.search.includes(f.text)) return false;
  return true;
}

function num(id) { const v = $(id).value.trim(); return v === "" ? null : Number(v); }

function filters() {
  return {
    rmin: num("f-reward-min"), rmax: num("f-reward-max"), correct: $("f-correct").value, stop: $("f-stop").value,
    lmin: num("f-len-min"), lmax: num("f-len-max"), lag: num("f-lag-max"), text: $("f-search").value.trim().toLowerCase(),
  };
}

function sortKey(r, key) {
  if (key === "group") return -r.i; // batch order (descending flips it back)
  if (key === "stop") return r.stop;
  return r[key] ?? -Infinity;
}

function render() {
  const box = $("rollouts"), q = $("colour").value, key = $("sort").value, desc = $("sort-desc").checked;
  const f = filters(), rows = state.rows.filter((r) => passes(r, f));
  const cmp = (a, b) => { const x = sortKey(a, key), y = sortKey(b, key); return (x < y ? -1 : x > y ? 1 : a.i - b.i) * (desc ? -1 : 1); };
  rows.sort(cmp);
  const s = scaleFor(state.rows, q);
  drawScale(s);
  $("count").textContent = `${rows.length} of ${state.rows.length} rollouts`;
  box.replaceChildren();
  if (!rows.length) { box.append(el("div", "empty", state.rows.length ? "no rollout passes the filters" : "no rollouts saved for this step")); return; }
  const visible = rows.slice(0, state.shown);
  if ($("grouped").checked) {
    const groups = new Map();
    for (const r of visible) { if (!groups.has(r.group)) groups.set(r.group, []); groups.get(r.group).push(r); }
    for (const members of groups.values()) {
      const all = state.rows.filter((r) => r.group === members[0].group);
      const g = el("div", "group");
      const head = el("div", "head");
      const mean = all.reduce((a, r) => a + r.reward, 0) / all.length;
      head.append(el("span", "prompt", members[0].prompt), el("span", "badge", `group ${members[0].group_id ?? ""}`.trim()),
        el("span", "badge", `${all.filter((r) => r.correct).length}/${all.length} correct`), el("span", "badge", "mean reward " + fmt(mean)));
      if (imagesOf(members[0]).length) head.append(imageStrip(imagesOf(members[0])));
      const grid = el("div", "members");
      for (const r of members) grid.append(rolloutCard(r, s, q, false));
      g.append(head, grid);
      box.append(g);
    }
  } else {
    const grid = el("div", "flat");
    for (const r of visible) grid.append(rolloutCard(r, s, q, true));
    box.append(grid);
  }
  if (rows.length > visible.length) {
    const more = el("button", "more", `show ${Math.min(PAGE, rows.length - visible.length)} more of ${rows.length - visible.length}`);
    more.onclick = () => { state.shown += PAGE; render(); };
    box.append(more);
  }
}

// ------------------------------------------------------------------ token hover

function showTip(ev) {
  const span = ev.target.closest(".tok"), tip = $("tip");
  if (!span) { tip.hidden = true; return; }
  const r = span.closest(".rollout").rollout, t = r.tokens, k = Number(span.dataset.k);
  const lines = [`token ${JSON.stringify(t.text[k])}  id ${t.ids[k]}  #${k}`, t.mask[k] ? "trained (loss mask 1)" : "masked: not trained (prompt / tool / environment)"];
  const add = (name, v) => { if (v !== undefined && v !== null) lines.push(`${name.padEnd(16)}${fmt(v, 4)}`); };
  add("logprob (gen)", tokenValue(t, k, "logp"));
  add("logprob (train)", at(t.tlogp, k));
  add("|Δ logprob|", tokenValue(t, k, "delta"));
  add("advantage", at(t.adv, k));
  add("entropy", at(t.ent, k));
  add("version", at(t.ver, k));
  tip.textContent = lines.join("\n");
  tip.hidden = false;
  tip.style.left = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8) + "px";
  tip.style.top = Math.min(ev.clientY + 14, window.innerHeight - tip.offsetHeight - 8) + "px";
}

// ------------------------------------------------------------------ steps

function runSteps() { return state.manifest.runs[state.run].steps.map((e) => e.step); }

async function openStep(run, step) {
  const runs = state.manifest.runs;
  state.run = run;
  $("run").value = String(run);
  const steps = runSteps();
  if (!steps.length) { state.rows = []; $("step-label").textContent = "no rollouts saved"; render(); return; }
  const nearest = steps.reduce((a, s) => (Math.abs(s - step) < Math.abs(a - step) ? s : a), steps[0]);
  $("step").max = String(steps.length - 1);
  $("step").value = String(steps.indexOf(nearest));
  state.step = nearest;
  const entry = runs[run].steps[steps.indexOf(nearest)];
  $("step-label").textContent = `step ${nearest}` + (entry.n ? ` · ${entry.n} of ${entry.of} rollouts saved` : "");
  location.hash = `run=${run}&step=${nearest}`;
  const rows = await load(`r${run}/${nearest}`, `data/r${run}/step_${pad6(nearest)}.js`);
  if (state.step !== nearest || state.run !== run) return; // another step was opened meanwhile
  rows.forEach((r, index) => { if (r.search === undefined) prepare(r, index); });
  state.rows = rows;
  state.byI = new Map(rows.map((r) => [r.i, r]));
  state.shown = PAGE;
  render();
  drawCharts();
}

// ------------------------------------------------------------------ curves

function metricKeys() {
  const keys = new Set();
  for (const run of state.manifest.runs) for (const row of run.metrics) for (const k of Object.keys(row)) if (k !== "step") keys.add(k);
  return [...keys].sort();
}

function drawCharts() {
  const box = $("charts");
  box.replaceChildren();
  for (const key of state.curves) box.append(chart(key));
}

function chart(key) {
  const W = 300, H = 130, L = 46, R = 8, T = 6, B = 18, NS = "http://www.w3.org/2000/svg";
  const series = state.manifest.runs.map((run) => run.metrics.filter((m) => m[key] !== undefined).map((m) => [m.step, m[key]]));
  const pts = series.flat();
  const wrap = el("div", "chart");
  wrap.dataset.metric = key;
  const title = el("h3", "", key), close = el("button", "", "×");
  close.title = "remove this curve";
  close.onclick = () => { state.curves = state.curves.filter((k) => k !== key); drawCharts(); };
  title.append(close);
  wrap.append(title);
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  const mk = (tag, attrs) => { const e = document.createElementNS(NS, tag); for (const [a, v] of Object.entries(attrs)) e.setAttribute(a, v); return e; };
  const x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
  let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => L + ((x - x0) / (x1 - x0 || 1)) * (W - L - R), sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  svg.append(mk("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }), mk("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  const label = (x, y, text, anchor) => { const t = mk("text", { x, y, "text-anchor": anchor }); t.textContent = text; svg.append(t); };
  const short = (v) =>
    Math.abs(v) >= 1000 ? v.toFixed(0) : v !== 0 && Math.abs(v) < 1e-3 ? v.toExponential(2) : String(Number(v.toPrecision(3)));
  label(L - 3, T + 8, short(y1), "end"); label(L - 3, H - B, short(y0), "end");
  label(L, H - 4, String(x0), "start"); label(W - R, H - 4, String(x1), "end");
  if (state.step !== null) svg.append(mk("line", { class: "cursor", x1: sx(state.step), y1: T, x2: sx(state.step), y2: H - B }));
  series.forEach((s, run) => {
    if (!s.length) return;
    svg.append(mk("polyline", { points: s.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" "), fill: "none", stroke: RUN_COLOURS[run % 6], "stroke-width": 1.6 }));
    for (const [x, y] of s) {
      const c = mk("circle", { class: "pt", cx: sx(x), cy: sy(y), r: 3, fill: RUN_COLOURS[run % 6], "data-run": run, "data-step": x });
      const tt = mk("title", {}); tt.textContent = `${state.manifest.runs[run].name} · step ${x} · ${key} = ${fmt(y, 4)}`;
      c.append(tt);
      c.addEventListener("click", () => openStep(run, x));
      svg.append(c);
    }
  });
  wrap.append(svg);
  return wrap;
}

// ------------------------------------------------------------------ start

async function main() {
  try {
    state.manifest = await load("manifest", "data/manifest.js");
  } catch (e) {
    $("status").textContent = "cannot load data/manifest.js: " + e.message;
    return;
  }
  const runs = state.manifest.runs;
  $("status").textContent = runs.map((r) => `${r.name}: ${r.steps.length} steps saved`).join(" · ");
  runs.forEach((r, i) => {
    $("run").append(new Option(r.name, String(i)));
    const sw = el("span", "swatch"); sw.style.background = RUN_COLOURS[i % 6];
    $("run-legend").append(sw, el("span", "", r.name));
  });
  const keys = metricKeys();
  for (const k of keys) $("add-metric").append(new Option(k, k));
  state.curves = DEFAULT_CURVES.map((names) => names.find((k) => keys.includes(k))).filter((k) => k !== undefined);
  $("add-metric").onchange = (ev) => { const k = ev.target.value; if (k && !state.curves.includes(k)) state.curves.push(k); ev.target.value = ""; drawCharts(); };
  $("run").onchange = () => openStep(Number($("run").value), state.step ?? 0);
  $("step").oninput = () => openStep(state.run, runSteps()[Number($("step").value)]);
  for (const id of ["colour", "sort", "sort-desc", "grouped", "f-correct", "f-stop"]) $(id).onchange = () => { state.shown = PAGE; render(); };
  for (const id of ["f-reward-min", "f-reward-max", "f-len-min", "f-len-max", "f-lag-max", "f-search"]) $(id).oninput = () => { state.shown = PAGE; render(); };
  $("rollouts").addEventListener("mousemove", showTip);
  $("rollouts").addEventListener("mouseleave", () => { $("tip").hidden = true; });
  const hash = new URLSearchParams(location.hash.slice(1));
  const run = Math.min(Number(hash.get("run") ?? 0), runs.length - 1);
  state.run = run;
  const steps = runSteps();
  await openStep(run, hash.has("step") ? Number(hash.get("step")) : steps[steps.length - 1] ?? 0);
  drawCharts();
  document.body.dataset.ready = "1";
}

main();
