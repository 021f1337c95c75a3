// nbdist live dashboard (anywidget ES module).
//
// The kernel sends a "snapshot" (every panel's decimated traces) when the widget is made, and
// afterwards only "delta" messages holding the new points, appended with Plotly.extendTraces; a
// trace the kernel re-decimated comes whole in "reset". Messages land in a per-model store (set up in
// initialize, so none is lost before a view exists); each view draws from the store and then
// follows the deltas. The per-rank table and the header are the synced `table` trait: they work
// without Plotly and are kept in saved widget state.
//
// A view costs nothing while nobody can see it: it draws only while on screen (an
// IntersectionObserver says so); off screen it notes that it is behind and redraws from the store
// when it comes back. A view whose element left the page (JupyterLab re-rendering the output, a
// closed notebook) drops its plots and leaves the store until it is attached again. Plots follow
// their container's width (ResizeObserver), and colours follow JupyterLab's theme, read from its
// CSS variables once the view is on the page and again whenever the theme changes.
//
// A series that has had one value so far on every rank (a fixed learning rate, a batch size) is
// shown as that value, not as a flat line; it becomes a plot when it changes.
//
// Plotly comes from window.Plotly, else from {baseUrl}nbdist/static/plotly.min.js (the nbdist
// jupyter_server extension); never from the widget state, which stays a few KB.

const STORES = new Map(); // widget uid -> store
// Counters a test (or a curious user) can read in the page: views drawing, redraws made.
const STATS = (globalThis.nbdistDashboardStats ||= {
  views: 0, // views in a store (attached to the page)
  redraws: 0, // view updates that touched Plotly
  deltas: 0, // delta messages received (per model)
  lastDrawn: 0, // views that drew the latest delta
  maxDrawn: 0, // the most views that drew one delta
  renders: {}, // widget uid -> views made of it (one per display, and per re-display)
  longestUpdateMs: 0, // the longest one delta kept the page busy, every view together
  longestHeatMs: 0, // the longest one step-time heatmap took to draw, every view together
});
let plotlyPromise = null;
const PLOT_HEIGHT = 240;
const BAND_EDGE = "rgba(128,128,128,0.6)"; // the min-max band across ranks: its edges
const BAND_FILL = "rgba(128,128,128,0.22)"; // and its fill
const BAR_COLOURS = { "data loading": "#8f6fb5", compute: "#4f8fc0", communication: "#d9912a" };

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

// -- the store: what the kernel sent, shared by the views of one model ----------------------------

function copyPanel(spec) {
  const panel = { ...spec, data: spec.data.map(([xs, ys]) => [xs.slice(), ys.slice()]) };
  scan(panel);
  return panel;
}

// The lowest and highest value held: equal means the series is constant so far. Min/max
// decimation keeps every bucket's extremes, so this holds for the points logged, not just those kept.
function scan(panel) {
  panel.lo = Infinity;
  panel.hi = -Infinity;
  panel.xlo = Infinity;
  panel.xhi = -Infinity;
  for (const [xs, ys] of panel.data) widen(panel, xs, ys);
}

function widen(panel, xs, ys) {
  for (const y of ys) {
    if (y === null) continue;
    if (y < panel.lo) panel.lo = y;
    if (y > panel.hi) panel.hi = y;
  }
  if (xs.length) {
    panel.xlo = Math.min(panel.xlo, xs[0]);
    panel.xhi = Math.max(panel.xhi, xs[xs.length - 1]);
  }
}

function applyToStore(store, msg) {
  for (const spec of msg.panels || []) store.panels.push(copyPanel(spec));
  // Many ranks: other ranks are drawn on their own now; the panel comes again, whole.
  for (const spec of msg.respec || []) store.panels[spec.index] = copyPanel(spec);
  const rescan = new Set();
  for (const [p, i, xs, ys] of msg.reset || []) {
    store.panels[p].data[i] = [xs.slice(), ys.slice()];
    rescan.add(p);
  }
  for (const [p, i, xs, ys] of msg.extend || []) {
    const trace = store.panels[p].data[i];
    trace[0] = trace[0].concat(xs);
    trace[1] = trace[1].concat(ys);
    widen(store.panels[p], xs, ys);
  }
  for (const p of rescan) scan(store.panels[p]);
}

