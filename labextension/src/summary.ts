/**
 * A cluster of many ranks in the sidebar (above 8): the notebook dashboard's summary
 * instead of a card per rank.
 *
 * First the ranks counted by state (a stopped or held rank counted in its state and said
 * beside it), then one row per host (its ranks by state, step range and total rate), then
 * the ranks that deviate — dead, stopped or held, stragglers, busy while the others are
 * idle — each with why. The charts draw the median across ranks and the first few
 * deviating ranks only; those take distinct colours by their place in the list.
 */
import { ICluster, IHeldCounts } from './api';
import { compact } from './charts';

/** Ranks drawn on their own in the charts at most (the first deviating ones). */
export const DRAWN_RANKS = 4;

/** The chart key of the median line (ranks are 0 and up). */
export const MEDIAN = -1;

/** ``12 busy (1 stopped) · 1 dead``: a held rank counts in its state, and is said beside it. */
function states(counts: { [state: string]: number }, held: IHeldCounts = {}): string {
  return ['busy', 'idle', 'dead']
    .filter(s => counts[s])
    .map(s => {
      const inside = Object.entries(held[s] ?? {})
        .sort(([a], [b]) => a.localeCompare(b))
        .map(([word, n]) => `${n} ${word}`)
        .join(', ');
      return `${counts[s]} ${s}` + (inside ? ` (${inside})` : '');
    })
    .join(' · ');
}

/** A new, empty summary box (``updateSummary`` fills it). */
export function summaryBox(): HTMLElement {
  const box = document.createElement('div');
  box.className = 'nbdist-summary';
  return box;
}

/** The ranks the charts draw on their own, in the order of their colours. */
export function drawnRanks(cluster: ICluster): number[] {
  return (cluster.summary?.deviating ?? []).slice(0, DRAWN_RANKS).map(d => d.rank);
}

/** Fill ``box`` with ``cluster``'s summary; ``colour`` gives a drawn rank's swatch. */
export function updateSummary(box: HTMLElement, cluster: ICluster, colour: (rank: number) => string): void {
  const summary = cluster.summary!;
  const key = JSON.stringify(summary);
  if (box.dataset.key === key) {
    return;
  }
  box.dataset.key = key;
  const counts = document.createElement('div');
  counts.className = 'nbdist-summary-states';
  counts.textContent = `${cluster.ranks.length} ranks: ${states(summary.states, summary.held)}`;

  const hosts = document.createElement('table');
  hosts.className = 'nbdist-hosts';
  const head = hosts.createTHead().insertRow();
  for (const label of ['host', 'ranks', 'step', cluster.rate_key === 'tokens_per_s' ? 'tokens/s' : 'samples/s']) {
    const th = document.createElement('th');
    th.textContent = label;
    head.appendChild(th);
  }
  const body = hosts.createTBody();
  for (const host of summary.hosts) {
    const tr = body.insertRow();
    tr.className = 'nbdist-host';
    tr.dataset.host = host.host;
    tr.dataset.ranks = String(host.ranks);
    const step =
      host.step_min === null ? '–' : host.step_min === host.step_max ? `${host.step_max}` : `${host.step_min}–${host.step_max}`;
    const cells = [host.host, `${host.ranks} (${states(host.states, host.held)})`, step, compact(host.samples_per_s)];
    for (const text of cells) {
      tr.insertCell().textContent = text;
    }
  }

  const deviating = document.createElement('ul');
  deviating.className = 'nbdist-deviating';
  const drawn = drawnRanks(cluster);
  if (!summary.deviating.length) {
    const li = document.createElement('li');
    li.className = 'nbdist-deviating-none';
    li.textContent = 'No rank deviates: none dead, no straggler, all in the same state.';
    deviating.appendChild(li);
  }
  for (const d of summary.deviating) {
    const li = document.createElement('li');
    li.className = `nbdist-deviating-rank${d.why === 'dead' ? ' nbdist-state-dead' : ''}`;
    li.dataset.rank = String(d.rank);
    li.dataset.why = d.why;
    const swatch = document.createElement('span');
    swatch.className = 'nbdist-swatch';
    if (drawn.includes(d.rank)) {
      swatch.style.background = colour(d.rank);
    }
    li.append(swatch, `rank ${d.rank} (${d.host}): ${d.why}`);
    deviating.appendChild(li);
  }
  if (summary.more) {
    const li = document.createElement('li');
    li.textContent = `and ${summary.more} more (%dist_status --all lists every rank)`;
    deviating.appendChild(li);
  }
  box.replaceChildren(counts, hosts, deviating);
}
