// SkyFed dashboard: pure functions that turn untrusted payload values into bounded plain text (the page writes
// it with textContent only). Every string is clipped and every list cut, so a hostile field cannot flood a cell.
"use strict";
window.skyfedFormat = (function () {
  const MAX_TEXT = 200;  // characters of one field (a name, a reason, a label)
  const MAX_ITEMS = 20;  // items of one list in one cell
  const BYTE_UNITS = ["B", "kB", "MB", "GB", "TB"];

  const num = (v) => (typeof v === "number" && isFinite(v)) ? v : null;
  function text(v, max) {
    const s = (v === undefined || v === null) ? "" : (typeof v === "object" ? "" : String(v));
    const limit = max || MAX_TEXT;
    return s.length > limit ? s.slice(0, limit - 1) + "…" : s;
  }
  function list(items, each, sep) {
    if (!Array.isArray(items)) return "";
    const shown = items.slice(0, MAX_ITEMS).map(each || ((v) => text(v))).join(sep || ", ");
    return items.length > MAX_ITEMS ? shown + " … +" + (items.length - MAX_ITEMS) + " more" : shown;
  }
  const fixed = (v, digits) => num(v) === null ? "–" : Number(v).toFixed(digits);

  // bytes: one unit per axis (the largest tick's), with the decimals the tick step needs, so 467,109 B reads
  // "467 kB" and ticks 25 B apart around it stay distinct and exact ("467.125 kB")
  const unitOf = (v) => v >= 1 ? Math.min(Math.floor(Math.log10(v) / 3), BYTE_UNITS.length - 1) : 0;
  function byteTicks(splits) {
    const finite = splits.filter((v) => num(v) !== null);
    if (!finite.length) return splits.map(() => "");
    const step = finite.length > 1 ? Math.abs(finite[1] - finite[0]) : 0;
    let k = unitOf(Math.max.apply(null, finite.map(Math.abs)));
    while (k > 0 && step > 0 && step / 1000 ** k < 0.001) k--;
    const scaled = step / 1000 ** k;
    let digits = 0;
    while (digits < 3 && Math.abs(Math.round(scaled * 10 ** digits) - scaled * 10 ** digits) > 1e-6) digits++;
    return splits.map((v) => num(v) === null ? "" : (v / 1000 ** k).toFixed(digits) + " " + BYTE_UNITS[k]);
  }
  function bytes(v) {  // one value, e.g. a table cell: three significant digits
    if (num(v) === null) return "–";
    const k = unitOf(Math.abs(v)), scaled = v / 1000 ** k;
    const digits = k === 0 ? 0 : Math.max(0, 2 - Math.floor(Math.log10(Math.abs(scaled))));
    return scaled.toFixed(digits) + " " + BYTE_UNITS[k];
  }

  // the scores a round is judged by (protocol/scores.py): [{key, label, value}, …], lead first; each as
  // "label value" (a table cell keeps one on a line and wraps between them), or all of them as one text
  function scoreParts(headline, width) {
    return (Array.isArray(headline) ? headline : []).slice(0, width || 3)
      .map((s) => text(s && s.label, 40) + " " + fixed(s && s.value, 4));
  }
  const scores = (headline, width) => scoreParts(headline, width).join(" · ");

  // what a strategy reports of who started from what (metrics.aggregation): swap pairs (FedSwap, SimFedSwap),
  // DemLearn's groups ({level, group, members, g_gen}) and FedAMN's clusters (lists of agents)
  function pair(p, similarity) {
    const names = Array.isArray(p) ? p.map((a) => text(a, 64)).join("↔") : text(p, 64);
    return num(similarity) === null ? names : names + " (" + fixed(similarity, 2) + ")";
  }
  function group(g) {
    if (Array.isArray(g)) return list(g, (a) => text(a, 64));
    if (!g || typeof g !== "object") return text(g, 64);
    const name = "group " + text(g.group, 16) + (num(g.level) === null ? "" : " (level " + g.level + ")");
    const score = num(g.g_gen) === null ? "" : ", G-GEN " + fixed(g.g_gen, 4);
    return name + ": " + list(g.members, (a) => text(a, 64)) + score;
  }
  function startsFrom(aggregation) {
    const a = (aggregation && typeof aggregation === "object") ? aggregation : {};
    const parts = [];
    if (Array.isArray(a.pairs)) {
      const similarity = Array.isArray(a.pair_similarity) ? a.pair_similarity : [];
      parts.push("pairs: " + list(a.pairs, (p, i) => pair(p, similarity[i])));
    }
    if (Array.isArray(a.groups)) {
      parts.push((a.reclustered === true ? "groups (reclustered): " : "groups: ") + list(a.groups, group, " | "));
    }
    if (Array.isArray(a.clusters)) parts.push("clusters: " + list(a.clusters, group, " | "));
    return parts.join("; ");
  }

  // a round's trained updates refused late or stale ({late: n, stale: n}), as one count
  function total(counts) {
    if (!counts || typeof counts !== "object") return 0;
    return Object.values(counts).reduce((sum, n) => sum + (num(n) === null ? 0 : Number(n)), 0);
  }

  return { num: num, text: text, list: list, fixed: fixed, byteTicks: byteTicks, bytes: bytes, scores: scores,
           scoreParts: scoreParts, startsFrom: startsFrom, total: total };
})();
