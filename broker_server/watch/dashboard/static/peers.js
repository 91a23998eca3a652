// SkyFed dashboard: a peer federation's peers (docs/architecture.md, "Peer mode"), one row each, from their
// retained signed `member`, `metrics` and `best` (with, once a peer elected, the model it adopted). Shown as each
// peer claims them: the page checks no signatures, and counts how many peers adopted the same model rather than
// trusting one (as skyfed monitor does, broker_server/watch/monitor_view.py `elected`). Every value is clipped text
// (format.js), written with textContent only; at most MAX_PEERS rows.
"use strict";
window.skyfedPeers = function (F, cfg, cell) {
  const MAX_PEERS = 1000;
  const peers = new Map();  // peer id -> {member, metrics, best}: the newest of each it claimed
  const hook = { notShown: 0, refused: 0 };
  let changed = false;
  const str = F.text, num = F.num;
  const short = (sha) => str(sha, 64).slice(0, 12);  // a model fingerprint, as skyfed monitor shortens it
  // the lead score of a peer's round: the first of the keys peers elect by (protocol.messages.HEADLINE), with its
  // label (protocol/scores.py), both handed to the page in config.js
  const LEAD = Array.isArray(cfg.peer_scores) ? cfg.peer_scores : [];

  function older(m, held) {  // protocol/peer_messages.py `older`: a replayed membership does not replace a newer
    if (m.state === "left") return num(m.session) !== null && m.session < held.session;
    return m.session < held.session || (m.session === held.session && m.issued_at < held.issued_at);
  }

  // one message under peer/<id>/<leaf> (the page subscribes to these three leaves only); a body naming another
  // peer or federation is counted, not shown (skyfed monitor and the peers refuse it too), as is an id beyond
  // MAX_PEERS; a replayed older membership leaves the newer one
  function onMessage(peer, leaf, body) {
    const federation = leaf === "metrics" ? cfg.federation : body.federation;
    if (body.peer !== peer || federation !== cfg.federation) { hook.refused++; return; }
    if (!peers.has(peer)) {
      if (peers.size >= MAX_PEERS) { hook.notShown++; return; }
      peers.set(peer, {});
    }
    const held = peers.get(peer);
    if (leaf === "member" && held.member && older(body, held.member)) return;
    held[leaf] = body;
    changed = true;
  }

  function decision(p) {  // what it says it adopted, in its current (or last) membership only
    const a = p.best && p.best.adopted;
    const own = p.member && p.best && p.member.session === p.best.session;
    return own && a && typeof a === "object" && typeof a.sha256 === "string" && a.sha256 ? a : null;
  }

  function elected() {  // the (owner, model) most peers adopted, ties to the smaller owner id
    const votes = new Map();
    let decided = 0;
    for (const p of peers.values()) {
      const a = decision(p);
      if (!a) continue;
      const key = JSON.stringify([str(a.owner, 64), a.sha256]);
      votes.set(key, (votes.get(key) || 0) + 1);
      decided++;
    }
    let best = null;
    for (const [key, count] of votes) {
      if (!best || count > best.count || (count === best.count && key < best.key)) best = { key: key, count: count };
    }
    if (!best) return null;
    const [owner, sha256] = JSON.parse(best.key);
    return { owner: owner, sha256: sha256, adopters: best.count, decided: decided };
  }

  function lead(evaluation) {
    const e = evaluation && typeof evaluation === "object" ? evaluation : {};
    const hit = LEAD.find((k) => Array.isArray(k) && num(e[k[0]]) !== null);
    return hit ? str(hit[1], 40) + " " + F.fixed(e[hit[0]], 4) : "";
  }

  // the mean C-SPE the round's senders reported of the models they trained (flcore/personal.py claimed_personal)
  function trainedCSpe(r) {
    const p = r && r.personal && typeof r.personal === "object" ? r.personal : {};
    const t = p.trained && typeof p.trained === "object" ? p.trained : {};
    return num(t.c_spe) !== null ? F.fixed(t.c_spe, 4) : "";
  }

  function state(m) {
    if (!m) return "";
    const gate = m.gate && typeof m.gate === "object" ? m.gate : {};
    const blocked = gate.ok === false ? ", gate blocked: " + F.list(gate.reasons) : "";
    return str(m.state, 40) + blocked;
  }

  function row(tbody, id, p, chosen) {
    const tr = document.createElement("tr");
    tr.setAttribute("data-peer", id);
    const m = p.member, r = p.metrics, b = p.best, a = decision(p);
    cell(tr, str(id, 64));
    cell(tr, state(m), "peer-state");
    cell(tr, m ? str(m.round) : "");
    const last = r ? str(r.round) + (r.outcome && r.outcome !== "aggregated" ? " (" + str(r.outcome, 40) + ": " +
      str(r.reason) + ")" : "") : "";
    cell(tr, last);
    cell(tr, r ? lead(r.eval) : "", "scores");
    cell(tr, trainedCSpe(r), "trained");
    cell(tr, r && Array.isArray(r.aggregated_from) ? String(r.aggregated_from.length) : "");
    cell(tr, r && Array.isArray(r.rejected) ? String(r.rejected.length) : "");
    const claim = b ? F.fixed(b.score, 4) + " (" + short(b.sha256) + ")" : "";
    const mark = chosen && b && chosen.owner === id
      ? "◀ elected by " + chosen.adopters + " of " + chosen.decided + " peers" : "";
    cell(tr, claim + (mark ? " " + mark : ""), "claim").setAttribute("data-elected", mark ? "yes" : "no");
    if (mark) tr.className = "elected";
    cell(tr, a ? str(a.owner, 64) + "'s (" + short(a.sha256) + "), " + F.fixed(a.score, 4) + " here" : "");
    tbody.appendChild(tr);
  }

  function draw($) {
    if (!changed) return;
    changed = false;
    $("peers-section").hidden = false;
    const chosen = elected();
    const tbody = $("peers").tBodies[0];
    tbody.replaceChildren();
    for (const id of Array.from(peers.keys()).sort()) row(tbody, id, peers.get(id), chosen);
    $("peers-elected").textContent = chosen
      ? "Elected: " + chosen.owner + "'s model (" + short(chosen.sha256) + "), adopted by " + chosen.adopters +
        " of the " + chosen.decided + " peers that published their decision (each peer's own claim)."
      : "No peer has published its election decision yet.";
    const capped = $("peers-capped");
    capped.hidden = !hook.notShown;
    capped.textContent = "Showing the first " + MAX_PEERS + " peer ids heard from only: " + hook.notShown +
      " messages from further ids were not shown.";
  }

  return { onMessage: onMessage, draw: draw, hook: hook, count: () => peers.size };
};
