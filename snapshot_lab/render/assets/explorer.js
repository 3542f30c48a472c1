/* snaplab explorer: the memory timeline, its allocations and the block layout, from the JSON
   embedded in the page. No network, no framework: the page's CSP allows this script only. */
(function () {
  "use strict";
  var source = document.getElementById("snaplab-data");
  if (!source) return;
  var DATA = JSON.parse(source.textContent);
  var UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  var tip = document.createElement("div");
  tip.id = "xp-tip";
  tip.className = "xp-tip";
  tip.hidden = true;
  document.body.appendChild(tip);

  function fmtBytes(n) {
    var v = Math.abs(n), sign = n < 0 ? "-" : "", i = 0;
    while (v >= 1024 && i < UNITS.length - 1) { v /= 1024; i++; }
    return i === 0 ? sign + Math.round(v) + " B" : sign + v.toFixed(2) + " " + UNITS[i];
  }
  function fmtPct(x) { return (100 * x).toFixed(1) + "%"; }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmtX(dev, x) {
    if (dev.axis === "time_s") return (Math.abs(x) >= 100 ? x.toFixed(1) : x.toPrecision(4)) + " s";
    return "event " + Math.round(x).toLocaleString("en-US");
  }
  function fmtSpan(dev, a, b) {
    if (b === null || b === undefined) return "from " + fmtX(dev, a) + ", still alive at the end of the trace";
    var d = b - a;
    var span = dev.axis === "time_s" ? (d < 1 ? (d * 1000).toPrecision(3) + " ms" : d.toPrecision(3) + " s")
      : Math.round(d).toLocaleString("en-US") + " events";
    return fmtX(dev, a) + " → " + fmtX(dev, b) + " (" + span + ")";
  }
  function showTip(html, ev) {
    tip.textContent = "";
    html.forEach(function (line, i) { tip.appendChild(el(i === 0 ? "b" : "div", null, line)); });
    tip.hidden = false;
    var x = ev.pageX + 14, y = ev.pageY + 14;
    if (x + 340 > window.scrollX + window.innerWidth) x = ev.pageX - 350;
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  function hideTip() { tip.hidden = true; }
  function stackList(id) {
    var frames = id >= 0 && DATA.stacks[String(id)];
    if (!frames) return el("p", "note", "No stack was recorded for this allocation.");
    var ol = el("ol", "stack");
    ol.start = 0;
    frames.forEach(function (f) { ol.appendChild(el("li", "mono", DATA.frames[f])); });
    return ol;
  }
  function table(head, rows) {
    var t = el("table"), tr = el("tr");
    head.forEach(function (h, i) { tr.appendChild(el("th", i ? "num" : null, h)); });
    var thead = el("thead");
    thead.appendChild(tr);
    t.appendChild(thead);
    var body = el("tbody");
    rows.forEach(function (r) {
      var row = el("tr");
      r.forEach(function (c, i) { row.appendChild(el("td", i ? "num" : null, c)); });
      body.appendChild(row);
    });
    t.appendChild(body);
    return t;
  }

  function Explorer(root, dev) {
    this.root = root;
    this.dev = dev;
    var b = dev.b;
    this.full = [b.x0[0], b.x1[b.x1.length - 1] > b.x0[0] ? b.x1[b.x1.length - 1] : b.x0[0] + 1];
    this.view = this.full.slice();
    this.lanes = this.pack();
    this.build();
    this.draw();
  }
  var MAX_LANES = 60;
  Explorer.prototype.pack = function () {
    // largest first, each into the first lane where it overlaps nothing: the largest are always
    // drawn; what finds no lane within MAX_LANES is left out of the picture (not of the tables)
    var a = this.dev.allocs, end = this.full[1], lanes = [], lane = [];
    var order = a.x0.map(function (_, i) { return i; }).sort(function (i, j) { return a.size[j] - a.size[i]; });
    order.forEach(function (i) {
      var lo = a.x0[i], hi = a.x1[i] === null ? end : a.x1[i];
      lane[i] = -1;
      for (var k = 0; k < MAX_LANES; k++) {
        if (!lanes[k]) lanes[k] = [];
        var free = lanes[k].every(function (iv) { return hi <= iv[0] || lo >= iv[1]; });
        if (free) { lanes[k].push([lo, hi]); lane[i] = k; return; }
      }
    });
    this.nLanes = Math.max(1, lanes.filter(function (l) { return l.length; }).length);
    this.hidden = lane.filter(function (k) { return k < 0; }).length;
    return lane;
  };
  Explorer.prototype.build = function () {
    var self = this, dev = this.dev;
    var bar = el("div", "xp-bar");
    [["−", "xp-zoom-out", "zoom out"], ["+", "xp-zoom-in", "zoom in"], ["reset", "xp-reset", "whole trace"],
     ["peak", "xp-peak", "zoom to the peak"]].forEach(function (s) {
      var btn = el("button", s[1], s[0]);
      btn.type = "button";
      btn.title = s[2];
      bar.appendChild(btn);
    });
    this.range = el("span", "xp-range");
    bar.appendChild(this.range);
    bar.appendChild(el("span", "xp-help", "wheel or +/− to zoom, drag to pan, click a moment for what was live"));
    this.root.appendChild(bar);
    this.canvas = el("canvas", "xp-timeline");
    this.lanesCanvas = el("canvas", "xp-allocs");
    this.root.appendChild(this.canvas);
    this.root.appendChild(el("div", "xp-caption",
      "Above: requested (blue band: lowest to highest in each bucket) and reserved (grey) bytes; " +
      "red dot: the peak; red dashes: OOMs; grey dots: iteration starts. Below: " + dev.allocs.x0.length.toLocaleString("en-US") +
      " allocations one by one (alive at the peak, then the largest; " +
      dev.unlisted.toLocaleString("en-US") + " smaller ones are only in the levels), coloured by category" +
      (this.hidden ? "; " + this.hidden.toLocaleString("en-US") + " small ones find no row here but count in the tables." : ".")));
    this.root.appendChild(this.lanesCanvas);
    this.detail = el("div", "xp-detail");
    this.live = el("div", "xp-live");
    this.root.appendChild(this.live);
    this.root.appendChild(this.detail);
    bar.querySelector(".xp-zoom-in").addEventListener("click", function () { self.zoom(0.5, 0.5); });
    bar.querySelector(".xp-zoom-out").addEventListener("click", function () { self.zoom(2, 0.5); });
    bar.querySelector(".xp-reset").addEventListener("click", function () { self.view = self.full.slice(); self.draw(); });
    bar.querySelector(".xp-peak").addEventListener("click", function () {
      var w = (self.full[1] - self.full[0]) / 20;
      self.view = [dev.peak.x - w / 2, dev.peak.x + w / 2];
      self.clamp();
      self.draw();
      self.showLive(self.bucketAt(dev.peak.x));
    });
    [this.canvas, this.lanesCanvas].forEach(function (c) {
      c.addEventListener("wheel", function (ev) {
        ev.preventDefault();
        var r = c.getBoundingClientRect();
        self.zoom(ev.deltaY < 0 ? 0.8 : 1.25, (ev.clientX - r.left) / r.width);
      }, { passive: false });
      c.addEventListener("mousedown", function (ev) { self.drag = { x: ev.clientX, view: self.view.slice(), moved: false }; });
      c.addEventListener("mouseleave", hideTip);
    });
    window.addEventListener("mousemove", function (ev) {
      if (!self.drag) return;
      var w = self.canvas.getBoundingClientRect().width, dx = ev.clientX - self.drag.x;
      if (Math.abs(dx) > 3) self.drag.moved = true;
      var span = self.drag.view[1] - self.drag.view[0];
      self.view = [self.drag.view[0] - dx / w * span, self.drag.view[1] - dx / w * span];
      self.clamp();
      self.draw();
    });
    window.addEventListener("mouseup", function () { setTimeout(function () { self.drag = null; }, 0); });
    this.canvas.addEventListener("mousemove", function (ev) { if (!self.drag) self.hoverTimeline(ev); });
    this.canvas.addEventListener("click", function (ev) {
      if (self.drag && self.drag.moved) return;
      self.showLive(self.bucketAt(self.xAt(ev, self.canvas)));
    });
    this.lanesCanvas.addEventListener("mousemove", function (ev) { if (!self.drag) self.hoverAlloc(ev); });
    this.lanesCanvas.addEventListener("click", function (ev) {
      if (self.drag && self.drag.moved) return;
      var i = self.allocAt(ev);
      if (i >= 0) self.showAlloc(i);
    });
    window.addEventListener("resize", function () { self.draw(); });
  };
  Explorer.prototype.clamp = function () {
    var f = this.full, span = Math.min(this.view[1] - this.view[0], f[1] - f[0]);
    var minSpan = (f[1] - f[0]) / 1e6;
    if (span < minSpan) span = minSpan;
    var lo = Math.max(f[0], Math.min(this.view[0], f[1] - span));
    this.view = [lo, lo + span];
  };
  Explorer.prototype.zoom = function (factor, at) {
    var v = this.view, span = v[1] - v[0], x = v[0] + at * span;
    this.view = [x - at * span * factor, x + (1 - at) * span * factor];
    this.clamp();
    this.draw();
  };
  Explorer.prototype.xAt = function (ev, c) {
    var r = c.getBoundingClientRect();
    return this.view[0] + (ev.clientX - r.left) / r.width * (this.view[1] - this.view[0]);
  };
  Explorer.prototype.bucketAt = function (x) {
    var b = this.dev.b, lo = 0, hi = b.x0.length - 1;
    while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (b.x0[mid] <= x) lo = mid; else hi = mid - 1; }
    return lo;
  };
  Explorer.prototype.setup = function (c, h) {
    var ratio = window.devicePixelRatio || 1, w = c.clientWidth || 800;
    c.width = Math.round(w * ratio);
    c.height = Math.round(h * ratio);
    c.style.height = h + "px";
    var g = c.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, w, h);
    return { g: g, w: w, h: h };
  };
  Explorer.prototype.draw = function () {
    var dev = this.dev, b = dev.b, v = this.view, self = this;
    var cv = this.setup(this.canvas, 230), g = cv.g, w = cv.w, h = cv.h - 18;
    var sx = function (x) { return (x - v[0]) / (v[1] - v[0]) * w; };
    var i0 = Math.max(0, this.bucketAt(v[0])), i1 = this.bucketAt(v[1]);
    var top = 1;
    for (var i = i0; i <= i1; i++) top = Math.max(top, b.res[i], b.hi[i]);
    top *= 1.08;
    var sy = function (y) { return h - y / top * (h - 6); };
    var n = b.x0.length;
    for (i = i0; i <= i1; i++) {
      // the bucket's entries (lo..hi), then the level its last entry left until the next bucket
      var xa = sx(b.x0[i]), xb = Math.max(sx(b.x1[i]), xa + 1), xn = i + 1 < n ? sx(b.x0[i + 1]) : xb;
      g.fillStyle = "#d3dbe6";
      g.fillRect(xa, sy(b.res[i]), xb - xa, h - sy(b.res[i]));
      if (xn > xb) g.fillRect(xb, sy(b.resEnd[i]), xn - xb, h - sy(b.resEnd[i]));
      g.fillStyle = "rgba(59,111,182,0.35)";
      g.fillRect(xa, sy(b.lo[i]), xb - xa, h - sy(b.lo[i]));
      if (xn > xb) g.fillRect(xb, sy(b.end[i]), xn - xb, h - sy(b.end[i]));
      g.fillStyle = "#3b6fb6";
      g.fillRect(xa, sy(b.hi[i]), xb - xa, Math.max(1, sy(b.lo[i]) - sy(b.hi[i])));
      if (xn > xb) g.fillRect(xb, sy(b.end[i]) - 1, xn - xb, 1.5);
    }
    g.setLineDash([2, 3]);
    g.strokeStyle = "#8c8c8c";
    dev.markers.forEach(function (m) {
      if (m[0] < v[0] || m[0] > v[1]) return;
      g.beginPath(); g.moveTo(sx(m[0]), 0); g.lineTo(sx(m[0]), h); g.stroke();
    });
    g.setLineDash([4, 3]);
    g.strokeStyle = "#c23b22";
    dev.ooms.forEach(function (x) { g.beginPath(); g.moveTo(sx(x), 0); g.lineTo(sx(x), h); g.stroke(); });
    g.setLineDash([]);
    g.fillStyle = "#c23b22";
    g.beginPath();
    g.arc(sx(dev.peak.x), sy(dev.peak.bytes), 4, 0, 7);
    g.fill();
    if (this.selected !== undefined) {
      g.strokeStyle = "#1f2328";
      var xs = sx(b.x0[this.selected]);
      g.beginPath(); g.moveTo(xs, 0); g.lineTo(xs, h); g.stroke();
    }
    g.fillStyle = "#59636e";
    g.font = "11px sans-serif";
    g.fillText(fmtBytes(top / 1.08), 4, 12);
    for (var t = 0; t <= 4; t++) {
      var x = v[0] + (v[1] - v[0]) * t / 4;
      g.textAlign = t === 0 ? "left" : t === 4 ? "right" : "center";
      g.fillText(fmtX(dev, x), t / 4 * w, h + 14);
    }
    g.textAlign = "left";
    this.range.textContent = "showing " + fmtX(dev, v[0]) + " – " + fmtX(dev, v[1]);
    this.range.setAttribute("data-start", String(v[0]));
    this.range.setAttribute("data-end", String(v[1]));
    this.drawLanes(sx);
  };
  Explorer.prototype.drawLanes = function (sx) {
    var a = this.dev.allocs, self = this, laneH = Math.max(3, Math.min(8, 180 / this.nLanes));
    var cv = this.setup(this.lanesCanvas, Math.max(40, Math.ceil(laneH * this.nLanes) + 4)), g = cv.g;
    this.laneH = laneH;
    a.x0.forEach(function (x0, i) {
      var x1 = a.x1[i] === null ? self.full[1] : a.x1[i];
      if (self.lanes[i] < 0 || x1 < self.view[0] || x0 > self.view[1]) return;
      g.fillStyle = DATA.colors[self.dev.cats[a.cat[i]]] || "#bab0ac";
      var xa = sx(x0);
      g.fillRect(xa, 2 + self.lanes[i] * laneH, Math.max(sx(x1) - xa, 1.5), Math.max(laneH - 1, 0.5));
    });
  };
  Explorer.prototype.allocAt = function (ev) {
    var a = this.dev.allocs, x = this.xAt(ev, this.lanesCanvas), r = this.lanesCanvas.getBoundingClientRect();
    var lane = Math.floor((ev.clientY - r.top - 2) / this.laneH);
    var slack = (this.view[1] - this.view[0]) / r.width * 2, best = -1;
    for (var i = 0; i < a.x0.length; i++) {
      if (this.lanes[i] !== lane) continue;
      var x1 = a.x1[i] === null ? this.full[1] : a.x1[i];
      if (a.x0[i] - slack <= x && x <= x1 + slack) { best = i; break; }
    }
    return best;
  };
  Explorer.prototype.allocLines = function (i) {
    var a = this.dev.allocs, dev = this.dev;
    return [fmtBytes(a.size[i]) + " · " + dev.cats[a.cat[i]],
      "lifetime: " + fmtSpan(dev, a.x0[i], a.x1[i]),
      "site: " + dev.siteNames[a.site[i]],
      "module: " + (a.mod[i] >= 0 ? dev.modNames[a.mod[i]] : "none recorded")]
      .concat(((a.notes && a.notes[String(i)]) || []).map(function (t) { return "annotated: " + t; }));
  };
  Explorer.prototype.hoverAlloc = function (ev) {
    var i = this.allocAt(ev);
    if (i < 0) { hideTip(); return; }
    showTip(this.allocLines(i).concat(["click for its stack"]), ev);
  };
  Explorer.prototype.showAlloc = function (i) {
    this.detail.textContent = "";
    this.detail.appendChild(el("h4", null, "Allocation"));
    var lines = this.allocLines(i), box = el("div", "xp-alloc");
    lines.forEach(function (l) { box.appendChild(el("div", null, l)); });
    box.appendChild(stackList(this.dev.allocs.stack[i]));
    this.detail.appendChild(box);
  };
  Explorer.prototype.hoverTimeline = function (ev) {
    var x = this.xAt(ev, this.canvas), i = this.bucketAt(x), b = this.dev.b, lines;
    if (x > b.x1[i] && i + 1 < b.x0.length) {
      lines = [fmtX(this.dev, x) + " (no allocator activity)", "requested " + fmtBytes(b.end[i]),
        "reserved " + fmtBytes(b.resEnd[i])];
    } else {
      lines = [fmtX(this.dev, x), "requested " + fmtBytes(b.lo[i]) +
        (b.hi[i] !== b.lo[i] ? " to " + fmtBytes(b.hi[i]) : ""), "reserved up to " + fmtBytes(b.res[i])];
    }
    showTip(lines.concat(["click: what was live here"]), ev);
  };
  Explorer.prototype.showLive = function (i) {
    var dev = this.dev, b = dev.b, total = b.hi[i];
    this.selected = i;
    this.draw();
    this.live.textContent = "";
    var when = b.x1[i] > b.x0[i] ? "the highest point between " + fmtX(dev, b.x0[i]) + " and " + fmtX(dev, b.x1[i])
      : fmtX(dev, b.x0[i]);
    this.live.appendChild(el("h4", null, "Live at " + when + ": " + fmtBytes(total) + " requested"));
    var cats = [], sum = 0;
    dev.cats.forEach(function (c, k) { var v = dev.catLv[k] ? dev.catLv[k][i] : 0; sum += v; if (v > 0) cats.push([c, v]); });
    if (total - sum > 0) cats.push(["allocated before the trace (unknown)", total - sum]);
    cats.sort(function (p, q) { return q[1] - p[1]; });
    var sites = [];
    dev.sites.forEach(function (s, k) { var v = dev.siteLv[k] ? dev.siteLv[k][i] : 0; if (v > 0) sites.push([s, v]); });
    sites.sort(function (p, q) { return q[1] - p[1]; });
    var share = function (v) { return total ? fmtPct(v / total) : ""; };
    var wrap = el("div", "xp-cols");
    var c1 = el("div"), c2 = el("div");
    c1.appendChild(table(["category", "bytes", "share"], cats.map(function (r) { return [r[0], fmtBytes(r[1]), share(r[1])]; })));
    c2.appendChild(table(["site", "bytes", "share"], sites.map(function (r) { return [r[0], fmtBytes(r[1]), share(r[1])]; })));
    wrap.appendChild(c1);
    wrap.appendChild(c2);
    this.live.appendChild(wrap);
  };

  function Layout(root, dev) {
    var segs = dev.segments, biggest = 1;
    segs.forEach(function (s) { biggest = Math.max(biggest, s.size); });
    var list = el("div", "xp-segs"), detail = el("div", "xp-detail");
    root.appendChild(el("p", "note", dev.layoutNote));
    var seen = {}, legend = el("div", "xp-legend");
    segs.forEach(function (s) { s.blocks.forEach(function (bk) { seen[bk[2]] = true; }); });
    DATA.states.forEach(function (st, k) {
      if (!seen[k]) return;
      var item = el("span", null, " " + st.replace(/_/g, " ") + "  ");
      item.insertBefore(el("span", "xp-key st-" + st), item.firstChild);
      legend.appendChild(item);
    });
    root.appendChild(legend);
    segs.forEach(function (s) {
      var row = el("button", "xp-seg");
      row.type = "button";
      row.style.width = Math.max(2, 100 * s.size / biggest) + "%";
      row.title = fmtBytes(s.size) + " " + s.pool + " pool segment at " + s.addr +
        (s.alike > 1 ? " (and " + (s.alike - 1) + " alike)" : "");
      s.blocks.forEach(function (bk) {
        var part = el("span", "xp-blk st-" + DATA.states[bk[2]]);
        part.style.width = (100 * bk[1] / s.size) + "%";
        row.appendChild(part);
      });
      row.addEventListener("click", function () { openSegment(s); });
      list.appendChild(row);
    });
    root.appendChild(list);
    root.appendChild(detail);
    function openSegment(s) {
      detail.textContent = "";
      detail.appendChild(el("h4", null, "Segment " + s.addr + ": " + fmtBytes(s.size) + ", " + s.pool +
        " pool, stream " + s.stream + ", " + s.blocks.length.toLocaleString("en-US") + " blocks" +
        (s.more ? " (" + s.more + " more not listed)" : "") +
        (s.alike > 1 ? "; " + (s.alike - 1) + " more segments are alike (same size, same blocks)" : "")));
      var t = el("table"), head = el("tr");
      ["offset", "size", "state", "allocated at"].forEach(function (h) { head.appendChild(el("th", null, h)); });
      t.appendChild(head);
      s.blocks.forEach(function (bk) {
        var tr = el("tr");
        tr.appendChild(el("td", "num", fmtBytes(bk[0])));
        tr.appendChild(el("td", "num", fmtBytes(bk[1])));
        tr.appendChild(el("td", null, DATA.states[bk[2]].replace(/_/g, " ")));
        var cell = el("td");
        if (bk[3] >= 0) {
          var fr = DATA.stacks[String(bk[3])] || [];
          var d = el("details"), sm = el("summary", "mono", fr.length ? DATA.frames[fr[0]] : "stack");
          d.appendChild(sm);
          d.appendChild(stackList(bk[3]));
          cell.appendChild(d);
        } else cell.textContent = bk[2] === 0 ? "no stack recorded" : "";
        tr.appendChild(cell);
        t.appendChild(tr);
      });
      detail.appendChild(t);
    }
  }

  DATA.devices.forEach(function (dev) {
    var root = document.getElementById("explorer-" + dev.device);
    if (root && dev.b) { root.hidden = false; new Explorer(root.querySelector(".xp-time"), dev); }
    var lay = document.getElementById("layout-explorer-" + dev.device);
    if (lay && dev.segments.length) { lay.hidden = false; Layout(lay, dev); }
  });
  document.documentElement.setAttribute("data-explorer", "ready");
})();
