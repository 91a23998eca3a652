// SkyFed dashboard: subscribes to a federation's status, metrics and history topics over MQTT-over-WebSockets
// and draws them. Every payload is untrusted text from the broker: parsed with JSON.parse inside try/catch,
// bounded in size, and written to the page with textContent only (never innerHTML). A message only updates
// state (O(log n) at most); the page is redrawn from that state at most every REDRAW_MS, and keeps at most
// MAX_ROUNDS rounds and MAX_AGENTS agent rows, so a flood of messages cannot freeze it.
"use strict";
(function () {
  const cfg = window.SKYFED_DASHBOARD;
  const prefix = "skyfed/" + cfg.federation;
  const TOPICS = [prefix + "/server/status", prefix + "/server/metrics", prefix + "/server/history",
                  prefix + "/agent/+/status"];
  const MAX_PAYLOAD = 256 * 1024;  // status and metrics are a few KiB; history is at most 64 KiB
  const MAX_UPDATE_ROWS = 50;
  const MAX_AGENTS = 5000;
  const MAX_ROUNDS = 500;  // as many as the server's retained history holds (broker_server/history.py)
  const REDRAW_MS = 250;
  const rounds = new Map();  // round -> {round, score, loss, epsilon, bytes_up, bytes_down}
  const order = [];  // the rounds kept, ascending: at most MAX_ROUNDS, the oldest dropped first
  const agents = new Map();  // agent id -> its <tr> (null until drawn): at most MAX_AGENTS
  const agentOrder = [];  // ids of the agent rows drawn, ascending, as they are in the table
  // what changed since the last draw: the latest server status, the newest metrics, the latest status per agent
  const pending = { server: null, charts: false, updates: [], agents: new Map() };
  let scoreKey = "accuracy";
  let redrawTimer = null;
  let lastDraw = 0;
  const decoder = new TextDecoder();
  // a test hook and a debugging aid: what this page subscribed to, how many messages it read and dropped,
  // how many agent statuses it did not show (ids beyond MAX_AGENTS) and how often it redrew
  const hook = window.skyfedDashboard = { subscribed: [], messages: 0, dropped: 0, agentsNotShown: 0, draws: 0,
                                          rounds: rounds };

  const $ = (id) => document.getElementById(id);
  const num = (v) => (typeof v === "number" && isFinite(v)) ? v : null;
  const str = (v) => (v === undefined || v === null) ? "" : String(v);
  const fmt = (v, digits) => num(v) === null ? "–" : Number(v).toFixed(digits);
  function lowerBound(sorted, value) {  // the index of the first element >= value
    let lo = 0, hi = sorted.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (sorted[mid] < value) lo = mid + 1; else hi = mid;
    }
    return lo;
  }
  function cell(tr, text, cls) {
    const td = document.createElement("td");
    td.textContent = str(text);
    if (cls) td.className = cls;
    tr.appendChild(td);
    return td;
  }

  $("federation").textContent = cfg.federation;

  // charts ------------------------------------------------------------------------------------------
  const ROUND_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000];  // whole rounds on the x axis
  function chart(id, series, axes) {
    const el = $(id);
    const opts = { width: Math.max(el.clientWidth, 400), height: 220, scales: { x: { time: false } },
                   series: [{ label: "round" }].concat(series),
                   axes: [{ incrs: ROUND_STEPS }].concat(axes || [{}]) };
    return { el: el, plot: new uPlot(opts, [[]].concat(series.map(() => [])), el) };
  }
  const charts = {
    score: chart("score-chart", [{ label: "score", stroke: "#0550ae", width: 2, scale: "score" },
                                 { label: "loss", stroke: "#cf222e", width: 1, scale: "loss" }],
                 [{ scale: "score" }, { scale: "loss", side: 1, grid: { show: false } }]),
    epsilon: chart("epsilon-chart", [{ label: "ε", stroke: "#8250df", width: 2 }]),
    bytes: chart("bytes-chart", [{ label: "bytes up", stroke: "#1a7f37", width: 2 },
                                 { label: "bytes down", stroke: "#9a6700", width: 1 }]),
  };
  function drawCharts() {
    const rows = order.map((round) => rounds.get(round));
    if (rows.length) $("rounds-done").textContent = str(rows[rows.length - 1].round);
    $("score-title").textContent = (scoreKey === "map50" ? "mAP@.5" : "accuracy") + " / loss";
    const xs = rows.map((r) => r.round);
    const col = (key) => rows.map((r) => num(r[key]));
    const data = {
      score: [xs, col("score"), col("loss")],
      epsilon: [xs, col("epsilon")],
      bytes: [xs, col("bytes_up"), col("bytes_down")],
    };
    for (const name of Object.keys(charts)) {
      charts[name].plot.setData(data[name]);
      const points = data[name][1].filter((v) => v !== null).length;
      charts[name].el.setAttribute("data-points", String(points));
    }
  }

  function addRow(row) {
    const round = num(row.round);
    if (round === null) return;
    if (!rounds.has(round)) {
      if (order.length >= MAX_ROUNDS && round < order[0]) return;  // older than every round kept
      order.splice(lowerBound(order, round), 0, round);
      if (order.length > MAX_ROUNDS) rounds.delete(order.shift());
    }
    pending.charts = true;
    rounds.set(round, {
      round: round, score: num(row.score), loss: num(row.loss), epsilon: num(row.epsilon),
      bytes_up: num(row.bytes_up), bytes_down: num(row.bytes_down),
    });
  }

  // drawing: at most once per REDRAW_MS, from what the handlers below left in `pending` -------------------
  function scheduleDraw() {
    if (redrawTimer === null) redrawTimer = setTimeout(draw, Math.max(0, lastDraw + REDRAW_MS - performance.now()));
  }

  function draw() {
    redrawTimer = null;
    lastDraw = performance.now();
    hook.draws++;
    const work = Object.assign({}, pending);  // taken first: a status that fails to draw is not redrawn forever
    Object.assign(pending, { server: null, charts: false, updates: [], agents: new Map() });
    if (work.server) drawServerStatus(work.server);
    if (work.charts) drawCharts();
    drawUpdates(work.updates);
    for (const [id, status] of work.agents) drawAgent(id, status);
    if (hook.agentsNotShown) {
      const note = $("agents-capped");
      note.hidden = false;
      note.textContent = "Showing the first " + MAX_AGENTS + " agent ids only: " + hook.agentsNotShown +
        " statuses from further ids were not shown.";
    }
  }

  function drawServerStatus(s) {
    $("round").textContent = str(s.round);
    $("phase").textContent = str(s.phase);
    $("server-state").textContent = str(s.state) + (s.detail ? " (" + str(s.detail) + ")" : "");
    $("strategy").textContent = str(s.strategy);
    $("agents-online").textContent = str(s.agents_online);
    if (s.privacy && num(s.privacy.epsilon) !== null) $("epsilon").textContent = fmt(s.privacy.epsilon, 3);
  }

  function headline(evaluation) {
    if (!evaluation || typeof evaluation !== "object") return null;
    for (const key of ["accuracy", "map50"]) {
      if (num(evaluation[key]) !== null) {
        scoreKey = key;
        return evaluation[key];
      }
    }
    return null;
  }

  function swaps(aggregation) {
    if (!aggregation || typeof aggregation !== "object") return "";
    const list = (v) => Array.isArray(v) ? v.map((g) => Array.isArray(g) ? g.map(str).join("↔") : str(g)) : [];
    if (Array.isArray(aggregation.pairs)) return list(aggregation.pairs).join(", ");
    if (aggregation.groups !== undefined) {
      return Array.isArray(aggregation.groups) ? list(aggregation.groups).join(" | ") : JSON.stringify(aggregation.groups);
    }
    return "";
  }

  function drawUpdates(list) {  // the newest metrics first, at most MAX_UPDATE_ROWS rows
    const tbody = $("updates").tBodies[0];
    for (const m of list) {
      const tr = document.createElement("tr");
      tr.setAttribute("data-round", str(m.round));
      cell(tr, m.round);
      cell(tr, str(m.outcome) + (m.reason ? ": " + str(m.reason) : ""));
      cell(tr, Array.isArray(m.accepted) ? m.accepted.map(str).join(", ") : "");
      const rejected = Array.isArray(m.rejected) ? m.rejected : [];
      cell(tr, rejected.map((r) => str(r && r.agent) + " (" + str(r && r.reason) + ")").join(", "));
      cell(tr, swaps(m.aggregation));
      tbody.insertBefore(tr, tbody.firstChild);
    }
    while (tbody.rows.length > MAX_UPDATE_ROWS) tbody.deleteRow(-1);
  }

  function agentState(a) {
    const state = str(a.state);
    if (state === "offline") return ["offline", str(a.detail)];
    const gate = a.gate && typeof a.gate === "object" ? a.gate : {};
    if (gate.ok === false) {
      return ["gated", Array.isArray(gate.reasons) ? gate.reasons.map(str).join(", ") : str(a.detail)];
    }
    return [state === "training" ? "training" : "online", state + (a.detail ? ": " + str(a.detail) : "")];
  }

  function drawAgent(id, a) {
    let tr = agents.get(id);
    if (!tr) {
      tr = document.createElement("tr");
      tr.setAttribute("data-agent", id);
      agents.set(id, tr);
      const at = lowerBound(agentOrder, id);
      agentOrder.splice(at, 0, id);
      const tbody = $("agents").tBodies[0];
      tbody.insertBefore(tr, tbody.rows[at] || null);
    }
    const [state, reason] = agentState(a);
    tr.replaceChildren();
    tr.className = state;
    cell(tr, id);
    cell(tr, state, "state-" + state).setAttribute("data-state", state);
    cell(tr, reason);
    cell(tr, a.round);
    cell(tr, a.last_completed_round);
    cell(tr, num(a.updated_at) === null ? "" : new Date(a.updated_at * 1000).toLocaleTimeString());
  }

  // handlers: each only updates state and schedules a draw -----------------------------------------
  function onMetrics(m) {
    const evaluation = (m.eval && typeof m.eval === "object") ? m.eval : {};
    addRow({ round: m.round, score: headline(evaluation), loss: evaluation.loss,
             epsilon: m.privacy && m.privacy.epsilon, bytes_up: m.bytes_up, bytes_down: m.bytes_down });
    pending.updates.push(m);
    if (pending.updates.length > MAX_UPDATE_ROWS) pending.updates.shift();
  }

  function onHistory(h) {
    if (!Array.isArray(h.rounds)) return;
    for (const row of h.rounds) if (row && typeof row === "object") addRow(row);
  }

  function onAgentStatus(id, a) {
    if (!agents.has(id)) {
      if (agents.size >= MAX_AGENTS) { hook.agentsNotShown++; return; }
      agents.set(id, null);
    }
    pending.agents.set(id, a);
  }

  function onMessage(topic, payload) {
    hook.messages++;
    if (payload.length === 0 || payload.length > MAX_PAYLOAD) { hook.dropped++; return; }
    let doc;
    try { doc = JSON.parse(decoder.decode(payload)); } catch (e) { hook.dropped++; return; }
    if (!doc || typeof doc !== "object") { hook.dropped++; return; }
    // agent statuses are signed documents {body, signer, signature}: shown as claimed, not verified here
    const body = (doc.body && typeof doc.body === "object") ? doc.body : doc;
    const rest = topic.slice(prefix.length + 1);
    if (rest === "server/status") pending.server = body;
    else if (rest === "server/metrics") onMetrics(body);
    else if (rest === "server/history") onHistory(body);
    else {
      const parts = rest.split("/");
      if (parts.length === 3 && parts[0] === "agent" && parts[2] === "status") onAgentStatus(parts[1], body);
      else { hook.dropped++; return; }
    }
    scheduleDraw();
  }

  // connection --------------------------------------------------------------------------------------
  const host = cfg.ws_host || window.location.hostname;
  const url = (cfg.tls ? "wss://" : "ws://") + host + ":" + cfg.ws_port + cfg.ws_path;
  const client = mqtt.connect(url, {
    clientId: "skyfed-dashboard-" + Math.random().toString(16).slice(2, 10),
    clean: true, reconnectPeriod: 3000, connectTimeout: 10000, protocolVersion: 4,
  });
  const status = (text) => { $("connection").textContent = text; };
  client.on("connect", () => {
    status("connected");
    client.subscribe(TOPICS, { qos: 0 }, (err, granted) => {
      if (err) { status("subscribe failed: " + str(err.message)); return; }
      hook.subscribed = (granted || []).filter((g) => g.qos !== 128).map((g) => g.topic);
    });
  });
  client.on("reconnect", () => status("reconnecting"));
  client.on("offline", () => status("offline"));
  client.on("error", (err) => status("error: " + str(err && err.message)));
  client.on("message", (topic, payload) => {
    try { onMessage(topic, payload); } catch (e) { hook.dropped++; }
  });
})();
