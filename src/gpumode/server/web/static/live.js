// What the live pages share: small DOM helpers and following a server-sent event stream until the thing it
// shows (a job, a rollout) is over. Each page's own script only paints what it is sent. No polling, no reload.
"use strict";

window.gpumodeLive = (function () {
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }

  function badge(state) {
    return el("span", "state state-" + state, state.replace(/_/g, " "));
  }

  // Marks the page finished: the "live" hint goes, and a network error no longer reconnects.
  function finish(root) {
    document.getElementById("live").classList.add("hidden");
    root.dataset.active = "no";
  }

  // Calls paint(data) with each message of the stream at url; the server ends the stream with an "end" event.
  function follow(root, url, paint) {
    const source = new EventSource(url);
    source.onmessage = function (message) { paint(JSON.parse(message.data)); };
    source.addEventListener("end", function () { source.close(); });
    // EventSource reconnects by itself after a network error; a finished page needs no reconnecting.
    source.onerror = function () { if (root.dataset.active === "no") source.close(); };
  }

  return { el: el, badge: badge, finish: finish, follow: follow };
})();
