/**
 * Small SVG line charts: one polyline per rank, no chart library.
 *
 * The sidebar redraws a few hundred points per rank once a second; plain SVG
 * does that in well under a millisecond and keeps the extension small (the
 * notebook dashboard uses plotly.js, served by the server extension, for its
 * richer charts).
 */

const SVG = 'http://www.w3.org/2000/svg';

/** Colours of ranks 0, 1, ... (plotly's default palette, so both views agree). */
export const RANK_COLOURS = [
  '#1f77b4',
  '#ff7f0e',
  '#2ca02c',
  '#d62728',
  '#9467bd',
  '#8c564b',
  '#e377c2',
  '#7f7f7f',
  '#bcbd22',
  '#17becf'
];

export function rankColour(rank: number): string {
  return RANK_COLOURS[rank % RANK_COLOURS.length];
}

export interface ILineChartOptions {
  title: string;
  width: number;
  height: number;
  className: string;
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

/**
 * Draw ``series`` (rank -> [x, y] points) into a new SVG element.
 *
 * Each polyline carries ``data-rank``, ``data-points`` (how many points it
 * drew) and ``data-last-x`` (its newest x), which is also what the end-to-end
 * test reads to see a chart advance.
 */
export function lineChart(
  series: Map<number, [number, number][]>,
  options: ILineChartOptions
): SVGSVGElement {
  const { width, height } = options;
  const pad = { left: 40, right: 6, top: 16, bottom: 14 };
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('class', `nbdist-chart ${options.className}`);
  svg.setAttribute('width', String(width));
  svg.setAttribute('height', String(height));
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);

  let xmin = Infinity;
  let xmax = -Infinity;
  let ymin = Infinity;
  let ymax = -Infinity;
  for (const points of series.values()) {
    for (const [x, y] of points) {
      xmin = Math.min(xmin, x);
      xmax = Math.max(xmax, x);
      ymin = Math.min(ymin, y);
      ymax = Math.max(ymax, y);
    }
  }
  const title = document.createElementNS(SVG, 'text');
  title.setAttribute('x', String(pad.left));
  title.setAttribute('y', '11');
  title.setAttribute('class', 'nbdist-chart-title');
  title.textContent = options.title;
  svg.appendChild(title);
  if (!isFinite(xmin)) {
    const empty = document.createElementNS(SVG, 'text');
    empty.setAttribute('x', String(width / 2));
    empty.setAttribute('y', String(height / 2));
    empty.setAttribute('text-anchor', 'middle');
    empty.setAttribute('class', 'nbdist-chart-empty');
    empty.textContent = 'no points yet';
    svg.appendChild(empty);
    return svg;
  }
  if (xmax === xmin) {
    xmax = xmin + 1;
  }
  if (ymax === ymin) {
    ymax = ymin + Math.max(1e-9, Math.abs(ymin) * 0.01);
  }
  const sx = (x: number) => pad.left + ((x - xmin) / (xmax - xmin)) * (width - pad.left - pad.right);
  const sy = (y: number) =>
    height - pad.bottom - ((y - ymin) / (ymax - ymin)) * (height - pad.top - pad.bottom);

  const frame = document.createElementNS(SVG, 'rect');
  frame.setAttribute('x', String(pad.left));
  frame.setAttribute('y', String(pad.top));
  frame.setAttribute('width', String(width - pad.left - pad.right));
  frame.setAttribute('height', String(height - pad.top - pad.bottom));
  frame.setAttribute('class', 'nbdist-chart-frame');
  svg.appendChild(frame);

  const labels: [string, number, number, string][] = [
    [compact(ymax), pad.left - 3, pad.top + 8, 'end'],
    [compact(ymin), pad.left - 3, height - pad.bottom, 'end'],
    [compact(xmin), pad.left, height - 2, 'start'],
    [compact(xmax), width - pad.right, height - 2, 'end']
  ];
  for (const [text, x, y, anchor] of labels) {
    const label = document.createElementNS(SVG, 'text');
    label.setAttribute('x', String(x));
    label.setAttribute('y', String(y));
    label.setAttribute('text-anchor', anchor);
    label.setAttribute('class', 'nbdist-chart-label');
    label.textContent = text;
    svg.appendChild(label);
  }

  for (const [rank, points] of [...series.entries()].sort((a, b) => a[0] - b[0])) {
    const line = document.createElementNS(SVG, 'polyline');
    line.setAttribute('points', points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(' '));
    line.setAttribute('fill', 'none');
    line.setAttribute('stroke', rankColour(rank));
    line.setAttribute('stroke-width', '1.5');
    line.setAttribute('data-rank', String(rank));
    line.setAttribute('data-points', String(points.length));
    line.setAttribute('data-last-x', points.length ? String(points[points.length - 1][0]) : '');
    const tip = document.createElementNS(SVG, 'title');
    tip.textContent = `rank ${rank}`;
    line.appendChild(tip);
    svg.appendChild(line);
  }
  return svg;
}
