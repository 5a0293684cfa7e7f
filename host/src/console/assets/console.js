// outroute console: optional enhancements. Every page works without this.
// - Times (<time datetime=…>) are shown in the viewer's timezone; UTC stays
//   in the title (hover).
// - The overview's #live section is fetched again every 5 s.
"use strict";
function localTimes(root) {
  for (const t of root.querySelectorAll("time[datetime]")) {
    const d = new Date(t.getAttribute("datetime"));
    if (!isNaN(d)) t.textContent = d.toLocaleString();
  }
}
async function refreshLive() {
  const live = document.getElementById("live");
  if (!live || document.hidden) return;
  try {
    const r = await fetch("/console/live", { credentials: "same-origin" });
    if (r.ok) {
      live.innerHTML = await r.text();
      localTimes(live);
    }
  } catch (_) { /* the relay restarts: try again at the next tick */ }
}
document.addEventListener("DOMContentLoaded", () => {
  localTimes(document);
  if (document.getElementById("live")) setInterval(refreshLive, 5000);
});
