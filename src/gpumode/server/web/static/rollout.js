// Follows a rollout live (live.js): the server sends the rollout view each time a host's job moves; this
// script paints it (the same view the page was rendered from).
"use strict";

(function () {
  const root = document.getElementById("rollout");
  if (!root || root.dataset.active !== "yes") return;
  const id = root.dataset.rollout;

  const { el, badge, finish, follow } = window.gpumodeLive;

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
    if (!view.active) finish(root);
  }

  follow(root, "/ui/rollouts/" + id + "/stream", paint);
})();
