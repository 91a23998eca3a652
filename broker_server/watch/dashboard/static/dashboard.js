// SkyFed dashboard: subscribes to a federation's status, metrics and history topics over MQTT-over-WebSockets
// (a peer federation's peers: peers.js) and draws them. Every payload is untrusted text from the broker: parsed with JSON.parse inside try/catch,
// bounded in size, turned into clipped text by format.js and written with textContent only (never innerHTML).
// A message only updates state (O(log n) at most); the page is redrawn from that state at most every
// REDRAW_MS, and keeps at most MAX_ROUNDS rounds and MAX_AGENTS agent rows, so a flood cannot freeze it.
"use strict";
(function () {
  const F = window.skyfedFormat;
  const cfg = window.SKYFED_DASHBOARD;
  const prefix = "skyfed/" + cfg.federation;
  const TOPICS = [prefix + "/server/status", prefix + "/server/metrics", prefix + "/server/history",
                  prefix + "/agent/+/status", prefix + "/peer/+/member", prefix + "/peer/+/metrics",
                  prefix + "/peer/+/best"];
  const MAX_PAYLOAD = 256 * 1024;  // status and metrics are a few KiB; history is at most 64 KiB
  const MAX_AGENTS = 5000;
  const MAX_ROUNDS = 500;  // as many as the server's retained history holds (broker_server/watch/history.py)
  const REDRAW_MS = 250;
  // round -> what the page knows of it: from server/metrics (`live`: names and reasons) or from the retained
  // server/history (counts only); a live round is never replaced by the history's row of it
  const rounds = new Map();
  const order = [];  // the rounds kept, ascending: at most MAX_ROUNDS, the oldest dropped first
  const roundRows = new Map();  // round -> its <tr> in the rounds table
  const rowOrder = [];  // rounds with a <tr>, ascending (the table shows them newest first)
  const agents = new Map();  // agent id -> its <tr> (null until drawn): at most MAX_AGENTS
  const agentOrder = [];  // ids of the agent rows drawn, ascending, as they are in the table
  const agentShown = new Map();  // agent id -> the state its row shows (online, training, gated, offline)
  // what changed since the last draw: the latest server status, the rounds added or dropped, the latest status
  // per agent
  const pending = { server: null, rounds: new Set(), agents: new Map() };
  let server = null;  // the latest server status drawn
  let redrawTimer = null;
  let lastDraw = 0;
  const decoder = new TextDecoder();
  // a test hook and a debugging aid: what this page subscribed to (and at which QoS), how many messages it read
  // and dropped, how many headline scores it dropped as not the round's own, how many agent statuses it did not
  // show (ids beyond MAX_AGENTS) and how often it redrew
  const hook = window.skyfedDashboard = { subscribed: [], granted: [], messages: 0, dropped: 0, forged: 0,
                                          agentsNotShown: 0, draws: 0, rounds: rounds, charts: null };

  const $ = (id) => document.getElementById(id);
  const num = F.num, str = F.text;
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
    td.textContent = text === undefined || text === null ? "" : String(text);
    if (cls) td.className = cls;
    tr.appendChild(td);
    return td;
  }
  function span(text, cls) {
    const s = document.createElement("span");
    s.textContent = text;
    if (cls) s.className = cls;
    return s;
  }
  const clock = (t) => num(t) === null ? "" : new Date(t * 1000).toLocaleTimeString();
  const peers = window.skyfedPeers(F, cfg, cell);
  hook.peers = peers.hook;

  $("federation").textContent = cfg.federation;

  // charts ------------------------------------------------------------------------------------------
  const ROUND_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000];  // whole rounds on the x axis
  // As wide as its widest tick label, so none is clipped. uPlot sizes the axes again, up to three times, when the
  // plot's area moves, and the labels can change between passes: a later pass only widens (it settles, and covers
  // the labels drawn).
  function axisSize(u, values, axisIdx, cycleNum) {
    const axis = u.axes[axisIdx];
    u.ctx.font = axis.font[0];
    const widest = Math.max(0, ...(values || []).map((v) => u.ctx.measureText(String(v)).width / devicePixelRatio));
    const size = Math.ceil(axis.ticks.size + axis.gap + widest) + 4;
    return cycleNum > 1 ? Math.max(axis._size, size) : size;
  }
  const yAxis = (label, extra) => Object.assign({ label: label, size: axisSize }, extra || {});
  function chart(id, series, axes) {
    const el = $(id);
    const opts = { width: Math.max(el.clientWidth, 400), height: 240, scales: { x: { time: false } },
                   series: [{ label: "round" }].concat(series),
                   axes: [{ label: "round", incrs: ROUND_STEPS }].concat(axes) };
    return { el: el, plot: new uPlot(opts, [[]].concat(series.map(() => [])), el) };
  }
  function scoreChart(label) {  // made again when the lead score's label changes (it names a series and an axis)
    return chart("score-chart", [{ label: label, stroke: "#0550ae", width: 2, scale: "score" },
                                 { label: "loss", stroke: "#cf222e", width: 1, scale: "loss" }],
                 [yAxis(label, { scale: "score" }), yAxis("loss", { scale: "loss", side: 1, grid: { show: false } })]);
  }
  const byteSeries = (label, stroke, width) => ({ label: label, stroke: stroke, width: width,
                                                  value: (u, v) => F.bytes(v) });
  const charts = hook.charts = {
    score: scoreChart("score"),
    epsilon: chart("epsilon-chart", [{ label: "ε", stroke: "#8250df", width: 2 }], [yAxis("ε spent")]),
    bytes: chart("bytes-chart", [byteSeries("bytes up", "#1a7f37", 2), byteSeries("bytes down", "#9a6700", 1)],
                 [yAxis("bytes per round", { values: (u, splits) => F.byteTicks(splits) })]),
  };
  let leadLabel = "score";

  function drawCharts() {
    const kept = order.map((round) => rounds.get(round));
    if (kept.length) $("rounds-done").textContent = String(kept[kept.length - 1].round);
    // the lead score of the newest round that has one; rounds led by another score are not on its curve
    const newest = kept.slice().reverse().find((r) => r.headline.length);
    const lead = newest ? newest.headline[0] : null;
    const label = lead ? str(lead.label, 24) : "score";  // an axis title: short
    if (label !== leadLabel) {
      charts.score.plot.destroy();
      charts.score = scoreChart(label);
      leadLabel = label;
    }
    $("score-title").textContent = label + " / loss";
    const xs = kept.map((r) => r.round);
    const col = (key) => kept.map((r) => num(r[key]));
    const leadOf = (r) => (lead && r.headline.length && r.headline[0].key === lead.key)
      ? num(r.headline[0].value) : null;
    const data = {
      score: [xs, kept.map(leadOf), col("loss")],
      epsilon: [xs, col("epsilon")],
      bytes: [xs, col("bytes_up"), col("bytes_down")],
    };
    for (const name of Object.keys(charts)) {
      charts[name].plot.setData(data[name]);
      const points = data[name][1].filter((v) => v !== null).length;
      charts[name].el.setAttribute("data-points", String(points));
    }
  }

  // the server run of the rounds the page holds (metrics.run_id, the history's run_id): rounds of another run (a
  // server started over under this federation's name counts from 1 again) replace the last run's in the table and
  // the charts; a server that names no run leaves them as they are (as skyfed monitor)
  let runId = "";

  function noteRun(id) {
    if (typeof id !== "string" || !id || id === runId) return;
    if (runId) {
      for (const old of order) { rounds.delete(old); pending.rounds.add(old); }
      order.length = 0;
    }
    runId = id;
  }

  function addRound(entry) {
    const round = num(entry.round);
    if (round === null) return;
    const had = rounds.get(round);
    if (had && had.live && !entry.live) return;  // the history's row of a round the page saw live
    if (!had) {
      if (order.length >= MAX_ROUNDS && round < order[0]) return;  // older than every round kept
      order.splice(lowerBound(order, round), 0, round);
      if (order.length > MAX_ROUNDS) {
        const dropped = order.shift();
        rounds.delete(dropped);
        pending.rounds.add(dropped);
      }
    }
    entry.round = round;
    rounds.set(round, entry);
    pending.rounds.add(round);
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
    Object.assign(pending, { server: null, rounds: new Set(), agents: new Map() });
    if (work.server) server = work.server;
    if (work.rounds.size) drawCharts();
    for (const round of work.rounds) drawRound(round);
    for (const [id, status] of work.agents) drawAgent(id, status);
    if (work.server || work.agents.size) drawOnline();
    if (work.server) drawServerStatus(server);
    peers.draw($);
    // a peer federation (peers heard, no server status, no agent): the page shows its peers alone
    document.body.classList.toggle("peer-federation", peers.count() > 0 && server === null && !agentOrder.length);
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
    if (s.privacy && num(s.privacy.epsilon) !== null) $("epsilon").textContent = F.fixed(s.privacy.epsilon, 3);
    const buffer = (s.buffer && typeof s.buffer === "object") ? s.buffer : null;
    $("buffer-card").hidden = !buffer || num(buffer.size) === null;
    if (!$("buffer-card").hidden) {
      $("buffer").textContent = str(buffer.filled) + "/" + str(buffer.size) + " updates, " +
        str(buffer.in_flight) + " agents training, model v" + str(s.model_version);
    }
  }

  // "agents online" counts the rows shown online; the server's own count (of the statuses it accepted: it checks
  // their signatures and refuses replays, this page does not) stands beside it, and a running server that counts
  // otherwise is said in words rather than hidden
  function drawOnline() {
    let shown = 0;
    for (const state of agentShown.values()) if (state !== "offline") shown++;
    $("agents-online").textContent = String(shown);
    if (!server) return;
    const counted = num(server.agents_online);
    const running = str(server.state) === "running";
    $("server-online").textContent = counted === null ? "–" : String(counted);
    const dated = "as of " + clock(server.updated_at) + " (" + str(server.state, 40) + ")";
    $("server-online-note").textContent = running ? "" : dated;
    const note = $("online-mismatch");
    note.hidden = !(running && counted !== null && counted !== shown);
    if (!note.hidden) {
      note.textContent = "The server counts " + counted + " agents online, the agent rows show " + shown + ". The " +
        "rows are the statuses retained on the broker, which this page does not verify: one the server refused " +
        "(a replayed or stale status; its log says event=status-refused) or has not read yet may be shown. " +
        "The server's count is the checked one.";
    }
  }

  function drawRound(round) {
    const r = rounds.get(round);
    let tr = roundRows.get(round);
    if (!r) {  // dropped: older than the MAX_ROUNDS kept
      if (tr) { tr.remove(); roundRows.delete(round); rowOrder.splice(lowerBound(rowOrder, round), 1); }
      return;
    }
    if (!tr) {
      tr = document.createElement("tr");
      tr.setAttribute("data-round", String(round));
      const at = lowerBound(rowOrder, round);
      const tbody = $("updates").tBodies[0];
      tbody.insertBefore(tr, tbody.rows[rowOrder.length - at] || null);  // newest first
      rowOrder.splice(at, 0, round);
      roundRows.set(round, tr);
    }
    tr.replaceChildren();
    tr.className = r.live ? "live" : "history";
    cell(tr, round, "words");
    const outcome = cell(tr, str(r.outcome, 40), "words");
    if (r.reason) outcome.append(": ", span(str(r.reason), "free"));
    outcome.append((num(r.staleness) === null ? "" : "; staleness " + F.fixed(r.staleness, 2)) +  // asynchronous
      (num(r.lost) ? "; lost " + r.lost + " late or stale" : ""));
    const scores = cell(tr, "", "scores");
    F.scoreParts(r.headline, 6).forEach((part, i) => scores.append(i ? " · " : "", span(part)));
    if (r.headline.length) scores.setAttribute("data-lead", str(r.headline[0].label, 40));
    if (r.live) {
      cell(tr, F.list(r.accepted));
      cell(tr, F.list(r.rejected, (x) => str(x && x.agent, 64) + " (" + str(x && x.reason) + ")"));
    } else {  // the retained history keeps counts only
      cell(tr, num(r.accepted) === null ? "" : r.accepted + " agents");
      cell(tr, num(r.rejected) === null ? "" : String(r.rejected));
    }
    cell(tr, F.bytes(r.bytes_up) + " / " + F.bytes(r.bytes_down), "words");
    cell(tr, r.live ? F.startsFrom(r.aggregation) : "");
  }

  function agentState(a) {
    const state = str(a.state, 40);
    if (state === "offline") return ["offline", str(a.detail)];
    const gate = a.gate && typeof a.gate === "object" ? a.gate : {};
    if (gate.ok === false) return ["gated", Array.isArray(gate.reasons) ? F.list(gate.reasons) : str(a.detail)];
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
    agentShown.set(id, state);
    tr.replaceChildren();
    tr.className = state;
    cell(tr, str(id, 64));
    cell(tr, state, "state-" + state).setAttribute("data-state", state);
    cell(tr, reason);
    cell(tr, str(a.round));
    cell(tr, str(a.last_completed_round));
    cell(tr, clock(a.updated_at));
  }

  // handlers: each only updates state and schedules a draw -----------------------------------------
  // a sent headline less any score that is not the round's own number for its key: a reader never shows a lead
  // the round does not hold (docs/architecture.md, "One headline per shape and kind of model")
  // where a round holds the number of headline key ``key`` (protocol/scores.py's personal_score)
  function heldScore(m, key) {
    const personal = (m.personal && typeof m.personal === "object") ? m.personal : {};
    const trained = (personal.trained && typeof personal.trained === "object") ? personal.trained : {};
    if (key.startsWith("trained_")) return trained[key.slice("trained_".length)];
    return ((key === "c_spe" || key === "c_gen") ? personal : (m.eval || {}))[key];
  }

  function checkedHeadline(m) {
    const given = Array.isArray(m.headline) ? m.headline : [];
    const own = (s) => s && typeof s === "object" && num(s.value) !== null && typeof s.key === "string" &&
      heldScore(m, s.key) === s.value;
    const kept = given.filter(own);
    hook.forged += given.length - kept.length;
    return kept;
  }

  function onMetrics(m) {
    // a round's metrics as skyfed monitor takes them (protocol.messages.RoundMetrics): a schema and a whole round
    if (typeof m.schema !== "string" || !m.schema.startsWith("skyfed.metrics/") || !Number.isInteger(m.round)) {
      hook.dropped++;
      return;
    }
    const evaluation = (m.eval && typeof m.eval === "object") ? m.eval : {};
    noteRun(m.run_id);
    addRound({ live: true, round: m.round, headline: checkedHeadline(m),
               loss: evaluation.loss, epsilon: m.privacy && m.privacy.epsilon, bytes_up: m.bytes_up,
               bytes_down: m.bytes_down, outcome: m.outcome, reason: m.reason, accepted: m.accepted, rejected: m.rejected,
               aggregation: m.aggregation, staleness: m.buffer && m.buffer.staleness_mean,
               lost: F.total(m.wasted) });
  }

  // the history's rows name their scores [[key, value], …] and its `labels` says once what each key is called
  // (broker_server/watch/history.py); a row of an older server has only `score`
  function historyHeadline(row, labels) {
    if (!Array.isArray(row.headline)) {
      return num(row.score) === null ? [] : [{ key: "score", label: "score", value: row.score }];
    }
    return row.headline.filter((s) => Array.isArray(s) && typeof s[0] === "string" && num(s[1]) !== null)
      .map((s) => ({ key: s[0], label: Object.hasOwn(labels, s[0]) ? labels[s[0]] : s[0], value: s[1] }));
  }

  function onHistory(h) {
    if (!Array.isArray(h.rounds)) return;
    const labels = (h.labels && typeof h.labels === "object") ? h.labels : {};
    const rows = h.rounds.filter((row) => row && typeof row === "object" && Number.isInteger(row.round) &&
      typeof row.outcome === "string");  // the rows skyfed monitor takes (broker_server/watch/history.py)
    noteRun(h.run_id);
    for (const row of rows) {
      const headline = historyHeadline(row, labels);
      addRound({ live: false, round: row.round, headline: headline, loss: row.loss,
                 epsilon: row.epsilon, bytes_up: row.bytes_up, bytes_down: row.bytes_down, outcome: row.outcome,
                 accepted: row.accepted, rejected: row.rejected, staleness: row.staleness, lost: row.lost });
    }
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
      else if (parts.length === 3 && parts[0] === "peer") peers.onMessage(parts[1], parts[2], body);
      else { hook.dropped++; return; }
    }
    scheduleDraw();
  }

  // connection --------------------------------------------------------------------------------------
  const host = cfg.ws_host || window.location.hostname;
  const hostPort = (host.includes(":") ? "[" + host + "]" : host) + ":" + cfg.ws_port;
  const url = (cfg.tls ? "wss://" : "ws://") + hostPort + cfg.ws_path;
  const client = mqtt.connect(url, {
    clientId: "skyfed-dashboard-" + Math.random().toString(16).slice(2, 10),
    clean: true, reconnectPeriod: 3000, connectTimeout: 10000, protocolVersion: 4,
  });
  const status = (text) => { $("connection").textContent = text; };
  // what to do when the broker cannot be reached: over wss://, Chromium offers the client certificate to a
  // WebSocket only once the user has picked it for that host and port in a tab (docs/dashboard.md)
  function explainFailure() {
    const help = $("connection-help");
    const link = document.createElement("a");
    if (cfg.tls) {
      const visit = "https://" + hostPort + "/";
      link.href = visit;
      link.target = "_blank";
      link.rel = "noopener noreferrer";
      link.textContent = visit;
      help.replaceChildren("Cannot connect to the broker at " + url + ". A browser offers the dashboard " +
        "certificate to it only after you chose that certificate for this address once: open ", link,
        " in a new tab, pick the dashboard certificate (Firefox: tick “Remember this decision”; the tab then " +
        "shows an error or an empty page, that is expected) and come back: this page retries every 3 s. If no " +
        "certificate is offered, import dashboard.p12 and trust ca.crt first (docs/dashboard.md).");
    } else {
      help.replaceChildren("Cannot connect to the broker's WebSockets listener at " + url + ": check that the " +
        "broker is running with that listener and that --ws-host and --ws-port name it (docs/dashboard.md).");
    }
    help.hidden = false;
  }
  client.on("connect", () => {
    $("connection-help").hidden = true;
    status("connected");
    // QoS 1: a round's metrics are not dropped on the way to the page (the server publishes them at QoS 1)
    client.subscribe(TOPICS, { qos: 1 }, (err, granted) => {
      if (err) { status("subscribe failed: " + str(err.message)); return; }
      hook.granted = (granted || []).filter((g) => g.qos !== 128);
      hook.subscribed = hook.granted.map((g) => g.topic);
    });
  });
  client.on("reconnect", () => { status("reconnecting"); explainFailure(); });
  client.on("offline", () => status("offline"));
  client.on("error", (err) => status("error: " + str(err && err.message)));
  client.on("message", (topic, payload) => {
    try { onMessage(topic, payload); } catch (e) { hook.dropped++; }
  });
})();
