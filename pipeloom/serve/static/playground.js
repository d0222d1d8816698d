/* The playground: controls -> JSON API -> timeline views (PipeloomTimeline). */
(function () {
  "use strict";
  var $ = function (id) { return document.getElementById(id); };
  var fmt = PipeloomTimeline.formatNumber, timer = null, searchId = null, poller = null;
  window.pipeloomPlayground = {updates: 0, searches: 0, plans: 0};

  function call(method, url, body) {
    var init = {method: method, headers: {}};
    if (body !== undefined) { init.body = JSON.stringify(body); init.headers["Content-Type"] = "application/json"; }
    // every refusal is {"error": "<one line>"}; anything else (a proxy's page) is shown as it came
    return fetch(url, init).then(function (r) {
      return r.text().then(function (text) {
        var data = null;
        try { data = JSON.parse(text); } catch (e) { data = null; }
        if (!r.ok) throw new Error((data && data.error) || ("HTTP " + r.status + ": " + text.slice(0, 200)));
        if (data === null) throw new Error("the server's answer is not JSON: " + text.slice(0, 200));
        return data;
      });
    });
  }
  function showError(error) { $("error").textContent = error ? String(error.message || error) : ""; }
  function num(id) { var v = $(id).value; return v === "" ? null : Number(v); }
  function shape() {
    var s = {ranks: num("ranks"), microbatches: num("microbatches"), f: num("f"), b: num("b"), w: num("w"),
             comm: num("comm"), memory_limit: num("memory-limit")};
    if (num("stages-per-rank") !== null) s.stages_per_rank = num("stages-per-rank");
    return s;
  }
  function query(s) {
    return Object.keys(s).filter(function (k) { return s[k] !== null; })
      .map(function (k) { return k + "=" + encodeURIComponent(s[k]); }).join("&");
  }
  function render(target, view) {
    var box = document.createElement("div"); $(target).appendChild(box); PipeloomTimeline.render(box, view);
  }
  var takesStages = {};  // schedule name -> whether it takes stages_per_rank (the catalog's options)
  function update() {
    var s = shape(), name = $("schedule").value, one = Object.assign({}, s);
    if (!takesStages[name]) delete one.stages_per_rank;  // the server refuses it for one schedule that does not take it
    var body = Object.assign({schedule: name}, one);
    $("download-json").href = "/api/schedules/" + name + ".json?" + query(one);
    $("download-csv").href = "/api/schedules/" + name + ".csv?" + query(one);
    var names = Array.prototype.filter.call(document.querySelectorAll("#compare-names input"), function (c) { return c.checked; })
      .map(function (c) { return c.value; });
    if (names.indexOf(name) < 0) names.unshift(name);
    // the view and the comparison each show what they can; a refusal of either is shown above them
    var shown = call("POST", "/api/simulate", body).then(function (answer) {
      $("view").innerHTML = ""; render("view", answer.view); return null;
    }, function (error) { $("view").innerHTML = ""; return error; });
    var compared = call("POST", "/api/compare", Object.assign({names: names}, s)).then(function (answer) {
      var table = $("compare-table");
      table.innerHTML = "<tr><th>schedule</th><th>makespan</th><th>vs best</th><th>bubble</th><th>peak memory</th></tr>";
      answer.rows.forEach(function (row) {
        var tr = document.createElement("tr");
        var cells = row.error ? [row.name, row.error, "", "", ""] :
          [row.name, fmt(row.makespan), row.relative_makespan.toFixed(3), (100 * row.bubble_ratio).toFixed(1) + "%",
           fmt(Math.max.apply(null, row.peak_memory))];
        cells.forEach(function (c) { var td = document.createElement("td"); td.textContent = c; tr.appendChild(td); });
        table.appendChild(tr);
      });
      $("compare-views").innerHTML = ""; answer.views.slice(1).forEach(function (v) { render("compare-views", v); });
      return null;
    }, function (error) { $("compare-table").innerHTML = ""; $("compare-views").innerHTML = ""; return error; });
    Promise.all([shown, compared]).then(function (errors) {
      var lines = errors.filter(Boolean).map(function (e) { return String(e.message || e); });
      showError(lines.length ? lines.filter(function (l, k) { return lines.indexOf(l) === k; }).join("\n") : null);
      window.pipeloomPlayground.updates += 1;
    });
  }
  function later() { clearTimeout(timer); timer = setTimeout(update, 250); }

  function searchDone(job) {
    clearInterval(poller); poller = null; $("search-run").disabled = false; $("search-cancel").disabled = true;
    var r = job.result;
    $("search-status").textContent = job.status + (job.error ? ": " + job.error : "") +
      (r ? " (makespan " + fmt(r.report.makespan) + ", " + r.report.status + ")" : "");
    if (r) {
      $("search-view").innerHTML = ""; render("search-view", r.view);
      var links = document.createElement("div");
      links.innerHTML = 'download: <a id="search-json" download href="/api/searches/' + job.id + '/schedule.json">JSON</a> · ' +
        '<a id="search-csv" download href="/api/searches/' + job.id + '/schedule.csv">torch CSV</a>';
      $("search-view").appendChild(links);
    }
    window.pipeloomPlayground.searches += 1;
  }
  function poll() {
    call("GET", "/api/searches/" + searchId).then(function (job) {
      if (["done", "failed", "cancelled", "timed_out"].indexOf(job.status) >= 0) return searchDone(job);
      var p = job.progress;
      $("search-status").textContent = job.status + (p ? " (" + p.phase + ", " + p.seconds.toFixed(1) + " s): best " +
        (p.best === null ? "-" : fmt(p.best)) + ", bound " + fmt(p.bound) : "");
    }).catch(showError);
  }
  function runSearch() {
    var body = {placement: $("placement").value, ranks: num("search-ranks"), microbatches: num("search-microbatches"),
                time_limit: num("search-time"), split_backward: $("search-split").checked};
    call("POST", "/api/searches", body).then(function (job) {
      showError(null); searchId = job.id; $("search-run").disabled = true; $("search-cancel").disabled = false;
      $("search-status").textContent = job.status; poller = setInterval(poll, 250);
    }).catch(showError);
  }
  function cancelSearch() {
    if (searchId) call("DELETE", "/api/searches/" + searchId).then(searchDone).catch(showError);
  }
  function runPlan() {
    var file = $("costs-file").files[0];
    if (!file) { showError("choose a cost table (pipeloom.costs JSON, from `pipeloom profile --save`)"); return; }
    $("plan-status").textContent = "planning...";
    file.text().then(function (text) {
      var costs;
      try { costs = JSON.parse(text); } catch (e) { throw new Error(file.name + ": not JSON (" + e.message + ")"); }
      var body = {costs: costs, ranks: num("plan-ranks"), global_batch: num("plan-batch")};
      if ($("plan-limit").value) body.memory_limit = $("plan-limit").value;
      return call("POST", "/api/plans", body);
    }).then(function (answer) {
      showError(null);
      var p = answer.plan;
      $("plan-status").textContent = "done in " + answer.seconds.toFixed(2) + " s";
      $("plan-result").innerHTML = "";
      var line = document.createElement("div");
      line.textContent = p.schedule + ", " + p.microbatches + " micro-batches of " + p.microbatch_size +
        ", predicted step " + PipeloomTimeline.formatTime(p.predicted_step_time, {time: "seconds"}) + "; plan: ";
      var a = document.createElement("a"); a.id = "plan-url"; a.href = answer.url; a.textContent = answer.url;
      line.appendChild(a); $("plan-result").appendChild(line);
      $("plan-view").innerHTML = ""; render("plan-view", answer.view);
      window.pipeloomPlayground.plans += 1;
    }).catch(function (e) { $("plan-status").textContent = "failed"; showError(e); });
  }

  call("GET", "/api/schedules").then(function (catalog) {
    catalog.schedules.forEach(function (s) {
      takesStages[s.name] = s.options.indexOf("stages_per_rank") >= 0;
      var o = document.createElement("option"); o.value = s.name; o.textContent = s.name; $("schedule").appendChild(o);
      var l = document.createElement("label"), c = document.createElement("input");
      c.type = "checkbox"; c.value = s.name; c.checked = ["1f1b", "zb-h1", "zbv"].indexOf(s.name) >= 0;
      c.addEventListener("change", later); l.appendChild(c); l.appendChild(document.createTextNode(" " + s.name));
      $("compare-names").appendChild(l);
    });
    catalog.placements.forEach(function (p) {
      var o = document.createElement("option"); o.value = p.name; o.textContent = p.name; $("placement").appendChild(o);
    });
    $("schedule").value = "1f1b"; $("placement").value = "linear";
    ["schedule", "ranks", "microbatches", "stages-per-rank", "f", "b", "w", "comm", "memory-limit"].forEach(function (id) {
      $(id).addEventListener("input", later); $(id).addEventListener("change", later);
    });
    $("search-run").addEventListener("click", runSearch);
    $("search-cancel").addEventListener("click", cancelSearch);
    $("plan-run").addEventListener("click", runPlan);
    update();
  }).catch(showError);
})();
