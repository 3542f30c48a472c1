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
  function stackList(id, prefix) {
    var frames = id >= 0 && DATA.stacks[(prefix || "") + id];
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

  var MAX_PATTERN = 200; // longest search pattern taken (a user's regular expression runs on every listed stack)
  function matcher(text) {
    // {test} for a pattern, {error} for one that cannot be used, null for none: plain text matches
    // case-insensitively, /regex/flags as a regular expression
    text = text.trim();
    if (!text) return null;
    if (text.length > MAX_PATTERN) return { error: "The pattern is longer than " + MAX_PATTERN + " characters." };
    var m = /^\/(.+)\/([imsu]*)$/.exec(text);
    if (m) {
      var re;
      try { re = new RegExp(m[1], m[2]); } catch (e) { return { error: "Not a valid regular expression: " + e.message }; }
      return { test: function (s) { return re.test(s); } };
    }
    var needle = text.toLowerCase();
    return { test: function (s) { return s.toLowerCase().indexOf(needle) >= 0; } };
  }
  function hue(text) {
    // a frame's colour from its text: the same frame has the same colour in both explorers of a diff
    var h = 0;
    for (var i = 0; i < text.length; i++) h = (h * 31 + text.charCodeAt(i)) % 360;
    return "hsl(" + h + ",55%,80%)";
  }
  function fmtSeconds(s) {
    if (s < 1e-3) return (s * 1e6).toPrecision(3) + " µs";
    if (s < 1) return (s * 1e3).toPrecision(3) + " ms";
    return s.toPrecision(3) + " s";
  }
  function axisSets(dev) {
    // every x of the device, per axis kind: the file's own and, with times, the entries' positions
    var sets = {};
    sets[dev.axis] = { b: { x0: dev.b.x0, x1: dev.b.x1, xs: dev.b.xs }, allocs: { x0: dev.allocs.x0, x1: dev.allocs.x1 },
      peak: dev.peak.x, ooms: dev.ooms, markers: dev.markers.map(function (m) { return m[0]; }) };
    if (dev.ev) sets.event = dev.ev;
    return sets;
  }
  function useAxis(dev, kind) {
    var s = dev.axes[kind];
    dev.axis = kind;
    dev.b.x0 = s.b.x0; dev.b.x1 = s.b.x1; dev.b.xs = s.b.xs;
    dev.allocs.x0 = s.allocs.x0; dev.allocs.x1 = s.allocs.x1;
    dev.peak.x = s.peak;
    dev.ooms = s.ooms;
    dev.markers = dev.markers.map(function (m, k) { return [s.markers[k], m[1]]; });
  }
  function padded(hist, span) {
    // the histogram over the bins [span[0], span[1]) (linked explorers: one range for both files)
    if (!hist || !span || !hist.n.length) return hist;
    var n = [], bytes = [];
    for (var k = span[0]; k < span[1]; k++) {
      var at = k - hist.low, inside = at >= 0 && at < hist.n.length;
      n.push(inside ? hist.n[at] : 0);
      bytes.push(inside ? hist.bytes[at] : 0);
    }
    return { low: span[0], n: n, bytes: bytes, zero: hist.zero, open: hist.open };
  }
  function histChart(title, hist, label, cls) {
    var wrap = el("div", "xp-hist " + cls);
    wrap.appendChild(el("h4", null, title));
    if (!hist || !hist.n.length) { wrap.appendChild(el("p", "note", "None in the trace.")); return wrap; }
    var most = Math.max.apply(null, hist.n), bars = el("div", "xp-hbars");
    hist.n.forEach(function (n, k) {
      var col = el("div", "xp-hbar");
      col.style.height = (n ? Math.max(2, 100 * n / most) : 0) + "%";
      col.title = label(hist.low + k) + " to " + label(hist.low + k + 1) + ": " + n.toLocaleString("en-US") +
        " allocations, " + fmtBytes(hist.bytes[k]);
      col.setAttribute("data-count", String(n));
      bars.appendChild(col);
    });
    wrap.appendChild(bars);
    var ends = el("div", "xp-hends");
    ends.appendChild(el("span", null, label(hist.low)));
    ends.appendChild(el("span", null, label(hist.low + hist.n.length)));
    wrap.appendChild(ends);
    var extra = [];
    if (hist.zero) extra.push(hist.zero.toLocaleString("en-US") + " with no time between allocation and free");
    if (hist.open) extra.push(hist.open.toLocaleString("en-US") + " still alive at the end of the trace (not counted)");
    if (extra.length) wrap.appendChild(el("p", "note", extra.join("; ") + "."));
    return wrap;
  }

  function Explorer(root, dev, group) {
    this.root = root;
    this.dev = dev;
    this.group = group || null;
    this.prefix = dev.stackPrefix || "";
    this.match = null;
    this.query = null;
    dev.axes = axisSets(dev);
    this.layoutFull();
    this.view = this.full.slice();
    this.build();
    this.draw();
  }
  var MAX_LANES = 60;
  Explorer.prototype.members = function () {
    var all = this.group ? this.group.members : [];
    return all.indexOf(this) < 0 ? all.concat([this]) : all;
  };
  Explorer.prototype.layoutFull = function () {
    var b = this.dev.b;
    this.full = [b.x0[0], b.x1[b.x1.length - 1] > b.x0[0] ? b.x1[b.x1.length - 1] : b.x0[0] + 1];
    this.lanes = this.pack();
  };
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
  Explorer.prototype.buildBar = function () {
    var self = this, dev = this.dev, bar = el("div", "xp-bar");
    [["−", "xp-zoom-out", "zoom out"], ["+", "xp-zoom-in", "zoom in"], ["reset", "xp-reset", "whole trace"],
     ["peak", "xp-peak", "zoom to the peak"]].forEach(function (s) {
      var btn = el("button", s[1], s[0]);
      btn.type = "button";
      btn.title = s[2];
      bar.appendChild(btn);
    });
    var canToggle = this.group ? DATA.devices.every(function (d) { return !d.b || d.ev; }) : !!dev.ev;
    if (canToggle) {
      // only where the file has times: else the event order is the only axis there is
      this.axisBtn = el("button", "xp-axis", "x: wall clock");
      this.axisBtn.type = "button";
      this.axisBtn.title = "switch the x axis between wall-clock time and event order";
      this.axisBtn.setAttribute("data-axis", dev.axis);
      bar.appendChild(this.axisBtn);
      this.axisBtn.addEventListener("click", function () { self.setAxis(dev.axis === "event" ? "time_s" : "event"); });
    }
    this.range = el("span", "xp-range");
    bar.appendChild(this.range);
    bar.appendChild(el("span", "xp-help", "wheel or +/− to zoom, drag to pan, click a moment for what was live"));
    bar.querySelector(".xp-zoom-in").addEventListener("click", function () { self.zoom(0.5, 0.5); });
    bar.querySelector(".xp-zoom-out").addEventListener("click", function () { self.zoom(2, 0.5); });
    bar.querySelector(".xp-reset").addEventListener("click", function () { self.setView(self.full.slice()); });
    bar.querySelector(".xp-peak").addEventListener("click", function () {
      var w = (self.full[1] - self.full[0]) / 20;
      self.setView([dev.peak.x - w / 2, dev.peak.x + w / 2]);
      self.choose(dev.peak.x);
    });
    return bar;
  };
  Explorer.prototype.buildSearch = function () {
    var self = this, row = el("div", "xp-search-row"), timer = null;
    this.searchBox = el("input", "xp-search");
    this.searchBox.type = "search";
    this.searchBox.maxLength = MAX_PATTERN + 50;
    this.searchBox.placeholder = "search stacks, files, functions, sites, modules; /regex/ for a regular expression";
    this.searchBox.setAttribute("aria-label", "search the listed allocations");
    this.searchCount = el("span", "xp-search-count");
    this.searchMsg = el("span", "xp-search-msg");
    row.appendChild(this.searchBox);
    row.appendChild(this.searchCount);
    row.appendChild(this.searchMsg);
    this.searchBox.addEventListener("input", function () {
      clearTimeout(timer);
      timer = setTimeout(function () {
        // linked explorers search together: one question asked of both files
        var text = self.searchBox.value;
        self.members().forEach(function (m) { if (m !== self) m.searchBox.value = text; m.search(text); });
      }, 120);
    });
    return row;
  };
  Explorer.prototype.build = function () {
    var self = this, dev = this.dev;
    if (dev.name) this.root.appendChild(el("h4", "xp-name mono", dev.name));
    this.root.appendChild(this.buildBar());
    this.root.appendChild(this.buildSearch());
    this.canvas = el("canvas", "xp-timeline");
    this.lanesCanvas = el("canvas", "xp-allocs");
    this.root.appendChild(this.canvas);
    this.root.appendChild(el("div", "xp-caption",
      "Above: requested (blue band: lowest to highest in each bucket) and reserved (grey) bytes; " +
      "red dot: the peak; red dashes: OOMs; grey dots: iteration starts; orange strip: allocations the search matches. Below: " +
      dev.allocs.x0.length.toLocaleString("en-US") + " allocations one by one (alive at the peak, then the largest; " +
      dev.unlisted.toLocaleString("en-US") + " smaller ones are only in the levels), coloured by category" +
      (this.hidden ? "; " + this.hidden.toLocaleString("en-US") + " small ones find no row here but count in the tables." : ".")));
    this.root.appendChild(this.lanesCanvas);
    this.live = el("div", "xp-live");
    this.detail = el("div", "xp-detail");
    this.flameBox = el("div", "xp-flame-wrap");
    this.segBox = el("div", "xp-moment-segs");
    this.histBox = el("div", "xp-hists");
    [this.live, this.detail, this.flameBox, this.segBox, this.histBox].forEach(function (e) { self.root.appendChild(e); });
    this.showHistograms();
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
      self.setView([self.drag.view[0] - dx / w * span, self.drag.view[1] - dx / w * span]);
    });
    window.addEventListener("mouseup", function () { setTimeout(function () { self.drag = null; }, 0); });
    this.canvas.addEventListener("mousemove", function (ev) { if (!self.drag) self.hoverTimeline(ev); });
    this.canvas.addEventListener("click", function (ev) {
      if (self.drag && self.drag.moved) return;
      self.choose(self.xAt(ev, self.canvas));
    });
    this.lanesCanvas.addEventListener("mousemove", function (ev) { if (!self.drag) self.hoverAlloc(ev); });
    this.lanesCanvas.addEventListener("click", function (ev) {
      if (self.drag && self.drag.moved) return;
      var i = self.allocAt(ev);
      if (i >= 0) self.showAlloc(i);
    });
    window.addEventListener("resize", function () { self.draw(); });
  };
  Explorer.prototype.setView = function (v) {
    // one view for the whole group: the diff page's explorers share their time axis
    this.view = v;
    this.clamp();
    var w = this.view;
    this.members().forEach(function (m) { m.view = w.slice(); m.draw(); });
  };
  Explorer.prototype.choose = function (x) {
    this.members().forEach(function (m) { m.showLive(m.bucketAt(x)); });
  };
  Explorer.prototype.setAxis = function (kind) {
    var members = this.members();
    members.forEach(function (m) {
      useAxis(m.dev, kind);
      m.layoutFull();
      m.axisBtn.textContent = kind === "event" ? "x: event order" : "x: wall clock";
      m.axisBtn.setAttribute("data-axis", kind);
      m.showHistograms();
    });
    if (this.group) linkGroup(this.group);
    else { this.view = this.full.slice(); this.draw(); }
    members.forEach(function (m) { if (m.selected !== undefined) m.showLive(m.selected); });
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
    this.setView([x - at * span * factor, x + (1 - at) * span * factor]);
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
  Explorer.prototype.topIn = function (v) {
    var b = this.dev.b, top = 1, i1 = this.bucketAt(v[1]);
    for (var i = Math.max(0, this.bucketAt(v[0])); i <= i1; i++) top = Math.max(top, b.res[i], b.hi[i]);
    return top;
  };
  Explorer.prototype.draw = function () {
    var dev = this.dev, b = dev.b, v = this.view;
    var cv = this.setup(this.canvas, 230), g = cv.g, w = cv.w, h = cv.h - 18;
    var sx = function (x) { return (x - v[0]) / (v[1] - v[0]) * w; };
    var i0 = Math.max(0, this.bucketAt(v[0])), i1 = this.bucketAt(v[1]);
    // linked explorers share the scale of bytes too, so equal heights are equal memory
    var top = 1.08 * Math.max.apply(null, this.members().map(function (m) { return m.topIn(v); }));
    var sy = function (y) { return h - y / top * (h - 6); };
    var n = b.x0.length;
    for (var i = i0; i <= i1; i++) {
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
    this.drawMarks(g, sx, sy, h);
    this.drawMatches(g, sx, h);
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
  Explorer.prototype.drawMarks = function (g, sx, sy, h) {
    var dev = this.dev, v = this.view;
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
      var xs = sx(dev.b.xs[this.selected]);
      g.beginPath(); g.moveTo(xs, 0); g.lineTo(xs, h); g.stroke();
    }
  };
  Explorer.prototype.drawMatches = function (g, sx, h) {
    // the search's matches as an orange strip along the bottom of the timeline
    if (!this.match) return;
    var a = this.dev.allocs, end = this.full[1];
    g.fillStyle = "rgba(232,89,12,0.75)";
    for (var i = 0; i < a.x0.length; i++) {
      if (!this.match[i]) continue;
      var xa = sx(a.x0[i]), xb = sx(a.x1[i] === null ? end : a.x1[i]);
      g.fillRect(xa, h - 6, Math.max(xb - xa, 2), 6);
    }
  };
  Explorer.prototype.drawLanes = function (sx) {
    var a = this.dev.allocs, self = this, laneH = Math.max(3, Math.min(8, 180 / this.nLanes));
    var cv = this.setup(this.lanesCanvas, Math.max(40, Math.ceil(laneH * this.nLanes) + 4)), g = cv.g;
    this.laneH = laneH;
    a.x0.forEach(function (x0, i) {
      var x1 = a.x1[i] === null ? self.full[1] : a.x1[i];
      if (self.lanes[i] < 0 || x1 < self.view[0] || x0 > self.view[1]) return;
      g.globalAlpha = self.match && !self.match[i] ? 0.12 : 1;
      g.fillStyle = DATA.colors[self.dev.cats[a.cat[i]]] || "#bab0ac";
      var xa = sx(x0);
      g.fillRect(xa, 2 + self.lanes[i] * laneH, Math.max(sx(x1) - xa, 1.5), Math.max(laneH - 1, 0.5));
    });
    g.globalAlpha = 1;
  };
  Explorer.prototype.allocText = function (i) {
    // what a search reads, line by line: the site, the module and each recorded frame of the
    // allocation's stack (short lines: a pattern that backtracks badly has little to chew on)
    if (!this.texts) this.texts = [];
    if (this.texts[i] === undefined) {
      var a = this.dev.allocs, ids = a.stack[i] >= 0 && DATA.stacks[this.prefix + a.stack[i]];
      this.texts[i] = [this.dev.siteNames[a.site[i]], a.mod[i] >= 0 ? this.dev.modNames[a.mod[i]] : ""]
        .concat(ids ? ids.map(function (f) { return DATA.frames[f]; }) : [])
        .map(function (line) { return line.length > MAX_LINE ? line.slice(0, MAX_LINE) : line; });
    }
    return this.texts[i];
  };
  var SEARCH_BUDGET_MS = 1500; // a search that takes longer stops, and says so
  var MAX_LINE = 500; // characters of a line a search reads (a hostile file's names can be long)
  Explorer.prototype.matches = function (query) {
    // one flag per listed allocation; null when the search ran out of time
    var a = this.dev.allocs, out = [], start = Date.now();
    for (var i = 0; i < a.x0.length; i++) {
      out.push(this.allocText(i).some(function (line) { return query.test(line); }));
      if (Date.now() - start > SEARCH_BUDGET_MS) return null;
    }
    return out;
  };
  Explorer.prototype.search = function (text) {
    var m = matcher(text), a = this.dev.allocs;
    this.searchMsg.textContent = m && m.error ? m.error : "";
    this.query = m && !m.error ? m : null;
    this.match = this.query ? this.matches(this.query) : null;
    if (this.query && !this.match) {
      this.query = null;
      this.searchMsg.textContent = "The search took longer than " + SEARCH_BUDGET_MS / 1000 + " s and was stopped: try a simpler pattern.";
    }
    var count = 0, bytes = 0;
    if (this.match) this.match.forEach(function (hit, i) { if (hit) { count++; bytes += a.size[i]; } });
    this.searchCount.textContent = this.match ? count.toLocaleString("en-US") + " of " +
      a.x0.length.toLocaleString("en-US") + " listed allocations match (" + fmtBytes(bytes) + ")" : "";
    this.root.setAttribute("data-matches", this.match ? String(count) : "");
    this.root.setAttribute("data-searched", text);
    this.draw();
    if (this.selected !== undefined) this.showLive(this.selected);
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
    box.appendChild(stackList(this.dev.allocs.stack[i], this.prefix));
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
  Explorer.prototype.liveRows = function (i) {
    // the listed allocations alive at the bucket's highest point (and matching the search, if any)
    var a = this.dev.allocs, xs = this.dev.b.xs[i], out = [];
    for (var k = 0; k < a.x0.length; k++) {
      if (a.x0[k] <= xs && (a.x1[k] === null || a.x1[k] > xs) && (!this.match || this.match[k])) out.push(k);
    }
    return out.sort(function (p, q) { return a.size[q] - a.size[p]; });
  };
  Explorer.prototype.showLive = function (i) {
    var dev = this.dev, b = dev.b, total = b.hi[i], self = this;
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
    var sites = [], hitSites = {};
    if (this.match) this.match.forEach(function (hit, k) { if (hit) hitSites[dev.siteNames[dev.allocs.site[k]]] = true; });
    dev.sites.forEach(function (s, k) {
      // with a search: the sites it names, and those of the allocations it matches
      var v = dev.siteLv[k] ? dev.siteLv[k][i] : 0;
      if (v > 0 && (!self.query || self.query.test(s) || hitSites[s] === true)) sites.push([s, v]);
    });
    sites.sort(function (p, q) { return q[1] - p[1]; });
    var share = function (v) { return total ? fmtPct(v / total) : ""; };
    var wrap = el("div", "xp-cols");
    var c1 = el("div"), c2 = el("div");
    c1.appendChild(table(["category", "bytes", "share"], cats.map(function (r) { return [r[0], fmtBytes(r[1]), share(r[1])]; })));
    c2.appendChild(table(["site" + (this.query ? " (matching the search)" : ""), "bytes", "share"],
      sites.map(function (r) { return [r[0], fmtBytes(r[1]), share(r[1])]; })));
    wrap.appendChild(c1);
    wrap.appendChild(c2);
    this.live.appendChild(wrap);
    var rows = this.liveRows(i);
    this.live.appendChild(this.allocTable(rows));
    this.flameRoot = null;
    this.showFlame(rows, total);
    this.showSegments(i);
  };
  Explorer.prototype.allocTable = function (rows) {
    var a = this.dev.allocs, dev = this.dev, self = this, shown = rows.slice(0, 12);
    var box = el("div", "xp-live-allocs");
    box.appendChild(el("h4", null, "Listed allocations live here" + (this.query ? " that match the search" : "") + ": " +
      rows.length.toLocaleString("en-US") + (rows.length > shown.length ? " (the largest " + shown.length + " below)" : "")));
    var t = table(["allocation", "size", "lifetime"], shown.map(function (k) {
      return [dev.siteNames[a.site[k]] + " · " + dev.cats[a.cat[k]], fmtBytes(a.size[k]), fmtSpan(dev, a.x0[k], a.x1[k])];
    }));
    t.className = "xp-live-table";
    Array.prototype.forEach.call(t.querySelectorAll("tbody tr"), function (tr, n) {
      tr.addEventListener("click", function () { self.showAlloc(shown[n]); });
    });
    box.appendChild(t);
    return box;
  };
  Explorer.prototype.flameTree = function (rows) {
    var a = this.dev.allocs, self = this;
    var root = { name: "listed allocations live here", bytes: 0, kids: new Map() };
    rows.forEach(function (k) {
      var ids = a.stack[k] >= 0 && DATA.stacks[self.prefix + a.stack[k]];
      var path = ids && ids.length ? ids.slice().reverse().map(function (f) { return DATA.frames[f]; }) : ["(no stack recorded)"];
      root.bytes += a.size[k];
      var node = root;
      path.forEach(function (name) {
        var next = node.kids.get(name);
        if (!next) { next = { name: name, bytes: 0, kids: new Map() }; node.kids.set(name, next); }
        next.bytes += a.size[k];
        node = next;
      });
    });
    return root;
  };
  Explorer.prototype.showFlame = function (rows, total) {
    var self = this, box = this.flameBox;
    box.textContent = "";
    var tree = this.flameTree(rows), root = this.flameRoot || tree;
    box.appendChild(el("h4", null, "Flame graph of what was live (outermost frame on top, width: bytes)"));
    box.appendChild(el("p", "note", fmtBytes(tree.bytes) + " of " + fmtBytes(total) + " requested are in listed allocations" +
      (this.query ? " that match the search" : "") + "; the rest are smaller allocations, only in the levels. " +
      "Click a frame to zoom into it" + (this.flameRoot ? "." : "; click the top bar to zoom out.")));
    var flame = el("div", "xp-flame");
    var depth = 0, ROW = 18;
    function place(node, level, left, width) {
      if (width < 0.002) return;
      var d = el("div", "xp-fl", node.name);
      d.style.left = (100 * left) + "%";
      d.style.width = (100 * width) + "%";
      d.style.top = (level * ROW) + "px";
      d.style.background = level ? hue(node.name) : "#e8ecf0";
      d.title = node.name + ": " + fmtBytes(node.bytes);
      d.setAttribute("data-bytes", String(node.bytes));
      d.addEventListener("click", function () { self.flameRoot = node === root ? null : node; self.showFlame(rows, total); });
      flame.appendChild(d);
      depth = Math.max(depth, level + 1);
      var x = left, kids = Array.from(node.kids.values()).sort(function (p, q) { return q.bytes - p.bytes; });
      kids.forEach(function (c) { var w = width * c.bytes / node.bytes; place(c, level + 1, x, w); x += w; });
    }
    if (root.bytes > 0) place(root, 0, 0, 1);
    flame.style.height = (depth * ROW) + "px";
    box.appendChild(flame);
  };
  Explorer.prototype.momentFor = function (i) {
    var best = null;
    (this.dev.moments || []).forEach(function (m) { if (!best || Math.abs(m.at - i) < Math.abs(best.at - i)) best = m; });
    return best;
  };
  Explorer.prototype.showSegments = function (i) {
    var dev = this.dev, mo = this.momentFor(i), box = this.segBox, self = this;
    box.textContent = "";
    if (!mo || !mo.segs.length) { box.appendChild(el("p", "note", "No segment is known at this moment.")); return; }
    box.setAttribute("data-moment", String(mo.at));
    box.appendChild(el("h4", null, "Allocator segments at " + fmtX(dev, dev.b.xs[mo.at]) +
      (mo.at !== i ? " (the nearest of the " + dev.moments.length + " moments this page carries)" : "")));
    var biggest = 1, reserved = 0, used = 0, bySeg = mo.segs.map(function () { return []; });
    mo.segs.forEach(function (s) { biggest = Math.max(biggest, s[1]); reserved += s[1]; });
    mo.blocks.forEach(function (bk) { bySeg[bk[0]].push(bk); used += bk[2]; });
    var more = mo.more, notes = [mo.segs.length + " segments, " + fmtBytes(reserved) + " reserved, " +
      fmtBytes(used) + " in the allocated blocks drawn (blue, or the listed allocation's category colour); grey: free"];
    if (more[0]) notes.push(more[0] + " smaller segments (" + fmtBytes(more[1]) + ") not drawn");
    if (more[2]) notes.push(more[2] + " smaller blocks (" + fmtBytes(more[3]) + ") not drawn");
    if (!dev.momentsExact) notes.push("expandable segments are drawn by their mapped ranges");
    box.appendChild(el("p", "note", notes.join("; ") + "."));
    var list = el("div", "xp-msegs");
    mo.segs.forEach(function (s, k) {
      var bar = el("div", "xp-mseg");
      bar.style.width = Math.max(1, 100 * s[1] / biggest) + "%";
      bar.title = "segment " + s[0] + ": " + fmtBytes(s[1]);
      bySeg[k].forEach(function (bk) {
        var part = el("span", "xp-mblk");
        part.style.left = (100 * bk[1] / s[1]) + "%";
        part.style.width = Math.max(0.15, 100 * bk[2] / s[1]) + "%";
        var row = bk[3];
        part.style.background = row >= 0 ? (DATA.colors[dev.cats[dev.allocs.cat[row]]] || "#3b6fb6") : "#3b6fb6";
        if (self.match && !(row >= 0 && self.match[row])) part.style.opacity = "0.2";
        part.title = fmtBytes(bk[2]) + " at offset " + fmtBytes(bk[1]) + (row >= 0 ? " · " + dev.siteNames[dev.allocs.site[row]] +
          " (click for its stack)" : " (not listed one by one)");
        if (row >= 0) part.addEventListener("click", function () { self.showAlloc(row); });
        bar.appendChild(part);
      });
      list.appendChild(bar);
    });
    box.appendChild(list);
  };
  Explorer.prototype.histSpan = function (key) {
    // linked explorers draw each histogram over the same bins, so the two files' bars line up
    var lo = Infinity, hi = -Infinity;
    this.members().forEach(function (m) {
      var h = m.dev.hist && m.dev.hist[key];
      if (h && h.n.length) { lo = Math.min(lo, h.low); hi = Math.max(hi, h.low + h.n.length); }
    });
    return this.group && lo < hi ? [lo, hi] : null;
  };
  Explorer.prototype.showHistograms = function () {
    var dev = this.dev, h = dev.hist, box = this.histBox;
    if (!h) return;
    box.textContent = "";
    var bySeconds = dev.axis === "time_s" && h.lifeSeconds, life = bySeconds ? "lifeSeconds" : "lifeEvents";
    box.appendChild(histChart("Allocation sizes (every allocation of the trace)", padded(h.size, this.histSpan("size")),
      function (k) { return fmtBytes(Math.pow(2, k)); }, "xp-hist-size"));
    box.appendChild(histChart("Lifetimes, " + (bySeconds ? "in time" : "in allocator events"),
      padded(h[life], this.histSpan(life)),
      bySeconds ? function (k) { return fmtSeconds(Math.pow(2, k)); }
        : function (k) { return Math.pow(2, k).toLocaleString("en-US") + " ev"; }, "xp-hist-life"));
  };
  function linkGroup(group) {
    // the diff page: one time axis from the earliest start to the latest end of the two traces
    var lo = Infinity, hi = -Infinity;
    group.members.forEach(function (m) { m.layoutFull(); lo = Math.min(lo, m.full[0]); hi = Math.max(hi, m.full[1]); });
    group.members.forEach(function (m) { m.full = [lo, hi]; m.lanes = m.pack(); m.view = [lo, hi]; });
    group.members.forEach(function (m) { m.draw(); m.showHistograms(); });
  }

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

  var group = DATA.linked ? { members: [] } : null;
  DATA.devices.forEach(function (dev) {
    var root = document.getElementById(dev.dom || "explorer-" + dev.device);
    if (root && dev.b) {
      root.hidden = false;
      var explorer = new Explorer(root.querySelector(".xp-time"), dev, group);
      if (group) group.members.push(explorer);
    }
    var lay = document.getElementById("layout-explorer-" + dev.device);
    if (lay && dev.segments.length) { lay.hidden = false; Layout(lay, dev); }
  });
  if (group && group.members.length) linkGroup(group);
  document.documentElement.setAttribute("data-explorer", "ready");
})();
