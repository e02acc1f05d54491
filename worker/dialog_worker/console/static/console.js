// Live numbers on the overview: short polling of /api/overview. Values are written with
// textContent only, so nothing read from Redis is ever parsed as HTML.
"use strict";
(function () {
  const live = document.querySelector("[data-poll]");
  if (!live) return;
  const url = live.getAttribute("data-poll");
  const every = Number(live.getAttribute("data-interval-ms")) || 2000;
  const updated = document.getElementById("updated-at");

  function show(value) {
    return value === null || value === undefined ? "—" : String(value);
  }

  // rows: arrays of cells; `classes` (optional): each row's class name ("" for none).
  function fillRows(tbody, rows, empty, classes) {
    while (tbody.firstChild) tbody.removeChild(tbody.firstChild);
    if (rows.length === 0) {
      const tr = document.createElement("tr");
      tr.className = "empty";
      const td = document.createElement("td");
      td.colSpan = tbody.parentElement.querySelectorAll("thead th").length || 1;
      td.textContent = empty;
      tr.appendChild(td);
      tbody.appendChild(tr);
      return;
    }
    for (const [i, cells] of rows.entries()) {
      const tr = document.createElement("tr");
      if (classes && classes[i]) tr.className = classes[i];
      for (const cell of cells) {
        const td = document.createElement("td");
        td.textContent = show(cell);
        tr.appendChild(td);
      }
      tbody.appendChild(tr);
    }
  }

  async function poll() {
    try {
      const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
      if (!response.ok) throw new Error(String(response.status));
      const data = await response.json();
      for (const h of data.headline) {
        const el = live.querySelector('[data-stat="' + CSS.escape(h.key) + '"]');
        if (el) el.textContent = show(h.value);
      }
      for (const [key, value] of Object.entries(data.stats)) {
        const el = document.querySelector('[data-stat-all="' + CSS.escape(key) + '"]');
        if (el) el.textContent = show(value);
      }
      const workers = document.querySelector("#workers tbody");
      if (workers) {
        fillRows(workers, data.workers.map((w) => [
          w.name, w.shard, w.idle_ms === null ? "–" : (w.idle_ms / 1000).toFixed(1), w.pending,
          w.waiting ? "waiting for messages" : (w.gone ? "gone: stopped or died" : "")]),
          "No worker has read the stream yet.",
          data.workers.map((w) => (w.gone ? "gone" : "")));
      }
      const lags = document.querySelector("#reply-lag tbody");
      if (lags) {
        fillRows(lags, Object.entries(data.reply_group_lag), "No consumer group reads the reply stream.");
      }
      if (updated) {
        updated.textContent = new Date(data.at_ms).toISOString().replace("T", " ").slice(0, 19) + " UTC";
        updated.setAttribute("data-at-ms", String(data.at_ms));
      }
      live.classList.remove("stale");
    } catch (err) {
      live.classList.add("stale");
      if (updated) updated.textContent = "not updated (" + err.message + ")";
    }
  }

  setInterval(poll, every);
  poll();
})();
