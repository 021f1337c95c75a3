// nbdist live dashboard (anywidget ES module).
//
// The kernel sends a "snapshot" (every panel's decimated traces) when the widget is made, and
// afterwards only "delta" messages holding the new points, appended with Plotly.extendTraces; a
// trace the kernel re-decimated comes whole in "reset". Messages land in a per-model store (set up in
// initialize, so none is lost before a view exists); each view draws from the store and then
// follows the deltas. The per-rank table is the synced `table` trait: it works without Plotly and
// is kept in saved widget state.
//
// Plotly comes from window.Plotly, else from {baseUrl}nbdist/static/plotly.min.js (the nbdist
// jupyter_server extension); never from the widget state, which stays a few KB.

const STORES = new Map(); // widget uid -> store
let plotlyPromise = null;

function loadPlotly(version) {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (plotlyPromise) return plotlyPromise;
  plotlyPromise = new Promise((resolve, reject) => {
    let base = "/";
    try {
      const config = document.getElementById("jupyter-config-data");
      if (config) base = JSON.parse(config.textContent).baseUrl || "/";
    } catch (e) {
      // no page config (VS Code, static HTML): try the root
    }
    if (!base.endsWith("/")) base += "/";
    const script = document.createElement("script");
    script.src = `${base}nbdist/static/plotly.min.js${version ? `?v=${encodeURIComponent(version)}` : ""}`;
    // An AMD loader on the page (classic notebook's require.js) would take the UMD bundle
    // instead of setting window.Plotly: hide it while the script runs.
    const amd = window.define;
    window.define = undefined;
    const timer = setTimeout(() => finish(new Error("timed out")), 20000);
    function finish(error) {
      clearTimeout(timer);
      window.define = amd;
      if (!error && window.Plotly) {
        resolve(window.Plotly);
      } else {
        plotlyPromise = null; // a later view may try again
        reject(error || new Error("plotly.min.js did not define window.Plotly"));
      }
    }
    script.onload = () => finish(null);
    script.onerror = () => finish(new Error(`could not load ${script.src}`));
    document.head.appendChild(script);
  });
  return plotlyPromise;
}

function copyPanel(spec) {
  return { ...spec, data: spec.data.map(([xs, ys]) => [xs.slice(), ys.slice()]) };
}

function applyToStore(store, msg) {
  for (const spec of msg.panels || []) store.panels.push(copyPanel(spec));
  for (const [p, i, xs, ys] of msg.reset || []) store.panels[p].data[i] = [xs.slice(), ys.slice()];
  for (const [p, i, xs, ys] of msg.extend || []) {
    const trace = store.panels[p].data[i];
    trace[0] = trace[0].concat(xs);
    trace[1] = trace[1].concat(ys);
  }
}

function initialize({ model }) {
  const uid = model.get("_uid");
  const store = { seq: -1, panels: [], views: new Set(), offset: null, asked: false };
  STORES.set(uid, store);
  const ask = () => {
    if (!store.asked) {
      store.asked = true;
      model.send({ t: "hello" });
    }
  };
  const onMessage = (msg) => {
    if (typeof msg.now === "number") store.offset = msg.now - Date.now() / 1000;
    if (msg.t === "snapshot") {
      store.seq = msg.seq;
      store.panels = msg.panels.map(copyPanel);
      store.asked = false;
      for (const view of store.views) view.reset();
    } else if (msg.t === "delta") {
      if (store.seq < 0 || msg.seq <= store.seq) return; // no base yet, or already in the snapshot
      if (msg.seq !== store.seq + 1) return ask(); // a message went missing: start from a snapshot
      store.seq = msg.seq;
      applyToStore(store, msg);
      for (const view of store.views) view.apply(msg);
    }
  };
  model.on("msg:custom", onMessage);
  // The kernel pushes a snapshot when it makes the widget; after a page reload the model is new and
  // asks for one (answered as soon as the kernel is idle).
  const timer = setTimeout(() => store.seq < 0 && ask(), 1000);
  return () => {
    clearTimeout(timer);
    model.off("msg:custom", onMessage);
    STORES.delete(uid);
  };
}

