/**
 * The per-rank table of a cluster in the sidebar.
 *
 * One table, two layouts: at the sidebar's default width (about 250 px) each rank is a
 * card whose figures wrap onto lines, each cell labelled (``data-label``, drawn by CSS);
 * from about 520 px it is an ordinary table with a header row. CSS container queries
 * switch between them, so nothing is cut off at any width and the DOM (and what the
 * end-to-end test reads) stays the same.
 */
import { ICluster, IRankRow } from './api';
import { compact } from './charts';

type Column = keyof IRankRow | 'seen' | 'gpu_util' | 'gpu_mem' | 'gpu_temp' | 'flag';

const COLUMNS: [Column, string][] = [
  ['rank', 'rank'],
  ['state', 'state'],
  ['step', 'step'],
  ['loss', 'loss'],
  ['samples_per_s', 'samples/s'],
  ['memory_mib', 'MiB'],
  ['seen', 'seen'],
  ['host', 'host'],
  ['device', 'device'],
  ['flag', 'straggler']
];

// After samples/s, only when some rank of the cluster logged flops.
const FLOPS_COLUMNS: [Column, string][] = [
  ['tflops', 'TFLOP/s'],
  ['mfu', 'MFU']
];

// After memory, only when some rank of the cluster reported a GPU.
const GPU_COLUMNS: [Column, string][] = [
  ['gpu', 'GPU'],
  ['gpu_util', 'util'],
  ['gpu_mem', 'GPU mem'],
  ['gpu_temp', 'temp']
];

function columnsFor(cluster: ICluster): [Column, string][] {
  const rate: [Column, string] = ['samples_per_s', cluster.rate_key === 'tokens_per_s' ? 'tokens/s' : 'samples/s'];
  const flops = cluster.ranks.some(r => r.tflops !== undefined) ? FLOPS_COLUMNS : [];
  const gpu = cluster.ranks.some(r => r.gpu) ? GPU_COLUMNS : [];
  const out: [Column, string][] = [];
  for (const column of COLUMNS) {
    out.push(column[0] === 'samples_per_s' ? rate : column);
    if (column[0] === 'samples_per_s') {
      out.push(...flops);
    }
    if (column[0] === 'memory_mib') {
      out.push(...gpu);
    }
  }
  return out;
}

function figure(value: number | null | undefined, unit: string): string {
  return value === null || value === undefined ? '?' : `${value.toFixed(0)}${unit}`;
}

function gib(mib: number | null): string {
  return mib === null ? '?' : (mib / 1024).toFixed(1);
}

/** "12 s", "3 min", "1.5 h" since ``seconds`` (Unix time); "–" for null. */
export function ago(seconds: number | null): string {
  if (seconds === null) {
    return '–';
  }
  const dt = Math.max(0, Date.now() / 1000 - seconds);
  return dt < 60 ? `${dt.toFixed(0)} s` : dt < 3600 ? `${(dt / 60).toFixed(0)} min` : `${(dt / 3600).toFixed(1)} h`;
}

/** What holds a stopped rank, and what lets it go on (its cell waits until then). */
function heldTitle(row: IRankRow): string {
  if (row.process === 'stopped') {
    return `Its process is stopped (SIGSTOP, or Ctrl-Z in its terminal): kill -CONT ${row.pid} lets it go on. Its cell waits until then.`;
  }
  return `Its process (pid ${row.pid}) is held by a debugger or tracer attached to it: it goes on once detached. Its cell waits until then.`;
}

function cell(row: IRankRow, key: Column): string {
  switch (key) {
    case 'seen':
      return ago(row.last_seen);
    case 'loss':
      return compact(row.loss);
    case 'samples_per_s':
      return compact(row.samples_per_s);
    case 'tflops':
      return compact(row.tflops);
    case 'mfu':
      return row.mfu === null || row.mfu === undefined ? '–' : `${(100 * row.mfu).toFixed(1)} %`;
    case 'memory_mib':
      return row.memory_mib === null ? '–' : row.memory_mib.toFixed(0);
    case 'gpu':
      return row.gpu ? figure(row.gpu.index, '') : '–';
    case 'gpu_util':
      return row.gpu ? figure(row.gpu.util, ' %') : '–';
    case 'gpu_mem':
      return row.gpu ? `${gib(row.gpu.mem_used_mib)}/${gib(row.gpu.mem_total_mib)} GiB` : '–';
    case 'gpu_temp':
      return row.gpu ? figure(row.gpu.temp_c, ' °C') : '–';
    case 'flag':
      return row.straggler ? `⚠ ${row.straggler}` : '';
    case 'state':
      // A stopped (or debugger-held) process runs nothing until let go: its cell waits.
      return row.process ? `${row.state} · ${row.process}` : row.state;
    default: {
      const value = (row as any)[key];
      return value === null || value === undefined ? '–' : String(value);
    }
  }
}

/** A new, empty rank table (``updateRankTable`` fills it). */
export function rankTable(): HTMLTableElement {
  const table = document.createElement('table');
  table.className = 'nbdist-ranks';
  table.createTHead().insertRow();
  table.createTBody();
  return table;
}

/** Bring ``table`` up to date with ``cluster``'s ranks; ``colour`` gives each rank's swatch. */
export function updateRankTable(
  table: HTMLTableElement,
  cluster: ICluster,
  colour: (rank: number) => string
): void {
  const columns = columnsFor(cluster);
  const header = table.tHead!.rows[0];
  const keys = columns.map(([key, label]) => `${key}:${label}`).join(' ');
  if (header.dataset.columns !== keys) {
    // GPU columns come (or go) with the first (or last) GPU reading; TFLOP/s and MFU with flops
    header.dataset.columns = keys;
    header.replaceChildren(
      ...columns.map(([key, label]) => {
        const th = document.createElement('th');
        th.className = `nbdist-col-${key}`;
        th.textContent = label;
        return th;
      })
    );
  }
  const body = table.tBodies[0];
  while (body.rows.length > cluster.ranks.length) {
    body.deleteRow(-1);
  }
  cluster.ranks.forEach((row, i) => {
    const tr = body.rows[i] ?? body.insertRow();
    tr.className = `nbdist-rank nbdist-state-${row.state}${row.straggler ? ' nbdist-straggler' : ''}`;
    tr.dataset.rank = String(row.rank);
    tr.dataset.state = row.state;
    tr.dataset.straggler = row.straggler;
    tr.dataset.process = row.process ?? '';
    while (tr.cells.length > columns.length) {
      tr.deleteCell(-1);
    }
    columns.forEach(([key, label], j) => {
      const td = tr.cells[j] ?? tr.insertCell();
      td.className = `nbdist-col-${key}`;
      td.dataset.label = label; // the card layout's label
      const text = cell(row, key);
      if (key === 'rank') {
        const swatch = document.createElement('span');
        swatch.className = 'nbdist-swatch';
        swatch.style.background = colour(row.rank);
        td.replaceChildren(swatch, text);
      } else if (td.textContent !== text) {
        td.textContent = text;
      }
      if (key === 'flag' && row.straggler) {
        td.title = `A straggler, by the notebook dashboard's rule: ${row.straggler}`;
      } else if (key === 'state' && row.process) {
        td.title = heldTitle(row);
      } else if (key.startsWith('gpu') && row.gpu && row.gpu.time !== null) {
        td.title = `GPU ${figure(row.gpu.index, '')}, read ${ago(row.gpu.time)} ago (the whole GPU's figures)`;
      } else {
        td.removeAttribute('title');
      }
    });
  });
}
