/**
 * The sidebar's small SVG line charts (one line per rank, axis titles, hover read-out)
 * and the rank legend they share. No chart library.
 *
 * The sidebar redraws a few hundred points per rank once a second; plain SVG does that
 * in well under a millisecond and keeps the extension small. The past-run view in the
 * main area uses plotly.js (see runchart.ts), as the notebook dashboard does. Text is
 * coloured by CSS (JupyterLab's theme variables), lines by the server's rank palette.
 */

const SVG = 'http://www.w3.org/2000/svg';

/** rank -> [x, y] points; a null y is a gap (no line drawn across it). */
export type Series = Map<number, [number, number | null][]>;

export interface ILineChartOptions {
  title: string;
  xtitle: string;
  ytitle: string;
  width: number;
  height: number;
  className: string;
  colour: (rank: number) => string;
  /** A line's name in the read-out (default "rank N"; the sidebar names its median line). */
  name?: (rank: number) => string;
}

/** Format a number compactly: 3100 -> "3.1k", 12 -> "12", 0.01234 -> "0.0123". */
export function compact(value: number | null | undefined): string {
  if (value === null || value === undefined || !isFinite(value)) {
    return '–';
  }
  const abs = Math.abs(value);
  if (abs >= 1e6) {
    return (value / 1e6).toFixed(1) + 'M';
  }
  if (abs >= 1e3) {
    return (value / 1e3).toFixed(1) + 'k';
  }
  if (Number.isInteger(value) || abs >= 100) {
    return value.toFixed(0);
  }
  if (abs >= 1) {
    return value.toFixed(2);
  }
  return value.toPrecision(3);
}

function svgText(x: number, y: number, text: string, cls: string, anchor = 'start'): SVGTextElement {
  const el = document.createElementNS(SVG, 'text');
  el.setAttribute('x', String(x));
  el.setAttribute('y', String(y));
  el.setAttribute('text-anchor', anchor);
  el.setAttribute('class', cls);
  el.textContent = text;
  return el;
}

