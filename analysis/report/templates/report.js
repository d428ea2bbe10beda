document.documentElement.classList.add("js");     // shows the hints of what scripts add
const CHAR = 6.6;
function fmtBytes(n) {
  for (const [u, s] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]])
    if (Math.abs(n) >= s) return (n / s).toFixed(1) + " " + u;
  return n.toFixed(0) + " B";
}
function fit(text, w) {
  const n = Math.floor((w - 6) / CHAR);
  return n < 3 ? "" : text.length <= n ? text : text.slice(0, n - 1) + "\u2026";
}
document.querySelectorAll("svg.flame").forEach(svg => {
  const W = +svg.dataset.w, gs = [...svg.querySelectorAll("g.fr")];
  svg.addEventListener("click", ev => {
    const g = ev.target.closest("g.fr");
    if (!g) return;
    const x0 = +g.dataset.x, w0 = +g.dataset.w, d0 = +g.dataset.d, eps = 0.02;
    for (const e of gs) {
      const x = +e.dataset.x, w = +e.dataset.w, d = +e.dataset.d;
      let nx, nw;
      if (d >= d0 && x >= x0 - eps && x + w <= x0 + w0 + eps) { nx = (x - x0) / w0 * W; nw = w / w0 * W; }
      else if (d < d0 && x <= x0 + eps && x + w >= x0 + w0 - eps) { nx = 0; nw = W; }
      else { e.style.display = "none"; continue; }
      e.style.display = "";
      e.classList.toggle("anc", d < d0);
      const r = e.querySelector("rect"), t = e.querySelector("text");
      r.setAttribute("x", nx.toFixed(2)); r.setAttribute("width", Math.max(nw - 0.5, 0.1).toFixed(2));
      t.setAttribute("x", (nx + 3).toFixed(2)); t.textContent = fit(e.dataset.l, nw);
    }
  });
});
const tip = document.getElementById("tip");
document.querySelectorAll(".chartbox").forEach(box => {
  const svg = box.querySelector("svg"), data = JSON.parse(box.querySelector("script").textContent);
  const cursor = svg.querySelector(".cursor");
  svg.addEventListener("mousemove", ev => {
    const pt = new DOMPoint(ev.clientX, ev.clientY).matrixTransform(svg.getScreenCTM().inverse());
    if (pt.x < data.x0 || pt.x > data.x1) { svg.dispatchEvent(new Event("mouseleave")); return; }
    const t = data.t0 + (pt.x - data.x0) / (data.x1 - data.x0) * (data.t1 - data.t0);
    let i = 0;
    for (let k = 1; k < data.t.length; k++) if (Math.abs(data.t[k] - t) < Math.abs(data.t[i] - t)) i = k;
    const x = data.x0 + (data.t[i] - data.t0) / (data.t1 - data.t0) * (data.x1 - data.x0);
    cursor.setAttribute("x1", x); cursor.setAttribute("x2", x); cursor.setAttribute("visibility", "visible");
    const when = new Date(data.t[i] * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
    tip.replaceChildren(Object.assign(document.createElement("b"), {textContent: when}));
    for (const s of data.s) {
      const row = document.createElement("div"), sw = document.createElement("i");
      sw.style.background = s.c;
      row.append(sw, fmtBytes(s.y[i]) + "  " + s.l);
      tip.append(row);
    }
    tip.style.display = "block";
    tip.style.left = Math.min(ev.clientX + 14, innerWidth - tip.offsetWidth - 8) + "px";
    tip.style.top = (ev.clientY + 14) + "px";
  });
  svg.addEventListener("mouseleave", () => {
    tip.style.display = "none";
    cursor.setAttribute("visibility", "hidden");
  });
});