function cssVar(el, name, fallback) {
  const value = getComputedStyle(el).getPropertyValue(name).trim();
  return value || fallback;
}

function render({ model, el }) {
  const store = STORES.get(model.get("_uid")) || { seq: -1, panels: [], views: new Set() };
  const root = document.createElement("div");
  root.className = "nbdist-dashboard";
  root.dataset.points = "0";
  const note = document.createElement("div");
  note.className = "nbdist-note";
  const grid = document.createElement("div");
  grid.className = "nbdist-plots";
  const tableBox = document.createElement("div");
  tableBox.className = "nbdist-table";
  // The step breakdown (stacked bars, latest steps per rank) and lost points: with the table.
  const bars = document.createElement("div");
  bars.className = "nbdist-breakdown";
  const dropped = document.createElement("div");
  dropped.className = "nbdist-note nbdist-dropped";
  root.append(grid, bars, note, dropped, tableBox);
  el.appendChild(root);

  let Plotly = null;
  const divs = [];
  const color = cssVar(el, "--jp-ui-font-color1", "#333");
  const gridColor = cssVar(el, "--jp-border-color2", "#e0e0e0");

  function countPoints() {
    let total = 0;
    for (const div of divs) {
      const n = (div.data || []).reduce((sum, trace) => sum + trace.x.length, 0);
      div.dataset.points = String(n);
      total += n;
    }
    root.dataset.points = String(total);
  }

  function addPanel(panel) {
    const div = document.createElement("div");
    div.className = "nbdist-panel";
    div.dataset.key = panel.id;
    grid.appendChild(div);
    divs.push(div);
    const last = panel.names.length - 1;
    const traces = panel.names.map((name, i) => ({
      type: "scatter",
      mode: "lines",
      name,
      x: panel.data[i][0].slice(),
      y: panel.data[i][1].slice(),
      line: i === last && panel.aggregate ? { width: 2.5, color, dash: "dot" } : { width: 1.2 },
    }));
    const axis = { gridcolor: gridColor, zerolinecolor: gridColor, automargin: true };
    const layout = {
      title: { text: panel.title, font: { size: 13 } },
      height: 260,
      margin: { l: 50, r: 10, t: 30, b: 35 },
      xaxis: { ...axis, title: { text: panel.xtitle } },
      // MFU is logged as a fraction of the peak: shown as a percentage
      yaxis: panel.id === "mfu" ? { ...axis, tickformat: ".0%", hoverformat: ".1%" } : { ...axis },
      font: { color, size: 11 },
      paper_bgcolor: "rgba(0,0,0,0)",
      plot_bgcolor: "rgba(0,0,0,0)",
      uirevision: panel.id, // keep zoom across re-decimation
    };
    Plotly.newPlot(div, traces, layout, { displaylogo: false, responsive: true });
  }

  function group(items) {
    const byPanel = new Map();
    for (const [p, i, xs, ys] of items || []) {
      if (!byPanel.has(p)) byPanel.set(p, { x: [], y: [], idx: [] });
      const g = byPanel.get(p);
      g.x.push(xs);
      g.y.push(ys);
      g.idx.push(i);
    }
    return byPanel;
  }

  const view = {
    reset() {
      if (!Plotly) return;
      for (const div of divs) Plotly.purge(div);
      divs.length = 0;
      grid.textContent = "";
      for (const panel of store.panels) addPanel(panel);
      countPoints();
    },
    apply(msg) {
      if (!Plotly) return;
      for (let k = divs.length; k < store.panels.length; k++) addPanel(store.panels[k]);
      for (const [p, g] of group(msg.reset)) Plotly.restyle(divs[p], { x: g.x, y: g.y }, g.idx);
      for (const [p, g] of group(msg.extend)) Plotly.extendTraces(divs[p], { x: g.x, y: g.y }, g.idx);
      countPoints();
    },
  };
  store.views.add(view);

  loadPlotly(model.get("_plotly_version"))
    .then((P) => {
      Plotly = P;
      view.reset();
      drawBars();
    })
    .catch((error) => {
      console.warn("nbdist dashboard:", error);
      note.textContent =
        "No plots: plotly.js did not load (enable it with `jupyter server extension enable nbdist.server`). The table still updates.";
    });

  // The table: from the synced trait; "last seen" ticks here, against the kernel's clock.
  function ages() {
    const table = model.get("table") || {};
    const now = store.offset === null ? table.now : Date.now() / 1000 + store.offset;
    for (const cell of tableBox.querySelectorAll("td[data-seen]")) {
      cell.textContent = formatAgo(now - Number(cell.dataset.seen));
    }
  }
  function drawTable() {
    const table = model.get("table") || {};
    if (!table.headers) {
      tableBox.textContent = "";
      return;
    }
    const t = document.createElement("table");
    const head = t.createTHead().insertRow();
    for (const title of table.headers) {
      const th = document.createElement("th");
      th.textContent = title;
      head.appendChild(th);
    }
    const body = t.createTBody();
    for (const row of table.rows) {
      const tr = body.insertRow();
      tr.className = `nbdist-${row.state}${row.flag ? " nbdist-straggler" : ""}`;
      if (row.flag) tr.title = row.flag;
      row.cells.forEach((text, i) => {
        const td = tr.insertCell();
        td.textContent = text;
        if (i === table.seen_col && row.seen !== null) td.dataset.seen = String(row.seen);
      });
    }
    tableBox.replaceChildren(t);
    ages();
  }
  function drawBars() {
    const data = (model.get("table") || {}).breakdown;
    if (!Plotly || !data) return;
    const traces = Object.entries(data.parts).map(([name, ms]) => ({
      type: "bar",
      name,
      x: data.ranks,
      y: ms,
      hovertemplate: "%{y:.1f} ms",
    }));
    const axis = { gridcolor: gridColor, zerolinecolor: gridColor, automargin: true };
    Plotly.react(
      bars,
      traces,
      {
        title: { text: "step breakdown (ms per step, latest steps)", font: { size: 13 } },
        barmode: "stack",
        height: 260,
        margin: { l: 50, r: 10, t: 30, b: 35 },
        xaxis: axis,
        yaxis: axis,
        font: { color, size: 11 },
        paper_bgcolor: "rgba(0,0,0,0)",
        plot_bgcolor: "rgba(0,0,0,0)",
      },
      { displaylogo: false, responsive: true },
    );
  }
  function drawDropped() {
    const counts = Object.entries((model.get("table") || {}).dropped || {}).filter(([, n]) => n > 0);
    const total = counts.reduce((sum, [, n]) => sum + n, 0);
    dropped.textContent = total
      ? `${total} points dropped on the ranks (${counts.map(([r, n]) => `rank ${r}: ${n}`).join(", ")})`
      : "";
  }
  const onTable = () => {
    const table = model.get("table") || {};
    if (store.seq >= 0 && typeof table.now === "number") store.offset = table.now - Date.now() / 1000;
    drawTable();
    drawBars();
    drawDropped();
  };
  model.on("change:table", onTable);
  drawDropped();
  drawTable();
  const ticker = setInterval(ages, 1000);

  return () => {
    clearInterval(ticker);
    model.off("change:table", onTable);
    store.views.delete(view);
    if (Plotly) for (const div of [...divs, bars]) Plotly.purge(div);
  };
}

function formatAgo(seconds) {
  const s = Math.max(0, seconds);
  if (s < 60) return `${s.toFixed(1)} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.floor(s % 60)).padStart(2, "0")}s ago`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m ago`;
}

export default { initialize, render };
