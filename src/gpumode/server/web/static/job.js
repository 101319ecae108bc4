// Follows a switch job live (live.js): the server sends the job view and the node's cards each time they
// change; this script paints them.
"use strict";

(function () {
  const root = document.getElementById("job");
  if (!root || root.dataset.active !== "yes") return;
  const id = root.dataset.job;

  const { el, badge, finish, follow } = window.gpumodeLive;

  function paintJob(job) {
    const s = document.getElementById("job-state");
    s.className = "state state-" + job.state;
    s.textContent = job.state.replace(/_/g, " ");
    document.getElementById("host-state").textContent = job.host_state;
    document.getElementById("job-duration").textContent = job.duration;
    const error = document.getElementById("job-error");
    error.textContent = job.error || "";
    error.classList.toggle("hidden", !job.error);
    paintProgress(job.progress, job.state);
    for (const step of job.steps) {
      const row = document.querySelector('tr[data-step="' + CSS.escape(step.id) + '"]');
      if (!row) continue;
      row.classList.toggle("current", step.id === job.progress.current);
      row.querySelector(".step-state").replaceChildren(badge(step.state));
      row.querySelector(".step-duration").textContent = step.duration;
      const note = row.querySelector(".step-note");
      note.replaceChildren(step.error ? el("span", "bad-text", step.error) : document.createTextNode(step.note || ""));
    }
    const cancel = document.getElementById("cancel-form");
    if (cancel && !job.active) cancel.remove();
    if (!job.active) finish(root);
  }

  // The overall bar, and the running step kept in view (the list of a driver change is long).
  function paintProgress(progress, state) {
    const bar = document.getElementById("job-progress");
    bar.setAttribute("aria-valuenow", progress.finished);
    const fill = bar.querySelector(".progress-fill");
    fill.style.width = progress.percent + "%";
    fill.className = "progress-fill state-" + state;
    bar.querySelector(".progress-text").textContent =
      progress.finished + " of " + progress.total + " steps · " + progress.percent + "%";
    if (progress.current === null) return;
    const row = document.querySelector('tr[data-step="' + CSS.escape(progress.current) + '"]');
    if (row) row.scrollIntoView({ block: "nearest", behavior: "smooth" });
  }

  function paintCards(cards) {
    const body = document.querySelector("#cards tbody");
    body.replaceChildren(...cards.map(function (c) {
      const tr = el("tr");
      const kind = el("td"); kind.appendChild(el("span", "mode mode-" + c.kind, c.kind));
      const status = el("td"); status.appendChild(el("span", "card-status st-" + c.status, c.status.replace(/_/g, " ")));
      tr.append(el("td", "", c.id), kind, el("td", "mono small", c.gpu), el("td", "mono small", c.device),
        el("td", "small", c.vgpu_type || ""), status, el("td", "", c.holder || ""));
      return tr;
    }));
  }

  follow(root, "/ui/jobs/" + id + "/stream", function (data) {
    paintJob(data.job);
    paintCards(data.cards);
  });
})();
