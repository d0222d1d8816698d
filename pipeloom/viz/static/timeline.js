/* pipeloom timeline view: one canvas of rank rows, one of memory curves, shared zoomable time axis.
   Data comes from pipeloom.viz.html.timeline_data (Python). No network, no libraries.
   Numbers are written as pipeloom.viz.units writes them: 1,456,749 in cost units, 12.345 ms in
   seconds, 85.5 MiB in bytes. */
(function () {
  "use strict";
  if (window.PipeloomTimeline) return;
  var ROW = 22, ROW_GAP = 4, MEM_H = 90, LEFT = 58, RIGHT = 10, AXIS = 20;

  function fmtNumber(v) {
    if (Math.abs(v) >= 1e15) return v.toPrecision(6);
    var t = v.toLocaleString("en-US", {maximumFractionDigits: 3});
    return t === "-0" ? "0" : t;
  }
  function fmtSeconds(v) {
    var a = Math.abs(v), f = a >= 1 ? [1, "s"] : a >= 1e-3 ? [1e-3, "ms"] : [1e-6, "us"];
    return fmtNumber(v / f[0]) + " " + f[1];
  }
  function fmtBytes(v) {
    var names = ["B", "KiB", "MiB", "GiB", "TiB"], k = 0;
    while (Math.abs(v) >= 1024 && k < names.length - 1) { v /= 1024; k++; }
    return (k === 0 ? fmtNumber(Math.round(v)) : v.toFixed(1)) + " " + names[k];
  }
  function fmtTime(v, units) { return units.time === "seconds" ? fmtSeconds(v) : fmtNumber(v); }
  function fmtMemory(v, units) { return units.memory === "bytes" ? fmtBytes(v) : fmtNumber(v); }

  function niceStep(span, count) {
    var raw = span / Math.max(count, 1), p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
  }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function upper(arr, x) { /* first index with arr[i] > x */
    var lo = 0, hi = arr.length;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (arr[mid] > x) hi = mid; else lo = mid + 1; }
    return lo;
  }

  function View(root, data) {
    this.root = root; this.data = data; this.units = data.units;
    this.span = data.makespan > 0 ? data.makespan : 1;
    this.t0 = 0; this.t1 = this.span;
    this.build();
  }
  View.prototype.build = function () {
    var d = this.data, self = this;
    this.root.classList.add("pl-view");
    this.root.innerHTML = "";
    if (d.title) this.root.appendChild(el("div", "pl-title", d.title));
    this.root.appendChild(el("div", "pl-summary", d.summary));
    var bar = el("div", "pl-toolbar");
    [["\u2212", "zoom out", function () { self.zoomBy(2, 0.5); }],
     ["+", "zoom in", function () { self.zoomBy(0.5, 0.5); }],
     ["reset", "show everything", function () { self.setRange(0, self.span); }]].forEach(function (b) {
      var button = el("button", "pl-button", b[0]);
      button.type = "button"; button.title = b[1]; button.addEventListener("click", b[2]);
      bar.appendChild(button);
    });
    bar.appendChild(el("span", "pl-hint", "scroll to zoom, drag to pan, double-click to reset; hover a box for its times (labels show once they fit)"));
    this.root.appendChild(bar);
    var legend = el("div", "pl-legend");
    d.legend.forEach(function (item) {
      var key = el("span", "pl-key"), swatch = el("span", "pl-swatch");
      swatch.style.background = item[1]; key.appendChild(swatch); key.appendChild(document.createTextNode(item[0]));
      legend.appendChild(key);
    });
    this.root.appendChild(legend);
    this.canvas = el("canvas", "pl-canvas pl-timeline");
    this.memCanvas = el("canvas", "pl-canvas pl-memory");
    this.root.appendChild(this.canvas);
    this.root.appendChild(el("div", "pl-hint", "memory held on each rank (rank 0 darkest)" +
                             (d.limit !== null && d.limit !== undefined ? ", dashed: the limit" : "")));
    this.root.appendChild(this.memCanvas);
    this.tip = el("div", "pl-tip"); this.tip.style.display = "none";
    this.root.appendChild(this.tip);
    [this.canvas, this.memCanvas].forEach(function (c) { self.listen(c); });
    this.root.pipeloomView = this;
    this.draw();
    if (window.ResizeObserver) new ResizeObserver(function () { self.draw(); }).observe(this.root);
  };
  View.prototype.width = function () { return Math.max(this.root.clientWidth || 600, 200); };
  View.prototype.x = function (t) { return LEFT + (t - this.t0) / (this.t1 - this.t0) * (this.width() - LEFT - RIGHT); };
  View.prototype.t = function (x) { return this.t0 + (x - LEFT) / (this.width() - LEFT - RIGHT) * (this.t1 - this.t0); };
  View.prototype.setRange = function (t0, t1) {
    var min = this.span * 1e-6;
    if (t1 - t0 < min) { var c = (t0 + t1) / 2; t0 = c - min / 2; t1 = c + min / 2; }
    if (t1 - t0 > this.span) { t0 = 0; t1 = this.span; }
    if (t0 < 0) { t1 -= t0; t0 = 0; }
    if (t1 > this.span) { t0 -= t1 - this.span; t1 = this.span; }
    this.t0 = Math.max(0, t0); this.t1 = t1;
    this.root.setAttribute("data-range", this.t0 + "," + this.t1);
    this.draw();
  };
  View.prototype.zoomBy = function (factor, at) {
    var span = this.t1 - this.t0, c = this.t0 + at * span, n = span * factor;
    this.setRange(c - at * n, c - at * n + n);
  };
  View.prototype.setup = function (canvas, h) {
    var ratio = window.devicePixelRatio || 1, w = this.width();
    canvas.style.width = w + "px"; canvas.style.height = h + "px";
    canvas.width = Math.round(w * ratio); canvas.height = Math.round(h * ratio);
    var g = canvas.getContext("2d"); g.setTransform(ratio, 0, 0, ratio, 0, 0); g.clearRect(0, 0, w, h);
    g.font = "11px sans-serif"; g.textBaseline = "middle";
    return g;
  };
  View.prototype.axis = function (g, y) {
    var step = niceStep(this.t1 - this.t0, Math.max(2, Math.floor(this.width() / 110))), w = this.width();
    g.fillStyle = "#444"; g.strokeStyle = "#999"; g.textAlign = "center";
    for (var v = Math.ceil(this.t0 / step) * step; v <= this.t1 + step * 1e-9; v += step) {
      var x = this.x(v); g.beginPath(); g.moveTo(x, y); g.lineTo(x, y + 4); g.stroke();
      g.fillText(fmtTime(v, this.units), x, y + 12);
    }
    g.textAlign = "right";
    g.fillText(this.units.time === "seconds" ? "time" : "time (cost units)", w - RIGHT, y + 12 + 12);
  };
  View.prototype.draw = function () {
    var d = this.data, n = d.ranks.length, h = n * (ROW + ROW_GAP) + AXIS + 16, self = this;
    var g = this.setup(this.canvas, h), w = this.width(), plot = w - LEFT - RIGHT;
    var labels = this.labelsFit();
    g.save();
    for (var r = 0; r < n; r++) {
      var y = r * (ROW + ROW_GAP), rank = d.ranks[r];
      g.fillStyle = "#EEEEEE"; g.fillRect(LEFT, y, plot, ROW);
      g.fillStyle = "#222"; g.textAlign = "right"; g.fillText("rank " + r, LEFT - 6, y + ROW / 2);
      g.beginPath(); g.rect(LEFT, y, plot, ROW); g.save(); g.clip();
      var first = Math.max(0, upper(rank.end, this.t0) - 1), last = upper(rank.start, this.t1);
      for (var i = first; i < last; i++) {
        var x0 = this.x(rank.start[i]), x1 = this.x(rank.end[i]), bw = Math.max(x1 - x0, 0.5);
        var comm = rank.comm[i], color = d.colors[rank.color[i]];
        g.fillStyle = color;
        if (comm) { g.fillRect(x0, y + ROW - 5, bw, 5); continue; }
        g.fillRect(x0, y, bw, ROW - (d.lowered ? 7 : 0));
        if (bw > 3) { g.fillStyle = "#fff"; g.fillRect(x1 - 0.5, y, 0.5, ROW); }
        var label = rank.label[i];
        if (labels && label && bw > label.length * 6.6 + 4) {
          g.fillStyle = d.textColors[rank.color[i]]; g.textAlign = "center";
          g.fillText(label, (Math.max(x0, LEFT) + Math.min(x1, w - RIGHT)) / 2, y + ROW / 2);
        }
      }
      g.restore();
    }
    this.axis(g, n * (ROW + ROW_GAP));
    g.restore();
    this.drawMemory();
    this.root.setAttribute("data-drawn", String((+this.root.getAttribute("data-drawn") || 0) + 1));
    void self;
  };
  /* Labels are drawn when at least half the visible boxes fit theirs (as the pictures decide), so a
     dense view is not half-labelled; zooming in brings them back. */
  View.prototype.labelsFit = function () {
    var d = this.data, visible = 0, fit = 0;
    for (var r = 0; r < d.ranks.length; r++) {
      var rank = d.ranks[r], first = Math.max(0, upper(rank.end, this.t0) - 1), last = upper(rank.start, this.t1);
      for (var i = first; i < last; i++) {
        if (rank.comm[i]) continue;
        visible++;
        if (this.x(rank.end[i]) - this.x(rank.start[i]) > rank.label[i].length * 6.6 + 4) fit++;
      }
    }
    return visible > 0 && fit * 2 >= visible;
  };
  View.prototype.memTop = function () {
    var top = this.data.limit || 0, low = 0;
    this.data.memory.forEach(function (c) { c[1].forEach(function (v) { if (v > top) top = v; if (v < low) low = v; }); });
    return [low, top > 0 ? top * 1.12 : 1];
  };
  View.prototype.drawMemory = function () {
    var d = this.data, g = this.setup(this.memCanvas, MEM_H + AXIS + 16), w = this.width(), range = this.memTop();
    var yOf = function (v) { return 4 + (MEM_H - 8) * (1 - (v - range[0]) / (range[1] - range[0])); };
    g.fillStyle = "#F7F7F7"; g.fillRect(LEFT, 0, w - LEFT - RIGHT, MEM_H);
    g.textAlign = "right";
    var ticks = [range[0], (range[0] + range[1] / 1.12) / 2, range[1] / 1.12];
    ticks.forEach(function (v) { g.fillStyle = "#666"; g.fillText(fmtMemory(v, d.units), LEFT - 6, yOf(v)); });
    g.save(); g.beginPath(); g.rect(LEFT, 0, w - LEFT - RIGHT, MEM_H); g.clip();
    for (var r = 0; r < d.memory.length; r++) {
      var times = d.memory[r][0], held = d.memory[r][1];
      g.strokeStyle = d.rankColors[r]; g.lineWidth = 1.2; g.beginPath();
      var k = Math.max(0, upper(times, this.t0) - 1);
      g.moveTo(this.x(Math.max(times[k], this.t0 - (this.t1 - this.t0))), yOf(held[k]));
      for (var i = k + 1; i < times.length && times[i - 1] <= this.t1; i++) {
        g.lineTo(this.x(times[i]), yOf(held[i - 1])); g.lineTo(this.x(times[i]), yOf(held[i]));
      }
      g.lineTo(this.x(Math.max(this.span, this.t1)), yOf(held[Math.min(i, times.length) - 1]));
      g.stroke();
    }
    if (d.limit !== null && d.limit !== undefined) {
      g.strokeStyle = "#D55E00"; g.setLineDash([5, 3]); g.beginPath();
      g.moveTo(LEFT, yOf(d.limit)); g.lineTo(w - RIGHT, yOf(d.limit)); g.stroke(); g.setLineDash([]);
      g.fillStyle = "#D55E00"; g.textAlign = "right"; g.fillText("limit " + fmtMemory(d.limit, d.units), w - RIGHT - 4, yOf(d.limit) + 8);
    }
    g.restore();
    this.axis(g, MEM_H);
  };
  View.prototype.heldAt = function (r, t) {
    var c = this.data.memory[r], k = Math.max(0, upper(c[0], t) - 1);
    return c[1][k];
  };
  View.prototype.hit = function (canvas, x, y) {
    var t = this.t(x), d = this.data;
    if (x < LEFT || t < 0) return null;
    if (canvas === this.memCanvas) {
      var lines = ["time " + fmtTime(t, this.units)];
      for (var r = 0; r < d.memory.length && r < 16; r++) lines.push("rank " + r + " holds " + fmtMemory(this.heldAt(r, t), this.units));
      return lines.join("\n");
    }
    var rank = Math.floor(y / (ROW + ROW_GAP));
    if (rank < 0 || rank >= d.ranks.length || y - rank * (ROW + ROW_GAP) > ROW) return null;
    var row = d.ranks[rank], i = upper(row.start, t) - 1, slack = (this.t1 - this.t0) / this.width() * 2;
    if (i < 0 || t > row.end[i] + slack) return null;
    return [row.text[i] + " on rank " + rank,
            "start " + fmtTime(row.start[i], this.units) + ", end " + fmtTime(row.end[i], this.units),
            "duration " + fmtTime(row.end[i] - row.start[i], this.units),
            "memory after " + fmtMemory(row.mem[i], this.units)].join("\n");
  };
  View.prototype.listen = function (canvas) {
    var self = this, drag = null;
    canvas.addEventListener("wheel", function (e) {
      e.preventDefault();
      var at = Math.min(Math.max((e.offsetX - LEFT) / (self.width() - LEFT - RIGHT), 0), 1);
      self.zoomBy(e.deltaY > 0 ? 1.25 : 0.8, at);
    }, {passive: false});
    canvas.addEventListener("mousedown", function (e) { drag = {x: e.offsetX, t0: self.t0, t1: self.t1}; });
    window.addEventListener("mouseup", function () { drag = null; });
    canvas.addEventListener("dblclick", function () { self.setRange(0, self.span); });
    canvas.addEventListener("mouseleave", function () { self.tip.style.display = "none"; });
    canvas.addEventListener("mousemove", function (e) {
      if (drag && e.buttons) {
        var dt = (e.offsetX - drag.x) / (self.width() - LEFT - RIGHT) * (drag.t1 - drag.t0);
        self.setRange(drag.t0 - dt, drag.t1 - dt); return;
      }
      var text = self.hit(canvas, e.offsetX, e.offsetY);
      if (!text) { self.tip.style.display = "none"; return; }
      self.tip.textContent = text; self.tip.style.display = "block";
      self.tip.style.left = (canvas.offsetLeft + e.offsetX + 12) + "px";
      self.tip.style.top = (canvas.offsetTop + e.offsetY + 12) + "px";
    });
  };

  window.PipeloomTimeline = {
    render: function (root, data) { return new View(root, data); },
    formatTime: fmtTime, formatMemory: fmtMemory, formatNumber: fmtNumber
  };
})();
