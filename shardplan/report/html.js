(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("plan-data").textContent);
  var panel = document.getElementById("details");
  var colours = data.colours;
  colours.comm = "#0d9488";

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function kv(parent, pairs) {
    var dl = el("dl", "kv");
    pairs.forEach(function (p) {
      if (p[1] === undefined || p[1] === null || p[1] === "") return;
      dl.appendChild(el("dt", null, p[0]));
      var dd = el("dd");
      if (p[2]) { dd.appendChild(el("code", null, p[1])); } else { dd.textContent = String(p[1]); }
      dl.appendChild(dd);
    });
    parent.appendChild(dl);
  }
  function shape(s) { return "(" + s.join(", ") + (s.length === 1 ? ",)" : ")"); }

  function show(id, source) {
    var d = data.details[id];
    if (!d) return;
    document.querySelectorAll(".selected").forEach(function (x) { x.classList.remove("selected"); });
    if (source) source.classList.add("selected");
    panel.textContent = "";
    var card = el("div", "detail-card");
    card.setAttribute("data-detail", id);
    var badge = el("span", "badge", d.category === "comm" ? "communication" : d.category);
    badge.style.background = colours[d.category] || "#64748b";
    card.appendChild(badge);
    card.appendChild(el("h3", null, d.title));
    if (d.count > 1) card.appendChild(el("div", "muted", "stands for " + d.count + " identical modules"));
    if (d.note) card.appendChild(el("p", null, d.note));
    if (d.decisions.length) {
      card.appendChild(el("h4", null, "decision" + (d.decisions.length > 1 ? "s" : "")));
      d.decisions.forEach(function (x) {
        var it = el("div", "item");
        kv(it, [["role", x.role], ["output", x.layout + " — " + x.layout_words], ["rule", x.rule],
                ["node", x.node, true], ["from", (x.evidence || []).join(", "), true]]);
        if (x.source) it.appendChild(el("span", "src", x.source));
        card.appendChild(it);
      });
    } else if (d.category !== "comm") {
      card.appendChild(el("p", "muted", "No decision here: the module runs replicated."));
    }
    if (d.params.length) {
      card.appendChild(el("h4", null, "parameters"));
      d.params.forEach(function (p) {
        var it = el("div", "item");
        var head = el("div");
        var b = el("span", "badge", p.layout);
        b.style.background = colours[p.category];
        head.appendChild(el("code", null, p.name + " "));
        head.appendChild(b);
        it.appendChild(head);
        kv(it, [["layout", p.layout_words], ["shape", shape(p.global) + " → " + shape(p.local) + " per rank"],
                ["bytes", p.bytes + " per rank (" + p.dtype + ")"], ["tied to", p.tied_to, true],
                ["rule", p.rule]]);
        card.appendChild(it);
      });
    }
    if (d.collectives.length) {
      card.appendChild(el("h4", null, "communication"));
      d.collectives.forEach(function (c) {
        var it = el("div", "item");
        kv(it, [["what", c.purpose + ": " + c.kind + ", " + c.direction],
                ["size", c.elements.toLocaleString() + " elements, " + c.bytes], ["node", c.node, true]]);
        if (c.source) it.appendChild(el("span", "src", c.source));
        card.appendChild(it);
      });
    }
    panel.appendChild(card);
  }

  document.querySelectorAll("[data-detail]").forEach(function (node) {
    node.addEventListener("click", function (ev) { ev.stopPropagation(); show(node.getAttribute("data-detail"), node); });
    node.addEventListener("keydown", function (ev) {
      if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); show(node.getAttribute("data-detail"), node); }
    });
  });

  var active = null;
  document.querySelectorAll(".legend-item[data-cat]").forEach(function (btn) {
    btn.addEventListener("click", function () {
      var cat = btn.getAttribute("data-cat");
      active = active === cat ? null : cat;
      document.querySelectorAll(".legend-item[data-cat]").forEach(function (b) {
        b.classList.toggle("active", b.getAttribute("data-cat") === active);
      });
      document.querySelectorAll(".chip[data-cat]").forEach(function (c) {
        c.classList.toggle("dim", active !== null && c.getAttribute("data-cat") !== active);
      });
    });
  });

  // open with the first split decision selected, so the panel shows what a click gives
  var first = document.querySelector(".row.cat-column[data-detail]") || document.querySelector(".row[data-detail]");
  if (first) show(first.getAttribute("data-detail"), first);
  document.documentElement.setAttribute("data-rendered", "1");
})();