function initialize({ model }) {
  const uid = model.get("_uid");
  const store = { seq: -1, panels: [], views: new Set(), offset: null, asked: false, heatmap: null };
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
      store.heatmap = msg.heatmap || null;
      store.asked = false;
      for (const view of store.views) view.reset();
    } else if (msg.t === "heatmap") {
      // Many ranks: step time per rank and step bin, the whole grid each time (every ~2 s).
      store.heatmap = msg;
      const began = performance.now();
      for (const view of store.views) view.heat();
      STATS.longestHeatMs = Math.max(STATS.longestHeatMs, performance.now() - began);
    } else if (msg.t === "delta") {
      if (store.seq < 0 || msg.seq <= store.seq) return; // no base yet, or already in the snapshot
      if (msg.seq !== store.seq + 1) return ask(); // a message went missing: start from a snapshot
      store.seq = msg.seq;
      applyToStore(store, msg);
      STATS.deltas += 1;
      const began = performance.now();
      let drawn = 0;
      for (const view of [...store.views]) drawn += view.apply(msg) ? 1 : 0;
      STATS.longestUpdateMs = Math.max(STATS.longestUpdateMs, performance.now() - began);
      STATS.lastDrawn = drawn;
      STATS.maxDrawn = Math.max(STATS.maxDrawn, drawn);
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

// -- theme: JupyterLab's CSS variables, read from the attached element ----------------------------

function readTheme(el) {
  const style = getComputedStyle(el);
  const v = (name) => style.getPropertyValue(name).trim();
  // Outside JupyterLab (VS Code, a static page) the variables are missing: the inherited text
  // colour is the host's, readable on its background; the grid is that colour, faint.
  const fg = v("--jp-ui-font-color1") || style.color || "#333";
  return {
    fg,
    muted: v("--jp-ui-font-color2") || fg,
    grid: v("--jp-border-color2") || "rgba(128, 128, 128, 0.3)",
    bg: v("--jp-layout-color0") || "",
    font: v("--jp-ui-font-family") || style.fontFamily || "sans-serif",
    hoverBg: v("--jp-layout-color1") || "",
  };
}

// -- one view ------------------------------------------------------------------------------------

function render({ model, el }) {
  const uid = model.get("_uid");
  const store = STORES.get(uid) || { seq: -1, panels: [], views: new Set(), heatmap: null };
  STATS.renders[uid] = (STATS.renders[uid] || 0) + 1;
  const palette = model.get("_palette") || [];
  const colour = (i) => (palette.length ? palette[i % palette.length] : undefined);
  const make = (tag, cls, parent) => {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (parent) parent.appendChild(node);
    return node;
  };

  const root = make("div", "nbdist-dashboard");
  root.dataset.points = "0";
  root.dataset.uid = uid;
  const head = make("div", "nbdist-header", root);
  const title = make("span", "nbdist-run", head);
  const facts = make("span", "nbdist-facts", head);
  const progress = make("div", "nbdist-progress", head);
  const progressBar = make("div", "nbdist-progress-bar", progress);
  const gpuLine = make("div", "nbdist-gpu", head);
  const snapshotLine = make("div", "nbdist-snapshot", head); // a frozen view says so
  const legend = make("div", "nbdist-legend", root);
  const tiles = make("div", "nbdist-tiles", root);
  const grid = make("div", "nbdist-plots", root);
  const barsCard = make("div", "nbdist-card nbdist-bars-card", grid);
  const barsHead = make("div", "nbdist-card-head", barsCard);
  make("span", "nbdist-card-title", barsHead).textContent =
    "step breakdown: where each rank's steps go";
  const bars = make("div", "nbdist-breakdown", barsCard);
  // Many ranks: a rank x step heatmap of step time (a straggler is a bright row).
  const heatCard = make("div", "nbdist-card nbdist-heat-card");
  heatCard.hidden = true;
  const heatHead = make("div", "nbdist-card-head", heatCard);
  make("span", "nbdist-card-title", heatHead).textContent = "step time per rank (ms)";
  const heatPlot = make("div", "nbdist-heatmap", heatCard);
  grid.insertBefore(heatCard, barsCard);
  const note = make("div", "nbdist-note", root);
  const dropped = make("div", "nbdist-note nbdist-dropped", root);
  const tableBox = make("div", "nbdist-table", root);
  el.appendChild(root);

  let Plotly = null;
  let theme = null; // read once attached
  // Every plot's axes: the theme's grid colour, margins that fit the labels, and labels kept
  // past the div (plotly hides those by default, and places a title with a standoff beyond
  // the labels it shows: with none shown, in a layout pass where the plot area is squeezed,
  // at Infinity, and the browser logs an error; the div clips them anyway).
  const baseAxis = () => ({
    gridcolor: theme.grid,
    zerolinecolor: theme.grid,
    linecolor: theme.grid,
    automargin: true,
    ticklabeloverflow: "allow",
  });
  let themeKey = "";
  let visible = false;
  let behind = true; // the plots do not show the store yet
  let tableBehind = true;
  let sizeBehind = false; // the width changed while off screen
  let active = false; // in store.views
  const cards = []; // per panel: { card, plot, tile, mode: "plot" | "tile" | null, log }
  const hidden = new Set(); // trace names switched off in the legend

  // -- cards: a plot, or a tile for a constant series --------------------------------------------
  function cardFor(p) {
    if (cards[p]) return cards[p];
    const panel = store.panels[p];
    const card = make("div", "nbdist-card");
    card.dataset.key = panel.id;
    const top = make("div", "nbdist-card-head", card);
    const name = make("span", "nbdist-card-title", top);
    name.textContent = panel.title;
    name.title = panel.id; // the key as logged
    const button = make("button", "nbdist-log", top);
    button.type = "button";
    button.textContent = "log y";
    button.title = "switch the y axis between a linear and a logarithmic scale";
    const plot = make("div", "nbdist-panel", card);
    plot.dataset.key = panel.id;
    const tile = make("div", "nbdist-tile");
    tile.dataset.key = panel.id;
    const entry = { card, plot, tile, button, mode: null, log: null };
    button.addEventListener("click", () => {
      entry.log = !logScale(p);
      drawPanel(p, true);
    });
    grid.insertBefore(card, heatCard);
    cards[p] = entry;
    return entry;
  }

  function logScale(p) {
    const panel = store.panels[p];
    const entry = cards[p];
    if (!(panel.lo > 0)) return false; // a log axis cannot show zero or less
    return entry && entry.log !== null ? entry.log : !!panel.log;
  }

  // Many ranks: a rank drawn on its own takes the colour of its place among those drawn
  // (the same in every panel), so no two of them share one.
  function drawnColour(name) {
    for (const panel of store.panels) {
      if (!panel.summary) continue;
      const drawn = panel.names.filter((n) => /^rank \d+$/.test(n));
      const slot = drawn.indexOf(name);
      if (slot >= 0) return colour(slot);
    }
    return undefined;
  }

  function summaryTraces(p) {
    const panel = store.panels[p];
    const band = panel.names[0] === "median";
    return panel.names.map((name, i) => {
      const trace = {
        type: "scatter",
        mode: "lines",
        name,
        x: panel.data[i][0].slice(),
        y: panel.data[i][1].slice(),
        visible: hidden.has(name) ? "legendonly" : true,
        hovertemplate: `${name}<br>%{x}: %{y:.4g}<extra></extra>`,
      };
      if (band && i === 0) return { ...trace, line: { width: 2.5, color: theme.fg } };
      if (band && (i === 1 || i === 2)) {
        // min, then max filled down to it: the band every rank lies in.
        const edge = { ...trace, line: { width: 0.5, color: BAND_EDGE } };
        return i === 1 ? edge : { ...edge, fill: "tonexty", fillcolor: BAND_FILL };
      }
      if (name === "total") return { ...trace, line: { width: 2.5, color: theme.fg, dash: "dot" } };
      return { ...trace, line: { width: 1.6, color: drawnColour(name) } };
    });
  }

  function traces(p) {
    const panel = store.panels[p];
    if (panel.summary) return summaryTraces(p);
    const last = panel.names.length - 1;
    return panel.names.map((name, i) => {
      const mean = i === last && panel.aggregate;
      return {
        type: "scatter",
        mode: "lines",
        name,
        x: panel.data[i][0].slice(),
        y: panel.data[i][1].slice(),
        visible: hidden.has(name) ? "legendonly" : true,
        line: mean
          ? { width: 2.5, color: theme.fg, dash: "dot" }
          : { width: 1.3, color: colour(i) },
        hovertemplate: `${name}<br>%{x}: %{y:.4g}<extra></extra>`,
      };
    });
  }

  function layout(p) {
    const panel = store.panels[p];
    const axis = { ...baseAxis(), title: { font: { size: 11 }, standoff: 6 } };
    const yaxis = { ...axis, title: { ...axis.title, text: panel.ytitle } };
    if (panel.id === "mfu") Object.assign(yaxis, { tickformat: ".0%", hoverformat: ".1%" });
    if (logScale(p)) {
      yaxis.type = "log";
      // Between one and three decades plotly labels every digit (1, 2, ... 9): they collide on
      // a plot this high. 1, 2 and 5 per decade do not; beyond three, plotly labels decades.
      const span = Math.log10(panel.hi / panel.lo);
      if (span >= 1 && span < 3) yaxis.dtick = "D2";
      // Its minor labels are bare digits by default ("5, 2, 0.1, 5"): label them as values
      // (0.5, 0.2, 0.1, 0.05).
      yaxis.minorloglabels = "complete";
    }
    return {
      autosize: true,
      height: PLOT_HEIGHT,
      margin: { l: 8, r: 12, t: 8, b: 8 },
      showlegend: false, // one legend for every panel, in HTML above them
      xaxis: { ...axis, title: { ...axis.title, text: panel.xtitle } },
      yaxis,
      font: { color: theme.fg, size: 11, family: theme.font },
      hoverlabel: theme.hoverBg ? { bgcolor: theme.hoverBg, font: { color: theme.fg } } : {},
      paper_bgcolor: "rgba(0,0,0,0)",
      plot_bgcolor: "rgba(0,0,0,0)",
      uirevision: `${panel.id}:${logScale(p)}`, // keep zoom across updates, not across a scale change
    };
  }

  // Draw panel p from the store (whole); force: also when it is already a plot.
  function drawPanel(p, force) {
    const panel = store.panels[p];
    const entry = cardFor(p);
    const constant = constantOf(panel);
    if (constant !== null) {
      if (entry.mode === "plot") Plotly.purge(entry.plot);
      if (entry.mode !== "tile") {
        entry.card.remove();
        tiles.appendChild(entry.tile);
      }
      entry.mode = "tile";
      fillTile(entry.tile, panel, constant);
      return;
    }
    if (entry.mode !== "plot") {
      entry.tile.remove();
      grid.insertBefore(entry.card, firstCardAfter(p));
      force = true;
    }
    entry.mode = "plot";
    entry.button.disabled = !(panel.lo > 0);
    entry.button.classList.toggle("nbdist-on", logScale(p));
    entry.button.setAttribute("aria-pressed", String(logScale(p)));
    if (force) Plotly.react(entry.plot, traces(p), layout(p), { displaylogo: false, responsive: false });
  }

  function firstCardAfter(p) {
    for (let k = p + 1; k < cards.length; k++) {
      if (cards[k] && cards[k].mode === "plot") return cards[k].card;
    }
    return heatCard;
  }

  function fillTile(tile, panel, value) {
    tile.replaceChildren();
    make("div", "nbdist-tile-title", tile).textContent = panel.title;
    const shown = panel.id === "mfu" ? `${(100 * value).toPrecision(3)} %` : formatValue(value);
    const unit = panel.id === "mfu" || !panel.unit ? "" : ` ${panel.unit}`;
    make("div", "nbdist-tile-value", tile).textContent = shown + unit;
    const which = panel.ranks || panel.names.length - (panel.aggregate ? 1 : 0);
    const span = panel.xlo === panel.xhi ? `${panel.xtitle} ${panel.xlo}` : `${panel.xtitle} ${panel.xlo}–${panel.xhi}`;
    const ranks = which > 2 ? `all ${which} ranks` : which === 2 ? "both ranks" : "the rank";
    make("div", "nbdist-tile-note", tile).textContent = `the same on ${ranks} so far (${span})`;
    tile.dataset.points = String(panel.data.reduce((n, [xs]) => n + xs.length, 0));
  }

  function countPoints() {
    let total = 0;
    store.panels.forEach((panel, p) => {
      const n = panel.data.reduce((sum, [xs]) => sum + xs.length, 0);
      if (cards[p]) cards[p].plot.dataset.points = cards[p].mode === "plot" ? String(n) : "0";
      total += n;
    });
    root.dataset.points = String(total);
  }

  // A legend swatch like what is drawn: the median a solid line, min and max the grey band,
  // the mean and the total a dotted line.
  function swatchKind(name) {
    if (name === "median") return " nbdist-swatch-median";
    return name === "min" || name === "max" ? " nbdist-swatch-band" : " nbdist-swatch-mean";
  }

  function drawLegend() {
    const names = [];
    for (const panel of store.panels) for (const n of panel.names) if (!names.includes(n)) names.push(n);
    if (legend.dataset.names === names.join("|") && !legend.dataset.stale) return;
    legend.dataset.names = names.join("|");
    delete legend.dataset.stale;
    legend.replaceChildren();
    names.forEach((name) => {
      const item = make("button", "nbdist-legend-item", legend);
      item.type = "button";
      item.title = `show or hide ${name} in every plot`;
      const rank = /^rank (\d+)$/.exec(name);
      const swatch = make("span", `nbdist-swatch${rank ? "" : swatchKind(name)}`, item);
      if (rank) swatch.style.background = drawnColour(name) || colour(Number(rank[1]));
      else if (name === "median") swatch.style.background = "currentColor";
      else if (name === "min" || name === "max") {
        Object.assign(swatch.style, { height: "8px", background: BAND_FILL, border: `1px solid ${BAND_EDGE}` });
      }
      make("span", "", item).textContent = name;
      item.setAttribute("aria-pressed", String(!hidden.has(name)));
      item.classList.toggle("nbdist-off", hidden.has(name));
      item.addEventListener("click", () => {
        if (hidden.has(name)) hidden.delete(name);
        else hidden.add(name);
        legend.dataset.stale = "1";
        drawLegend();
        store.panels.forEach((panel, p) => {
          const i = panel.names.indexOf(name);
          if (i >= 0 && cards[p] && cards[p].mode === "plot") {
            Plotly.restyle(cards[p].plot, { visible: hidden.has(name) ? "legendonly" : true }, [i]);
          }
        });
      });
    });
  }

  function drawHeat() {
    const h = store.heatmap;
    heatCard.hidden = !h;
    if (!h || !Plotly || !visible || !theme) return false;
    const axis = baseAxis();
    const title = (text) => ({ text, font: { size: 11 }, standoff: 6 });
    const span = h.width > 1 ? ` (bins of ${h.width} steps)` : "";
    // The colours span the 1st to the 99th percentile: one straggler (or a slow first step)
    // takes the top colour instead of leaving every other rank in the darkest one.
    const values = h.z.flat().filter((v) => v !== null).sort((a, b) => a - b);
    const at = (q) => values[Math.min(values.length - 1, Math.floor(q * values.length))];
    const [zmin, zmax] = values.length ? [at(0.01), at(0.99)] : [undefined, undefined];
    Plotly.react(
      heatPlot,
      [
        {
          type: "heatmap",
          x: h.x,
          y: h.y,
          z: h.z,
          colorscale: "Viridis",
          zsmooth: false,
          ...(zmax > zmin ? { zmin, zmax } : {}),
          colorbar: { title: { text: "ms", side: "top" }, thickness: 10, outlinewidth: 0 },
          hovertemplate: `rank %{y}<br>step %{x}${h.width > 1 ? "+" : ""}: %{z:.1f} ms<extra></extra>`,
        },
      ],
      {
        autosize: true,
        // 256 ranks get ~1.5 px each; fewer get more, up to the other plots' height.
        height: Math.max(PLOT_HEIGHT, Math.min(420, 2 * h.y.length)),
        margin: { l: 8, r: 12, t: 8, b: 8 },
        xaxis: { ...axis, title: title(`step${span}`) },
        yaxis: { ...axis, title: title("rank"), autorange: "reversed" },
        font: { color: theme.fg, size: 11, family: theme.font },
        hoverlabel: theme.hoverBg ? { bgcolor: theme.hoverBg, font: { color: theme.fg } } : {},
        paper_bgcolor: "rgba(0,0,0,0)",
        plot_bgcolor: "rgba(0,0,0,0)",
        uirevision: "heat",
      },
      { displaylogo: false, responsive: false },
    );
    heatPlot.dataset.ranks = String(h.y.length);
    heatPlot.dataset.columns = String(h.x.length);
    return true;
  }

  // -- drawing: everything, or one delta ---------------------------------------------------------
  function drawAll() {
    if (!Plotly || !visible || !theme) return false;
    store.panels.forEach((_, p) => drawPanel(p, true));
    drawLegend();
    drawHeat();
    drawBars(true);
    countPoints();
    behind = false;
    STATS.redraws += 1;
    return true;
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
      behind = true;
      drawAll();
    },
    heat() {
      if (!root.isConnected) return sleep();
      if (!behind && !drawHeat()) behind = true; // off screen: redrawn whole when back
    },
    // Draw one delta; returns whether this view drew (it skips while off screen).
    apply(msg) {
      if (!root.isConnected) {
        sleep();
        return false;
      }
      if (!Plotly || !visible || !theme || behind) {
        behind = true;
        return false;
      }
      for (let p = cards.length; p < store.panels.length; p++) drawPanel(p, true);
      for (const spec of msg.respec || []) drawPanel(spec.index, true);
      const resets = group(msg.reset);
      const extends_ = group(msg.extend);
      for (const p of new Set([...resets.keys(), ...extends_.keys()])) {
        const entry = cards[p];
        const wasPlot = entry && entry.mode === "plot";
        const wasLog = wasPlot && entry.button.classList.contains("nbdist-on");
        if (!wasPlot || resets.has(p) || constantOf(store.panels[p]) !== null || wasLog !== logScale(p)) {
          drawPanel(p, true); // a tile, a tile turning into a plot, or a re-decimated trace
        } else {
          const g = extends_.get(p);
          Plotly.extendTraces(entry.plot, { x: g.x, y: g.y }, g.idx);
          entry.button.disabled = !(store.panels[p].lo > 0);
        }
      }
      drawLegend();
      countPoints();
      STATS.redraws += 1;
      return true;
    },
  };

  // -- on the page or not: IntersectionObserver, and what it means -------------------------------
  function wake() {
    if (!active) {
      active = true;
      store.views.add(view);
      STATS.views += 1;
      root.dataset.active = "1";
    }
    const next = readTheme(root);
    const key = JSON.stringify(next);
    if (key !== themeKey) {
      theme = next;
      themeKey = key;
      behind = true;
    }
    if (behind) drawAll();
    else if (sizeBehind && Plotly) resizeAll();
    if (tableBehind) onTable();
  }

  function sleep() {
    // The element left the page (its output was re-rendered, or the notebook closed): drop the
    // plots, leave the store. Attached again, it is woken by the observer and redraws.
    if (active) {
      active = false;
      store.views.delete(view);
      STATS.views -= 1;
      root.dataset.active = "0";
    }
    if (Plotly) {
      for (const entry of cards) if (entry && entry.mode === "plot") Plotly.purge(entry.plot);
      Plotly.purge(bars);
      Plotly.purge(heatPlot);
    }
    for (const entry of cards) if (entry) entry.mode = null;
    behind = true;
  }

  const seen = new IntersectionObserver(
    (entries) => {
      const entry = entries[entries.length - 1];
      visible = entry.isIntersecting;
      if (visible) wake();
      else if (!root.isConnected) sleep();
    },
    { rootMargin: "300px" }, // draw a little before it scrolls into view
  );
  seen.observe(root);

  // Plots follow their container's width; off screen, they resize when they come back (a view
  // scrolled away while the sidebar opened would otherwise keep its old, wider layout).
  let resizeFrame = 0;
  function resizeAll() {
    sizeBehind = false;
    const divs = cards.filter((e) => e && e.mode === "plot").map((e) => e.plot);
    if (bars.data) divs.push(bars);
    if (heatPlot.data) divs.push(heatPlot);
    for (const div of divs) {
      const width = (div._fullLayout || {}).width || 0;
      // Only a displayed div can be resized (a hidden one is, when it shows again).
      if (div.offsetParent !== null && div.clientWidth > 0 && Math.abs(div.clientWidth - width) > 1) {
        Plotly.Plots.resize(div).catch(() => {});
      }
    }
  }
  const sized = new ResizeObserver(() => {
    if (resizeFrame) return;
    resizeFrame = requestAnimationFrame(() => {
      resizeFrame = 0;
      if (!Plotly || behind) return; // a redraw from the store is due: it takes the width then
      if (!visible) {
        sizeBehind = true;
        return;
      }
      resizeAll();
    });
  });
  sized.observe(grid);
  sized.observe(root);

  // The theme: JupyterLab marks a change on <body>; the ticker below catches any other host.
  const themed = new MutationObserver(() => visible && wake());
  themed.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-name", "data-jp-theme-light", "class"] });

  loadPlotly(model.get("_plotly_version"))
    .then((P) => {
      Plotly = P;
      if (visible) wake();
    })
    .catch((error) => {
      console.warn("nbdist dashboard:", error);
      note.textContent =
        "No plots: plotly.js did not load (enable it with `jupyter server extension enable nbdist.server`). The table still updates.";
    });

  // -- the header and the table: from the synced trait -------------------------------------------
  function ages() {
    const table = model.get("table") || {};
    const now = store.offset === null ? table.now : Date.now() / 1000 + store.offset;
    for (const cell of tableBox.querySelectorAll("td[data-seen]")) {
      cell.textContent = formatAgo(now - Number(cell.dataset.seen));
    }
  }

  function drawHeader() {
    const h = (model.get("table") || {}).header;
    if (!h) return;
    title.textContent = h.name;
    const parts = [h.detail];
    if (h.last !== null && h.last !== undefined) parts.push(`${formatSpan((h.ended || h.last) - h.started)} elapsed`);
    if (h.step !== null && h.step !== undefined) {
      const of = h.total ? ` of ${h.total}` : "";
      parts.push(`step ${h.step}${of}${h.steps ? ` (ranks at ${h.steps})` : ""}`);
    }
    parts.push(`${Number(h.points).toLocaleString("en")} point${Number(h.points) === 1 ? "" : "s"}`);
    if (h.states) parts.push(h.states);
    // Ranks whose latest loss is NaN/inf: the band (many ranks) leaves them out.
    if (h.nonfinite) parts.push(h.nonfinite);
    facts.textContent = parts.join(" · ");
    progress.hidden = h.progress === null || h.progress === undefined;
    progressBar.style.width = `${100 * (h.progress || 0)}%`;
    progress.title = progress.hidden ? "" : `${(100 * h.progress).toFixed(0)} % of ${h.total} steps`;
    gpuLine.textContent = h.gpu || "";
    snapshotLine.textContent = h.snapshot || "";
    root.classList.toggle("nbdist-final", !!h.snapshot);
  }

  function drawTable() {
    const table = model.get("table") || {};
    if (!table.headers) {
      tableBox.textContent = "";
      return;
    }
    const t = document.createElement("table");
    const head = t.createTHead().insertRow();
    for (const name of table.headers) {
      const th = document.createElement("th");
      th.textContent = name;
      head.appendChild(th);
    }
    const body = t.createTBody();
    for (const row of table.rows) {
      const tr = body.insertRow();
      tr.className = `nbdist-${row.state}${row.flag ? " nbdist-straggler" : ""}`;
      if (row.flag) tr.title = row.flag;
      row.cells.forEach((text, i) => {
        const td = tr.insertCell();
        if (i === 0 && row.state !== "host") {
          // The rank's colour, as in the plots and the legend (a host's row has none).
          const rank = Number.parseInt(text, 10);
          const swatch = make("span", "nbdist-swatch", td);
          if (Number.isFinite(rank)) swatch.style.background = drawnColour(`rank ${rank}`) || colour(rank);
        }
        td.appendChild(document.createTextNode(text));
        if (i === table.seen_col && row.seen !== null) td.dataset.seen = String(row.seen);
      });
    }
    tableBox.replaceChildren(t);
    ages();
  }

  function drawBars(force) {
    const data = (model.get("table") || {}).breakdown;
    barsCard.hidden = !data;
    if (!Plotly || !data || !theme || !visible) return;
    const key = JSON.stringify(data);
    if (!force && bars.dataset.drawn === key) return;
    bars.dataset.drawn = key;
    const traces = Object.entries(data.parts).map(([name, ms]) => ({
      type: "bar",
      name,
      x: data.ranks,
      y: ms,
      marker: { color: BAR_COLOURS[name] },
      hovertemplate: `${name}: %{y:.1f} ms<extra>%{x}</extra>`,
    }));
    const axis = baseAxis();
    Plotly.react(
      bars,
      traces,
      {
        autosize: true,
        barmode: "stack",
        height: PLOT_HEIGHT,
        margin: { l: 8, r: 12, t: 8, b: 8 },
        // Above the plot, in a row: Plotly makes room for it (the margin grows), it covers nothing.
        legend: { orientation: "h", x: 0, xanchor: "left", y: 1.02, yanchor: "bottom" },
        xaxis: { ...axis, title: { text: "rank (mean of its latest 20 steps)", font: { size: 11 }, standoff: 6 } },
        yaxis: { ...axis, title: { text: "ms per step", font: { size: 11 }, standoff: 6 } },
        font: { color: theme.fg, size: 11, family: theme.font },
        paper_bgcolor: "rgba(0,0,0,0)",
        plot_bgcolor: "rgba(0,0,0,0)",
      },
      { displaylogo: false, responsive: false },
    );
  }

  function drawDropped() {
    // The kernel words it (nbdist/dashboard/losses.py): points dropped, values left out.
    dropped.textContent = ((model.get("table") || {}).lost || []).join("\n");
  }

  function onTable() {
    const table = model.get("table") || {};
    if (store.seq >= 0 && typeof table.now === "number") store.offset = table.now - Date.now() / 1000;
    if (!visible) {
      tableBehind = true; // drawn when it comes on screen
      return;
    }
    tableBehind = false;
    drawHeader();
    drawTable();
    drawBars(false);
    drawDropped();
  }
  model.on("change:table", onTable);
  // Drawn once now, so a saved notebook's view and a view without Plotly show the table at once.
  drawHeader();
  drawTable();
  drawDropped();
  const ticker = setInterval(() => {
    if (!visible) return;
    ages();
    // A theme whose change no attribute announced (another host): compare the colours.
    if (themeKey && JSON.stringify(readTheme(root)) !== themeKey) wake();
  }, 1000);

  return () => {
    clearInterval(ticker);
    seen.disconnect();
    sized.disconnect();
    themed.disconnect();
    if (resizeFrame) cancelAnimationFrame(resizeFrame);
    model.off("change:table", onTable);
    sleep();
  };
}

// -- formatting ----------------------------------------------------------------------------------

function constantOf(panel) {
  // The value of a series that has had one value so far (null values aside), else null.
  return panel.lo === panel.hi && Number.isFinite(panel.lo) ? panel.lo : null;
}

function formatValue(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e5 || a < 1e-3) return v.toExponential(3).replace(/\.?0+e/, "e");
  if (Number.isInteger(v)) return v.toLocaleString("en");
  return String(Number(v.toPrecision(4)));
}

function formatSpan(seconds) {
  const s = Math.max(0, seconds);
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

function formatAgo(seconds) {
  return `${formatSpan(seconds)} ago`;
}

export default { initialize, render };
