// Follows a rollout live: the server sends the rollout view over server-sent events each time a host's job
// moves; this script only paints what it is sent (the same view the page was rendered from). No reload.
"use strict";

(function () {
  const root = document.getElementById("rollout");
  if (!root || root.dataset.active !== "yes") return;
  const id = root.dataset.rollout;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }

  function badge(state) {
    return el("span", "state state-" + state, state.replace(/_/g, " "));
  }

  function paint(view) {
    const s = document.getElementById("rollout-state");
    s.className = "state state-" + view.state;
    s.textContent = view.state.replace(/_/g, " ");
    document.getElementById("failures").textContent = view.failures;
    if (view.finished_at) document.getElementById("finished").textContent = "finished";
    for (const cell of document.querySelectorAll("[data-count]")) {
      cell.textContent = view.counts[cell.dataset.count] || 0;
    }
    for (const n of view.nodes) {
      const row = document.querySelector('tr[data-node="' + CSS.escape(n.node) + '"]');
      if (!row) continue;
      const job = row.querySelector(".member-job");
      if (n.job) {
        const link = el("a", "", "job " + n.job);
        link.href = "/ui/jobs/" + n.job;
        job.replaceChildren(link);
      }
      row.querySelector(".member-state").replaceChildren(badge(n.state));
      row.querySelector(".member-error").replaceChildren(n.error ? el("span", "bad-text", n.error) : "");
    }
    if (!view.active) {
      document.getElementById("live").classList.add("hidden");
      root.dataset.active = "no";
    }
  }

  const source = new EventSource("/ui/rollouts/" + id + "/stream");
  source.onmessage = function (message) { paint(JSON.parse(message.data)); };
  source.addEventListener("end", function () { source.close(); });
  // EventSource reconnects by itself after a network error; a finished rollout needs no reconnecting.
  source.onerror = function () { if (root.dataset.active === "no") source.close(); };
})();
