// rtrees view: the page. Plain DOM and SVG, no library; every stored text goes in
// through textContent (never innerHTML). Data come from the JSON routes of
// analysis/viewer/server.py, or from window.RTREES_STATIC in a static export.
"use strict";
(function () {
  const SVGNS = "http://www.w3.org/2000/svg";
  const STATIC = window.RTREES_STATIC || null;
  const TOKEN = (document.querySelector('meta[name="rtrees-token"]') || {}).content || "";
  const state = { tree: null, node: null, run: null, selectedRun: null, compare: null, store: "", stores: [], basket: [], siblings: null, metricsRun: null };

  function $(id) { return document.getElementById(id); }
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v !== "number") return String(v);
    if (Math.abs(v) < 1e-9) return "0";
    return Number(v.toPrecision(3)).toString();
  }
  function clear(e) { while (e.firstChild) e.removeChild(e.firstChild); }

  function query(path, params) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(params || {})) if (v) q.set(k, v);
    const s = q.toString();
    return s ? path + "?" + s : path;
  }
  function staticKey(path, params) {  // analysis/viewer/export.py builds the same keys
    const items = Object.entries(params || {}).filter(([, v]) => v).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
    return [path, ...items.map(([k, v]) => k + "=" + v)].join("|");
  }
  async function api(path, params) {
    const key = STATIC ? staticKey(path, params) : query(path, params);
    if (STATIC) {
      if (!(key in STATIC)) throw new Error("not in this export: " + key);
      return STATIC[key];
    }
    // the access cookie the tokened URL set (HttpOnly: this script never sees it)
    const r = await fetch(key, { credentials: "same-origin", headers: { Accept: "application/json" } });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error || r.statusText);
    return body;
  }

  // ---- colours
  function diverging(v, half) {  // RdBu_r-like: blue negative, white 0, red positive
    if (v === null || v === undefined || !isFinite(v)) return "#d9d9d9";
    const t = Math.max(-1, Math.min(1, v / (half || 1)));
    const a = Math.abs(t);
    const [r, g, b] = t >= 0 ? [255, 255 - 180 * a, 255 - 190 * a] : [255 - 190 * a, 255 - 140 * a, 255];
    return `rgb(${r | 0},${g | 0},${b | 0})`;
  }
  function probColor(lp) {  // p = exp(logprob): red (unlikely) .. green (likely)
    if (lp === null || lp === undefined) return "#eee";
    const p = Math.exp(Math.min(0, lp));
    return `hsl(${(120 * p) | 0},70%,78%)`;
  }
  function entropyColor(h, max) {
    if (h === null || h === undefined) return "#eee";
    const a = Math.max(0, Math.min(1, h / (max || 1)));
    return `rgba(128,60,200,${(0.08 + 0.75 * a).toFixed(3)})`;
  }

  // ---- runs, trees, filter
  async function loadSummary() {
    const s = await api("/api/summary", { store: state.store });
    $("store-summary").textContent = `${s.store} · ${s.trees} trees · pinned ${Object.entries(s.version).map(([k, v]) => k + "@" + v).join(" ")}` + (STATIC ? " · static export" : "");
  }
  async function loadRuns() {
    const runs = await api("/api/runs", { store: state.store });
    const body = $("run-list").tBodies[0];
    clear(body);
    for (const r of runs) {
      const tr = el("tr", { "data-run": r.run_id });
      for (const v of [r.run_id, r.trees, r.samplers || "", r.metrics]) tr.appendChild(el("td", {}, v));
      tr.addEventListener("click", () => selectRun(r.run_id, r.trees > 0, r.metrics > 0));
      body.appendChild(tr);
    }
  }
  async function selectRun(run, hasTrees, hasMetrics) {
    // a run's trees filter the list (a second click clears it); a run's metrics are plotted
    const same = state.selectedRun === run;
    state.selectedRun = same ? null : run;
    for (const tr of $("run-list").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.run === state.selectedRun);
    const treeRun = same || !hasTrees ? null : run;
    if (treeRun !== state.run) { state.run = treeRun; await loadTrees(); }
    if (same) { $("metrics-section").hidden = true; return; }
    if (hasMetrics) await loadMetrics(run); else $("metrics-section").hidden = true;
  }
  async function loadTrees() {
    const where = STATIC ? "" : $("filter").value.trim();
    $("filter-error").textContent = "";
    let res;
    try {
      res = await api("/api/trees", { where: where, run: state.run, store: state.store });
    } catch (e) { $("filter-error").textContent = e.message; return; }
    const body = $("tree-list").tBodies[0];
    clear(body);
    for (const t of res.trees) {
      const tr = el("tr", { "data-tree": t.tree_id });
      for (const v of [t.tree_id, t.sampler, t.task_id, t.n_nodes, fmt(t.reward), t.labels || ""]) tr.appendChild(el("td", {}, v));
      tr.addEventListener("click", () => openTree(t.tree_id));
      if (state.tree && state.tree.tree.tree_id === t.tree_id) tr.classList.add("selected");
      body.appendChild(tr);
    }
    $("filter-note").textContent = `${res.trees.length} trees${res.truncated ? " (list cut; narrow the filter)" : ""} · columns of trees, plus reward (mean leaf reward), max_reward, leaves, labels`;
  }

  // ---- one tree
  async function openTree(id) {
    const data = await api("/api/tree", { id: id, store: state.store });
    data.store = state.store;
    state.tree = data; state.node = null; state.compare = null;
    for (const tr of $("tree-list").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.tree === id);
    $("tree-section").hidden = false;
    $("tree-title").textContent = `tree ${id}`;
    const t = data.tree, lin = data.lineage;
    const facts = [`run ${t.run_id}`, `task ${t.task_id}`, `env ${t.env}`, `sampler ${t.sampler}`,
      `policy ${t.policy_version || "–"}`];
    if (t.critical_node_id !== null) facts.push(`critical step: node ${t.critical_node_id}`);
    if (lin.refresh_of) facts.push(`refresh of ${lin.refresh_of} (version ${lin.refresh_of_version || "?"})`);
    if (lin.refreshed_by.length) facts.push(`refreshed by ${lin.refreshed_by.join(", ")}`);
    if (data.groups.length) facts.push(`${data.groups.length} CALIPER local group(s)`);
    if (data.labels.tree.length) facts.push("labels " + data.labels.tree.map((l) => `${l.key}=${l.value}`).join(" "));
    $("tree-meta").textContent = facts.join(" · ");
    fillSelect($("node-color"), ["reward", ...data.methods.map((m) => "credit:" + m)], "reward");
    fillSelect($("token-color"), ["logprob", "entropy", ...data.methods.map((m) => "credit:" + m)], $("token-color").value || "logprob");
    const none = data.methods.length ? data.methods : ["(no credit)"];
    fillSelect($("compare-a"), ["", ...data.methods], "");
    fillSelect($("compare-b"), ["", ...data.methods], "");
    if (data.methods.length >= 2) { $("compare-a").value = none[0]; $("compare-b").value = none[1]; }
    await loadCompare();
    draw();
    $("node-panel").hidden = true;
    document.body.dataset.tree = (state.store ? state.store + ":" : "") + id;  // drawn
  }
  function fillSelect(sel, options, value) {
    clear(sel);
    for (const o of options) sel.appendChild(el("option", { value: o }, o || "—"));
    sel.value = options.includes(value) ? value : options[0];
  }
  async function loadCompare() {
    const a = $("compare-a").value, b = $("compare-b").value;
    const body = $("compare-table").tBodies[0];
    clear(body);
    state.compare = null;
    $("compare-summary").textContent = "";
    if (!a || !b || a === b || !state.tree) { draw(); return; }
    const res = await api("/api/compare", { tree: state.tree.tree.tree_id, a: a, b: b, store: state.tree.store });
    state.compare = res;
    $("compare-summary").textContent = `${res.sign_disagreements} nodes disagree in sign, ${res.rank_disagreements} in rank among siblings`;
    for (const r of res.rows) {
      if (!r.sign_differs && !r.rank_differs) continue;
      const tr = el("tr", { "data-node": r.node_id });
      tr.appendChild(el("td", {}, r.node_id));
      tr.appendChild(el("td", {}, fmt(r.a)));
      tr.appendChild(el("td", {}, fmt(r.b)));
      tr.appendChild(el("td", { class: r.sign_differs ? "diff-sign" : "" }, r.sign_differs ? "differs" : "same"));
      tr.appendChild(el("td", {}, fmt(r.rank_a)));
      tr.appendChild(el("td", {}, fmt(r.rank_b)));
      tr.addEventListener("click", () => selectNode(r.node_id));
      body.appendChild(tr);
    }
    draw();
  }

  function draw() {
    const data = state.tree;
    if (!data) return;
    const host = $("tree-drawing");
    clear(host);
    const nodes = data.nodes;
    const byId = new Map(nodes.map((n) => [n.id, n]));
    const maxX = Math.max(...nodes.map((n) => n.x)), maxD = Math.max(...nodes.map((n) => n.depth));
    const dx = 64, dy = 74, pad = 40;
    const W = Math.max(480, (maxX + 1) * dx + 2 * pad), H = (maxD + 1) * dy + 2 * pad;
    const X = (n) => pad + dx / 2 + n.x * dx, Y = (n) => pad + n.depth * dy;
    const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, id: "tree-svg" });
    // CALIPER local groups: a band behind the members, y_0 marked
    for (const g of data.groups) {
      const ms = g.members.map((i) => byId.get(i)).filter(Boolean);
      if (!ms.length) continue;
      const x0 = Math.min(...ms.map(X)) - 20, x1 = Math.max(...ms.map(X)) + 20, y = Y(ms[0]);
      root.appendChild(svg("rect", { x: x0, y: y - 20, width: x1 - x0, height: 40, rx: 10, fill: "#fff3c4", stroke: "#e0b400", class: "local-group", "data-branch": g.branch }));
      root.appendChild(svg("text", { x: x0 + 2, y: y - 23, fill: "#8a6d00" }, `local group of node ${g.branch}${g.bucket ? " (" + g.bucket + ")" : ""}`));
    }
    for (const n of nodes) {
      if (n.parent === null) continue;
      const p = byId.get(n.parent);
      root.appendChild(svg("line", { x1: X(p), y1: Y(p), x2: X(n), y2: Y(n), stroke: "#999", "stroke-width": 1.2 }));
    }
    const mode = $("node-color").value || "reward";
    const method = mode.startsWith("credit:") ? mode.slice(7) : null;
    const vals = nodes.map((n) => method ? (n.credit[method] || {}).value : n.reward).filter((v) => v !== null && v !== undefined);
    const half = method ? Math.max(1e-9, ...vals.map(Math.abs)) : 1;
    const cmp = new Map(((state.compare || {}).rows || []).map((r) => [r.node_id, r]));
    const lin = data.lineage, forced = new Set(Object.keys(lin.lineage || {}).map(Number));
    const copied = new Set(Object.keys(lin.copied || {}).map(Number));
    for (const n of nodes) {
      const g = svg("g", { class: "node", "data-node": n.id, transform: `translate(${X(n)},${Y(n)})` });
      const v = method ? (n.credit[method] || {}).value : n.reward;
      const fill = method ? diverging(v, half) : (v === null || v === undefined ? "#d9d9d9" : diverging(2 * v - 1, 1));
      const c = svg("circle", { r: 11, fill: fill, stroke: "#333", "stroke-width": 1, class: "body" });
      if (copied.has(n.id)) c.setAttribute("stroke-dasharray", "3,2");
      g.appendChild(c);
      g.appendChild(svg("text", { y: 4, "text-anchor": "middle" }, n.id));
      if (data.tree.critical_node_id === n.id) {
        g.appendChild(svg("circle", { r: 17, fill: "none", stroke: "#ff7f0e", "stroke-width": 3, class: "critical" }));
      }
      const r = cmp.get(n.id);
      if (r && r.sign_differs) g.appendChild(svg("circle", { r: 14, fill: "none", stroke: "#b00020", "stroke-width": 2.5, class: "sign-differs" }));
      else if (r && r.rank_differs) g.appendChild(svg("circle", { r: 14, fill: "none", stroke: "#7b1fa2", "stroke-width": 2, "stroke-dasharray": "4,2", class: "rank-differs" }));
      if (forced.has(n.id)) g.appendChild(svg("text", { x: 13, y: -10, fill: "#1565c0" }, "↻"));
      const grp = data.groups.find((gr) => gr.y0 === n.id);
      if (grp) g.appendChild(svg("text", { x: -13, y: -13, "text-anchor": "end", fill: "#8a6d00" }, "y0"));
      if (n.reward !== null && n.reward !== undefined) g.appendChild(svg("text", { y: 26, "text-anchor": "middle", class: "leaf-label" }, "r=" + fmt(n.reward)));
      if (method && v !== undefined && v !== null) g.appendChild(svg("text", { x: 14, y: 4, class: "credit-label" }, fmt(v)));
      if (state.node === n.id) g.classList.add("selected");
      const title = svg("title", {}, `node ${n.id} (${n.kind}${n.phase ? ", " + n.phase : ""})`);
      g.appendChild(title);
      g.addEventListener("click", () => selectNode(n.id));
      root.appendChild(g);
    }
    host.appendChild(root);
    const legend = [method ? `nodes coloured by ${method} credit (blue < 0 < red, ±${fmt(half)})` : "nodes coloured by leaf reward (blue 0, red 1; grey: inner)",
      "orange ring: BEL critical step", "yellow band: CALIPER local group", "dashed: copied from the stored tree, ↻: forced (refreshed) child"];
    if (state.compare) legend.push("red ring: methods disagree in sign; purple dashed: in rank among siblings");
    $("legend").textContent = legend.join(" · ");
  }

  // ---- the node panel
  function selectNode(id) {
    state.node = id;
    draw();
    const data = state.tree, n = data.nodes.find((m) => m.id === id);
    $("node-panel").hidden = false;
    $("node-title").textContent = `node ${n.id}`;
    const facts = [`kind ${n.kind}`, `depth ${n.depth}`];
    if (n.phase) facts.push(`phase ${n.phase}`);
    if (n.parent !== null) facts.push(`parent ${n.parent}`);
    if (n.reward !== null) facts.push(`reward ${fmt(n.reward)}`);
    for (const [k, v] of Object.entries(n.reward_parts || {})) facts.push(`${k} ${fmt(v)}`);
    if (n.tool_calls !== null) facts.push(`tool calls ${n.tool_calls}`);
    if (data.tree.critical_node_id === n.id) facts.push("BEL critical step");
    const call = n.meta && typeof n.meta.call === "object" ? n.meta.call : null;
    const rest = Object.assign({}, n.meta || {});
    delete rest.call;  // shown as the model call below
    if (Object.keys(rest).length) facts.push("meta " + JSON.stringify(rest));
    $("node-facts").textContent = facts.join(" · ");
    const kids = data.nodes.filter((m) => m.parent === n.id).length;
    $("diff-siblings").hidden = kids < 2 || (STATIC && !(staticKey("/api/siblings", { node: String(n.id), store: data.store, tree: data.tree.tree_id }) in STATIC));
    $("diff-siblings").textContent = `diff the ${kids} children`;
    $("add-path").hidden = kids > 0 || STATIC !== null;
    $("action-text").textContent = n.action_text || "";
    $("observation-text").textContent = n.observation_text || "";
    drawCall(call);
    drawTokens();
    const body = $("credit-table").tBodies[0];
    clear(body);
    for (const m of data.methods) {
      const c = n.credit[m];
      const tr = el("tr", {});
      tr.appendChild(el("td", {}, m));
      tr.appendChild(el("td", { "data-method": m }, c ? fmt(c.value) : "–"));
      body.appendChild(tr);
    }
    const mc = $("mc-ref");
    clear(mc);
    if (!n.mc.length) mc.appendChild(el("span", { class: "note" }, "none stored"));
    for (const r of n.mc) mc.appendChild(el("div", { class: "mc" }, `Mean@${r.k} = ${fmt(r.mean)} (${r.successes}/${r.k}, policy ${r.policy_version || "–"}, run ${r.run_id})`));
    const sn = $("snapshot");
    clear(sn);
    const s = n.snapshot_id ? data.snapshots[n.snapshot_id] : null;
    if (!s) sn.appendChild(el("span", { class: "note" }, n.snapshot_id ? `${n.snapshot_id} (not stored)` : "none"));
    else {
      sn.appendChild(el("div", { class: "note" }, `${s.snapshot_id} · ${s.env} · ${s.bytes} bytes · sha256 ${s.sha256.slice(0, 12)}…`));
      sn.appendChild(el("pre", {}, s.preview + (s.truncated ? "\n…" : "")));
    }
    drawLabels();
  }
  function drawCall(call) {  // an agent program's model call (node meta "call"): text nodes only
    const host = $("call"), head = $("call-title");
    clear(host);
    head.hidden = host.hidden = !call;
    if (!call) return;
    const messages = Array.isArray(call.messages) ? call.messages : [];
    const first = Number.isInteger(call.first) ? call.first : 0;
    host.appendChild(el("div", { class: "note" }, `call ${fmt(call.index)} · messages ${first}..${first + messages.length - 1} (new in this request; earlier ones are on the path above)`));
    messages.forEach((m, i) => {
      const box = el("div", { class: "message" });
      const role = m && typeof m === "object" ? String(m.role || "?") : "?";
      const facts = [`[${first + i}] ${role}`];
      if (m && m.tool_call_id) facts.push(`tool_call_id ${m.tool_call_id}`);
      if (m && m.name) facts.push(`name ${m.name}`);
      box.appendChild(el("div", { class: "note" }, facts.join(" · ")));
      let content = m && typeof m === "object" ? m.content : m;
      if (Array.isArray(content)) content = content.map((p) => (p && p.text !== undefined ? p.text : JSON.stringify(p))).join("");
      if (content !== null && content !== undefined && content !== "") box.appendChild(el("pre", {}, typeof content === "string" ? content : JSON.stringify(content)));
      for (const c of (m && Array.isArray(m.tool_calls) ? m.tool_calls : [])) {
        const fn = (c && c.function) || {};
        box.appendChild(el("pre", {}, `→ ${fn.name || "?"}(${typeof fn.arguments === "string" ? fn.arguments : JSON.stringify(fn.arguments)})`));
      }
      host.appendChild(box);
    });
    const calls = Array.isArray(call.tool_calls) ? call.tool_calls : [];
    host.appendChild(el("div", { class: "note" }, calls.length ? `the completion's tool calls (${calls.length}):` : "the completion has no tool call"));
    for (const c of calls) {
      const row = el("div", { class: "tool-call" });
      row.appendChild(el("code", {}, String(c.name)));
      row.appendChild(el("span", { class: "note" }, ` ${c.id || ""}`));
      row.appendChild(el("pre", {}, typeof c.arguments === "string" ? c.arguments : JSON.stringify(c.arguments)));
      host.appendChild(row);
    }
  }
  function drawLabels() {
    const data = state.tree, host = $("labels-section");
    clear(host);
    if (!data || state.node === null) return;
    const L = data.labels, mine = L.nodes[state.node] || [];
    host.appendChild(el("h3", {}, `labels (node ${state.node}; ${L.history} rows of history in this tree)`));
    const list = el("ul", { id: "label-list" });
    for (const [where, rows] of [["node", mine], ["tree", L.tree]]) {
      for (const l of rows) {
        list.appendChild(el("li", { "data-key": l.key, "data-target": where }, `${where}: ${l.key} = ${l.value} (${l.author || "?"}, ${String(l.created_at).slice(0, 19)})`));
      }
    }
    if (!list.childNodes.length) list.appendChild(el("li", { class: "note" }, "none"));
    host.appendChild(list);
    if (STATIC || !TOKEN) return;  // a static export, or a server started with --no-labels
    const form = el("form", { id: "label-form" });
    const target = el("select", { id: "label-target" });
    target.appendChild(el("option", { value: "node" }, `node ${state.node}`));
    target.appendChild(el("option", { value: "tree" }, "whole tree"));
    const key = el("input", { id: "label-key", placeholder: "key", size: 8 });
    const value = el("input", { id: "label-value", placeholder: "value (empty clears)", size: 14 });
    const button = el("button", { id: "label-add", type: "submit" }, "label");
    const msg = el("div", { id: "label-error", class: "error" });
    for (const e of [target, key, value, button, msg]) form.appendChild(e);
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const body = { tree_id: data.tree.tree_id, node_id: target.value === "node" ? state.node : null, key: key.value, value: value.value === "" ? null : value.value, store: data.store || null };
      try {
        const r = await fetch("/api/label", { method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json", "X-Rtrees-Token": TOKEN }, body: JSON.stringify(body) });
        const res = await r.json();
        if (!r.ok) throw new Error(res.error || r.statusText);
        data.labels = res;
        drawLabels();
        loadTrees();
      } catch (e) { msg.textContent = e.message; }
    });
    host.appendChild(form);
  }
  function drawTokens() {
    const data = state.tree;
    if (!data || state.node === null) return;
    const n = data.nodes.find((m) => m.id === state.node), t = n.tokens;
    const mode = $("token-color").value || "logprob";
    const host = $("tokens");
    clear(host);
    let values, color, legend;
    if (mode === "logprob") { values = t.logprob; color = probColor; legend = "probability exp(logprob): red low, green high"; }
    else if (mode === "entropy") {
      values = t.entropy; const mx = Math.max(1e-9, ...values.filter((v) => v !== null));
      color = (v) => entropyColor(v, mx); legend = `entropy: pale 0, purple ${fmt(mx)}`;
    } else {
      const m = mode.slice(7), c = n.credit[m];
      const all = data.nodes.flatMap((k) => { const cc = k.credit[m]; return cc ? (cc.tokens || [cc.value]) : []; }).filter((v) => v !== null);
      const half = Math.max(1e-9, ...all.map(Math.abs));
      values = !c ? t.ids.map(() => null) : (c.tokens || t.ids.map(() => c.value));
      color = (v) => diverging(v, half);
      legend = !c ? `no ${m} credit at this node` : (c.tokens ? `${m} per-token credit, blue < 0 < red (±${fmt(half)})` : `${m} has no per-token values: the node's value on every token`);
    }
    $("token-legend").textContent = legend;
    t.ids.forEach((id, i) => {
      const text = t.text ? t.text[i] : "#" + id;
      const span = el("span", { class: "tok", "data-i": i, title: `token ${id} · ${mode} ${fmt(values[i])}` }, text);
      span.style.background = color(values[i]);
      host.appendChild(span);
    });
    if (!t.ids.length) host.appendChild(el("span", { class: "note" }, "no action tokens"));
  }

  // ---- a run's metrics
  async function loadMetrics(run) {
    const m = await api("/api/metrics", { run: run, store: state.store });
    const host = $("metrics-plots");
    clear(host);
    $("metrics-section").hidden = false;
    $("metrics-title").textContent = `metrics of run ${run}`;
    state.metricsRun = run;
    $("metrics-diff").hidden = true;
    $("metrics-error").textContent = "";
    await fillMetricsVs();
    for (const [name, pts] of Object.entries(m)) host.appendChild(plot(name, [{ pts: pts, color: "#1f77b4" }]));
  }
  async function fillMetricsVs() {
    const sel = $("metrics-vs");
    clear(sel);
    sel.appendChild(el("option", { value: "" }, "—"));
    sel.parentElement.hidden = STATIC !== null;
    if (STATIC) return;
    const names = state.stores.length ? state.stores.map((s, i) => (i === 0 ? "" : s.name)) : [""];
    for (const store of names) {
      for (const r of await api("/api/runs", { store: store })) {
        if (!r.metrics || (store === state.store && r.run_id === state.metricsRun)) continue;
        sel.appendChild(el("option", { value: JSON.stringify([store, r.run_id]) }, (store ? store + ": " : "") + r.run_id));
      }
    }
  }
  async function loadMetricsDiff() {
    const v = $("metrics-vs").value;
    if (!v) { await loadMetrics(state.metricsRun); return; }
    const [storeB, runB] = JSON.parse(v);
    let res;
    try {
      res = await api("/api/metrics_diff", { a: state.metricsRun, store_a: state.store, b: runB, store_b: storeB });
    } catch (e) { $("metrics-error").textContent = e.message; return; }
    $("metrics-error").textContent = "";
    $("metrics-title").textContent = `metrics: A = run ${state.metricsRun} (blue) vs B = run ${(storeB ? storeB + ": " : "") + runB} (orange)`;
    const host = $("metrics-plots"), body = $("metrics-diff").tBodies[0];
    clear(host); clear(body);
    $("metrics-diff").hidden = false;
    for (const r of res.metrics) {
      const tr = el("tr", { "data-metric": r.name });
      for (const v of [r.name, fmt(r.shared_step), fmt(r.a_value), fmt(r.b_value), fmt(r.delta)]) tr.appendChild(el("td", {}, v));
      body.appendChild(tr);
      host.appendChild(plot(r.name, [{ pts: r.a, color: "#1f77b4" }, { pts: r.b, color: "#ff7f0e" }]));
    }
    const modes = [...new Set([...res.heldout.a, ...res.heldout.b].map((h) => h.mode))];
    for (const mode of modes) {
      const series = [["a", "#1f77b4"], ["b", "#ff7f0e"]].map(([k, c]) => ({
        color: c, pts: res.heldout[k].filter((h) => h.mode === mode).map((h) => [h.step, h.rate]),
        bars: res.heldout[k].filter((h) => h.mode === mode).map((h) => [h.step, h.low, h.high]) }));
      const p = plot(`held-out ${mode}, 95% CI`, series);
      p.classList.add("heldout");
      p.appendChild(svg("title", {}, `held-out success (${mode}) per evaluation with 95% Wilson intervals`));
      host.appendChild(p);
    }
    $("metrics-section").scrollIntoView();
  }
  function plot(name, series) {
    const W = 260, H = 150, L = 44, B = 22, T = 18, R = 8;
    const all = series.flatMap((s) => s.pts), bars = series.flatMap((s) => s.bars || []);
    const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]).concat(bars.flatMap((b) => [b[1], b[2]]));
    let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
    const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - B - T);
    const s = svg("svg", { width: W, height: H, class: "plot", "data-metric": name });
    s.appendChild(svg("text", { x: L, y: 12, "font-weight": "bold" }, name));
    s.appendChild(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999" }));
    s.appendChild(svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#999" }));
    s.appendChild(svg("text", { x: L - 3, y: sy(y1) + 4, "text-anchor": "end" }, fmt(y1)));
    s.appendChild(svg("text", { x: L - 3, y: sy(y0) + 4, "text-anchor": "end" }, fmt(y0)));
    s.appendChild(svg("text", { x: L, y: H - 6 }, "step " + fmt(x0)));
    s.appendChild(svg("text", { x: W - R, y: H - 6, "text-anchor": "end" }, fmt(x1)));
    for (const ser of series) {
      s.appendChild(svg("polyline", { points: ser.pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "), fill: "none", stroke: ser.color, "stroke-width": 1.5, class: "curve" }));
      for (const p of ser.pts) s.appendChild(svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2, fill: ser.color }));
      for (const b of ser.bars || []) s.appendChild(svg("line", { x1: sx(b[0]), x2: sx(b[0]), y1: sy(b[1]), y2: sy(b[2]), stroke: ser.color, "stroke-width": 1, class: "interval" }));
    }
    return s;
  }

  // ---- stores, sibling diff, trajectories by step (issue 48)
  async function loadStores() {
    let stores = [];
    try { stores = await api("/api/stores"); } catch (e) { stores = []; }  // a one-store export
    state.stores = stores;
    const sel = $("store-select");
    clear(sel);
    stores.forEach((s, i) => sel.appendChild(el("option", { value: i === 0 ? "" : s.name }, s.name)));
    sel.hidden = stores.length < 2;
  }
  async function switchStore() {
    state.store = $("store-select").value;
    delete document.body.dataset.tree;
    state.run = null; state.selectedRun = null;
    $("tree-section").hidden = true; $("metrics-section").hidden = true; $("siblings-section").hidden = true;
    delete document.body.dataset.store;
    await loadSummary(); await loadRuns(); await loadTrees();
    document.body.dataset.store = state.store || "(first)";  // lists loaded
  }
  function segs(parent, segments) {  // an action as runs of matching / differing tokens
    for (const sg of segments) parent.appendChild(sg.diff ? el("span", { class: "dseg" }, sg.text) : document.createTextNode(sg.text));
  }
  function grid(host, columns, headOf, stepsOf, partsOf) {
    // rows are steps, columns are continuations: a CSS grid keeps one step on one row
    clear(host);
    const n = Math.max(0, ...columns.map((c) => stepsOf(c).length));
    host.style.gridTemplateColumns = `70px repeat(${columns.length}, minmax(240px, 1fr))`;
    const frag = document.createDocumentFragment();
    frag.appendChild(el("div", { class: "cell head rowlab" }, ""));
    columns.forEach((c, j) => { const h = el("div", { class: "cell head", "data-col": j }); headOf(h, c); frag.appendChild(h); });
    for (let i = 0; i < n; i++) {
      frag.appendChild(el("div", { class: "cell rowlab" }, `step ${i}`));
      columns.forEach((c, j) => {
        const s = stepsOf(c)[i], cell = el("div", { class: "cell step", "data-col": j, "data-step": i });
        if (s) {
          const [act, out] = partsOf(c);
          if (act === i) cell.classList.add("parts");
          const facts = [`node ${s.node}`, `${s.tokens} tokens`];
          if (s.reward !== null) facts.push(`reward ${fmt(s.reward)}`);
          for (const [m, v] of Object.entries(s.credit)) facts.push(`${m} ${fmt(v)}`);
          if (act === i) facts.push("actions part here");
          if (out === i) facts.push("outcomes part here");
          cell.appendChild(el("div", { class: "note" }, facts.join(" · ")));
          const pre = el("pre", { class: "action" });
          segs(pre, s.action);
          cell.appendChild(pre);
          if (s.observation) cell.appendChild(el("pre", { class: "observation" }, s.observation));
        }
        frag.appendChild(cell);
      });
    }
    host.appendChild(frag);
  }
  async function loadSiblings(ref) {
    const data = state.tree, node = state.node;
    const res = await api("/api/siblings", { tree: data.tree.tree_id, node: String(node), ref: ref ? String(ref) : "", store: data.store });
    const t0 = performance.now();
    state.siblings = res;
    $("siblings-section").hidden = false;
    $("siblings-title").textContent = `children of node ${res.node} (tree ${res.tree_id}), aligned at the branch point`;
    $("siblings-meta").textContent = `${res.columns.length}${res.n_children > res.columns.length ? " of " + res.n_children : ""} children · depth ${res.depth} · diffed against child ${res.reference} by ${res.unit} · first action difference at step ${fmt(res.first_action_difference)}, first outcome difference at step ${fmt(res.first_outcome_difference)}`;
    fillSelect($("siblings-ref"), res.columns.map((c) => String(c.child)), String(res.reference));
    grid($("siblings-grid"), res.columns, (h, c) => {
      h.dataset.child = c.child;
      h.appendChild(el("div", {}, `child ${c.child}`));
      const mc = c.mc.map((r) => `Mean@${r.k} ${fmt(r.mean)}`).join(", ");
      h.appendChild(el("div", { class: "note" }, `${c.leaves} leaves, ${c.successes} successes, mean reward ${fmt(c.reward)}` + (mc ? ` · ${mc}` : "")));
      const credit = Object.entries(c.credit).map(([m, v]) => `${m} ${fmt(v)}`).join(" · ");
      if (credit) h.appendChild(el("div", { class: "note credit" }, "credit " + credit));
      h.appendChild(el("div", { class: "note" }, c.action_parts_at === null ? "same actions as the reference" : `actions part at step ${c.action_parts_at}, outcomes at ${fmt(c.outcome_parts_at)}`));
    }, (c) => c.steps, (c) => [c.action_parts_at, c.outcome_parts_at]);
    document.body.dataset.siblingsMs = String(performance.now() - t0);
    $("siblings-section").scrollIntoView();
  }
  function drawBasket() {
    const host = $("basket");
    clear(host);
    for (const [i, p] of state.basket.entries()) {
      const li = el("li", { "data-i": i }, `${p[0] ? p[0] + ": " : ""}${p[1]} leaf ${p[2] === null ? "best" : p[2]}`);
      host.appendChild(li);
    }
    $("run-compare").disabled = state.basket.length < 2;
  }
  async function runCompare() {
    $("compare-error").textContent = "";
    let res;
    try { res = await api("/api/paths", { paths: JSON.stringify(state.basket) }); }
    catch (e) { $("compare-error").textContent = e.message; return; }
    $("paths-section").hidden = false;
    $("paths-title").textContent = `${res.columns.length} trajectories by step`;
    $("paths-meta").textContent = `diffed against the first by ${res.unit}; orange outline: the step where a trajectory's actions part from the first's`;
    grid($("paths-grid"), res.columns, (h, c) => {
      h.appendChild(el("div", {}, c.label));
      h.appendChild(el("div", { class: "note" }, `run ${c.run_id || "–"} · sampler ${c.sampler || "–"} · policy ${c.policy_version || "–"} · reward ${fmt(c.reward)}`));
      h.appendChild(el("div", { class: "note" }, c.action_parts_at === null ? "same actions as the first" : `actions part at step ${c.action_parts_at}, outcomes at ${fmt(c.outcome_parts_at)}`));
    }, (c) => c.steps, (c) => [c.action_parts_at, c.outcome_parts_at]);
    $("paths-section").scrollIntoView();
  }

  // ---- wiring
  window.RTREES = { state: state, api: api, openTree: openTree, selectNode: selectNode, TOKEN: TOKEN, loadSiblings: loadSiblings, runCompare: runCompare };
  document.addEventListener("DOMContentLoaded", async () => {
    $("filter-form").addEventListener("submit", (e) => { e.preventDefault(); loadTrees(); });
    // the access token has set its cookie: keep it out of the address bar and history
    if (!STATIC && new URLSearchParams(location.search).has("token")) history.replaceState(null, "", location.pathname);
    if (STATIC) { $("filter").disabled = true; $("apply-filter").disabled = true; $("filter").placeholder = "static export: no SQL filter"; }
    $("node-color").addEventListener("change", draw);
    $("token-color").addEventListener("change", drawTokens);
    $("compare-a").addEventListener("change", loadCompare);
    $("compare-b").addEventListener("change", loadCompare);
    $("store-select").addEventListener("change", switchStore);
    $("diff-siblings").addEventListener("click", () => loadSiblings(null));
    $("siblings-ref").addEventListener("change", () => loadSiblings($("siblings-ref").value));
    $("add-path").addEventListener("click", () => { state.basket.push([state.tree.store || null, state.tree.tree.tree_id, state.node]); drawBasket(); });
    $("clear-compare").addEventListener("click", () => { state.basket = []; drawBasket(); $("paths-section").hidden = true; });
    $("run-compare").addEventListener("click", runCompare);
    $("metrics-vs").addEventListener("change", loadMetricsDiff);
    try {
      await loadStores();
      await loadSummary();
      await loadRuns();
      await loadTrees();
      if (STATIC && staticKey("/api/view", {}) in STATIC) {  // rtrees compare --export
        state.basket = JSON.parse(STATIC[staticKey("/api/view", {})].paths);
        drawBasket();
        await runCompare();
      }
      document.body.dataset.ready = "1";
    } catch (e) { $("filter-error").textContent = e.message; }
  });
})();