/** The point of ``points`` (sorted by x) nearest to ``x``. */
function nearest(points: [number, number][], x: number): [number, number] | null {
  if (!points.length) {
    return null;
  }
  let lo = 0;
  let hi = points.length - 1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (points[mid][0] < x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return Math.abs(points[lo][0] - x) <= Math.abs(points[hi][0] - x) ? points[lo] : points[hi];
}

/**
 * A chart of ``series`` (rank -> [x, y] points): a box holding the SVG and its hover read-out.
 *
 * The SVG gets ``options.className``; each polyline carries ``data-rank``,
 * ``data-points`` (how many points it drew) and ``data-last-x`` (its newest x), which is
 * what the end-to-end test reads to see a chart advance.
 */
export function lineChart(series: Series, options: ILineChartOptions): HTMLElement {
  const { width, height } = options;
  const pad = { left: 44, right: 8, top: 16, bottom: 28 };
  const box = document.createElement('div');
  box.className = 'nbdist-chart-box';
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('class', `nbdist-chart ${options.className}`);
  svg.setAttribute('width', String(width));
  svg.setAttribute('height', String(height));
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  svg.setAttribute('role', 'img');
  svg.setAttribute('aria-label', `${options.title}: ${options.ytitle} against ${options.xtitle}, one line per rank`);
  box.appendChild(svg);

  let xmin = Infinity;
  let xmax = -Infinity;
  let ymin = Infinity;
  let ymax = -Infinity;
  for (const points of series.values()) {
    for (const [x, y] of points) {
      if (y === null) {
        continue; // a gap (a past run's loop run again)
      }
      xmin = Math.min(xmin, x);
      xmax = Math.max(xmax, x);
      ymin = Math.min(ymin, y);
      ymax = Math.max(ymax, y);
    }
  }
  svg.appendChild(svgText(pad.left, 11, options.title, 'nbdist-chart-title'));
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  // Axis titles: x under the tick labels, y rotated along the left edge.
  svg.appendChild(svgText(pad.left + plotW / 2, height - 2, options.xtitle, 'nbdist-chart-axis-title nbdist-chart-xtitle', 'middle'));
  const ytitle = svgText(0, 0, options.ytitle, 'nbdist-chart-axis-title nbdist-chart-ytitle', 'middle');
  ytitle.setAttribute('transform', `translate(10 ${pad.top + plotH / 2}) rotate(-90)`);
  svg.appendChild(ytitle);
  if (!isFinite(xmin)) {
    svg.appendChild(svgText(pad.left + plotW / 2, pad.top + plotH / 2, 'no points yet', 'nbdist-chart-empty', 'middle'));
    return box;
  }
  if (xmax === xmin) {
    xmax = xmin + 1;
  }
  if (ymax === ymin) {
    ymax = ymin + Math.max(1e-9, Math.abs(ymin) * 0.01);
  }
  const sx = (x: number) => pad.left + ((x - xmin) / (xmax - xmin)) * plotW;
  const sy = (y: number) => pad.top + plotH - ((y - ymin) / (ymax - ymin)) * plotH;

  const frame = document.createElementNS(SVG, 'rect');
  frame.setAttribute('x', String(pad.left));
  frame.setAttribute('y', String(pad.top));
  frame.setAttribute('width', String(plotW));
  frame.setAttribute('height', String(plotH));
  frame.setAttribute('class', 'nbdist-chart-frame');
  svg.appendChild(frame);
  svg.appendChild(svgText(pad.left - 3, pad.top + 8, compact(ymax), 'nbdist-chart-label', 'end'));
  svg.appendChild(svgText(pad.left - 3, pad.top + plotH, compact(ymin), 'nbdist-chart-label', 'end'));
  svg.appendChild(svgText(pad.left, pad.top + plotH + 11, compact(xmin), 'nbdist-chart-label'));
  svg.appendChild(svgText(width - pad.right, pad.top + plotH + 11, compact(xmax), 'nbdist-chart-label', 'end'));

  const ranks = [...series.keys()].sort((a, b) => a - b);
  for (const rank of ranks) {
    // A null y is a gap (a past run's loop run again): a polyline per stretch between gaps.
    const stretches: [number, number][][] = [[]];
    for (const point of series.get(rank)!) {
      if (point[1] === null) {
        stretches.push([]);
      } else {
        stretches[stretches.length - 1].push(point as [number, number]);
      }
    }
    for (const points of stretches.filter((p, i) => p.length || i === 0)) {
      const line = document.createElementNS(SVG, 'polyline');
      line.setAttribute('points', points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(' '));
      line.setAttribute('fill', 'none');
      line.setAttribute('stroke', options.colour(rank));
      line.setAttribute('stroke-width', '1.5');
      line.setAttribute('data-rank', String(rank));
      line.setAttribute('data-points', String(points.length));
      line.setAttribute('data-last-x', points.length ? String(points[points.length - 1][0]) : '');
      svg.appendChild(line);
    }
  }

  // Hover: a cursor line and, beside the chart, each rank's point nearest to it.
  const cursor = document.createElementNS(SVG, 'line');
  cursor.setAttribute('class', 'nbdist-chart-cursor');
  cursor.setAttribute('y1', String(pad.top));
  cursor.setAttribute('y2', String(pad.top + plotH));
  cursor.style.display = 'none';
  svg.appendChild(cursor);
  const readout = document.createElement('div');
  readout.className = 'nbdist-chart-readout';
  readout.hidden = true;
  box.appendChild(readout);
  svg.addEventListener('mousemove', (event: MouseEvent) => {
    const rect = svg.getBoundingClientRect();
    const px = ((event.clientX - rect.left) / rect.width) * width;
    if (px < pad.left || px > pad.left + plotW) {
      cursor.style.display = 'none';
      readout.hidden = true;
      return;
    }
    const x = xmin + ((px - pad.left) / plotW) * (xmax - xmin);
    cursor.setAttribute('x1', px.toFixed(1));
    cursor.setAttribute('x2', px.toFixed(1));
    cursor.style.display = '';
    const rows: HTMLElement[] = [];
    for (const rank of ranks) {
      const point = nearest(series.get(rank)!.filter(p => p[1] !== null) as [number, number][], x);
      if (point) {
        const row = document.createElement('div');
        const swatch = document.createElement('span');
        swatch.className = 'nbdist-swatch';
        swatch.style.background = options.colour(rank);
        const name = options.name ? options.name(rank) : `rank ${rank}`;
        row.append(swatch, `${name} · ${options.xtitle} ${point[0]}: ${compact(point[1])}`);
        rows.push(row);
      }
    }
    readout.replaceChildren(...rows);
    readout.hidden = rows.length === 0;
  });
  svg.addEventListener('mouseleave', () => {
    cursor.style.display = 'none';
    readout.hidden = true;
  });
  return box;
}

/** The legend every chart of a cluster shares: a colour swatch and "rank N" per rank. */
export function rankLegend(
  ranks: number[],
  colour: (rank: number) => string,
  name: (rank: number) => string = rank => `rank ${rank}`
): HTMLElement {
  const legend = document.createElement('div');
  legend.className = 'nbdist-legend';
  for (const rank of ranks) {
    const item = document.createElement('span');
    item.className = 'nbdist-legend-item';
    item.dataset.rank = String(rank);
    const swatch = document.createElement('span');
    swatch.className = 'nbdist-swatch';
    swatch.style.background = colour(rank);
    item.dataset.colour = colour(rank);
    item.append(swatch, name(rank));
    legend.appendChild(item);
  }
  return legend;
}
