/**
 * Named sessions in the sidebar: sessions started with `%dist_start N --name NAME`
 * outlive their kernel. Each is listed (ranks, state, last step) with two actions:
 * Attach runs `%dist_attach NAME` in the active notebook (whose kernel then drives the
 * session, and shows the output of a cell still running on the ranks), Stop ends the
 * session wherever it runs (`POST nbdist/api/sessions/<name>/stop`).
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { Poll } from '@lumino/polling';

import { requestAPI } from './api';

/** One row of `GET nbdist/api/sessions` (what `%dist_sessions` prints). */
export interface INamedSession {
  name: string;
  ranks: number | null;
  launcher: string;
  started: number | null;
  state: string; // 'starting' | 'running' | 'failed' | 'stopping' | 'gone'
  last_step: number | null;
  run_id: number | null;
  error: string;
  /** Seconds with no kernel attached and no cell running; null while one is. */
  idle_s: number | null;
  /** Seconds of idleness after which the session ends itself; null: never. */
  idle_timeout: number | null;
  /** Resident bytes of its processes on this host. */
  memory: number;
  /** The GPUs its ranks hold. */
  gpus: (number | string)[];
}

/** "45 s", "12 min", "3.2 h". */
function duration(seconds: number): string {
  return seconds < 60 ? `${seconds.toFixed(0)} s` : seconds < 3600 ? `${(seconds / 60).toFixed(0)} min` : `${(seconds / 3600).toFixed(1)} h`;
}

/** What a session holds and how long it has been idle: "idle 12 min (ends at 1.0 h) · 4 ranks · no GPU · 1.2 GiB". */
export function heldLine(session: INamedSession): string {
  const parts: string[] = [];
  if (session.state === 'running') {
    const ends = session.idle_timeout ? ` (ends at ${duration(session.idle_timeout)})` : '';
    parts.push(session.idle_s === null ? `in use${ends}` : `idle ${duration(session.idle_s)}${ends}`);
  }
  parts.push(`${session.ranks ?? '?'} ranks`);
  const gpus = session.gpus ?? [];
  parts.push(gpus.length ? `GPU${gpus.length > 1 ? 's' : ''} ${gpus.join(', ')}` : 'no GPU');
  parts.push(`${((session.memory ?? 0) / 2 ** 30).toFixed(1)} GiB`);
  return parts.join(' · ');
}

/** The lines a notebook runs to attach its kernel to session `name`. */
export function attachCode(name: string): string {
  return `%load_ext nbdist\n%dist_attach ${name}`;
}

/** The "Named sessions" section of the sidebar, polled every few seconds. */
export class NamedSessionsView {
  readonly node: HTMLElement;

  constructor(private notebooks: INotebookTracker | null) {
    this.node = document.createElement('div');
    this.node.className = 'nbdist-named';
    const head = document.createElement('h3');
    head.textContent = 'Named sessions';
    this._message = document.createElement('div');
    this._message.className = 'nbdist-named-message';
    this._list = document.createElement('ul');
    this._list.className = 'nbdist-named-list';
    this.node.append(head, this._message, this._list);
    this._poll = new Poll({
      auto: true,
      factory: () => this.refresh(),
      frequency: { interval: 3000, backoff: true, max: 30 * 1000 },
      name: 'nbdist:named-sessions',
      standby: 'when-hidden'
    });
  }

  get sessions(): INamedSession[] {
    return this._sessions;
  }

  async refresh(): Promise<void> {
    const reply = await requestAPI<{ sessions: INamedSession[] }>('sessions');
    this._sessions = reply.sessions;
    this._render();
  }

  dispose(): void {
    this._poll.dispose();
  }

  private _render(): void {
    this._list.replaceChildren();
    if (!this._sessions.length) {
      const empty = document.createElement('li');
      empty.className = 'nbdist-named-empty';
      empty.textContent = 'None. %dist_start N --name NAME starts one that outlives its kernel.';
      this._list.appendChild(empty);
      return;
    }
    for (const session of this._sessions) {
      const item = document.createElement('li');
      item.className = `nbdist-named-session nbdist-named-${session.state}`;
      item.dataset.name = session.name;
      const label = document.createElement('span');
      const step = session.last_step === null ? '' : ` · step ${session.last_step}`;
      label.textContent = `${session.name} · ${session.ranks ?? '?'} ranks · ${session.state}${step}`;
      label.title = session.error || `launcher ${session.launcher}, run ${session.run_id ?? '-'}`;
      const held = document.createElement('span');
      held.className = 'nbdist-named-held';
      held.textContent = heldLine(session);
      held.title = 'idle: no kernel attached and no cell running; memory: resident, on this host';
      item.append(label, held);
      if (session.state === 'running') {
        item.appendChild(this._button('Attach', 'nbdist-named-attach', () => this._attach(session.name)));
      }
      item.appendChild(this._button('Stop', 'nbdist-named-stop', () => this._stop(session.name)));
      this._list.appendChild(item);
    }
  }

  private _button(label: string, cls: string, onClick: () => Promise<void>): HTMLElement {
    const button = document.createElement('button');
    button.className = `jp-Button nbdist-action ${cls}`;
    button.textContent = label;
    button.onclick = () => void onClick();
    return button;
  }

  private async _attach(name: string): Promise<void> {
    const panel = this.notebooks?.currentWidget;
    if (!panel) {
      this._message.textContent = `Open a notebook first: session ${name} attaches to its kernel.`;
      return;
    }
    const notebook = panel.content;
    NotebookActions.insertBelow(notebook);
    notebook.activeCell?.model.sharedModel.setSource(attachCode(name));
    this._message.textContent = `Attaching ${panel.context.path} to session ${name}`;
    await NotebookActions.run(notebook, panel.sessionContext);
  }

  private async _stop(name: string): Promise<void> {
    const result = await showDialog({
      title: `Stop session ${name}?`,
      body: 'Its ranks and controller end wherever they run; names defined on the ranks are lost.',
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })]
    });
    if (!result.button.accept) {
      return;
    }
    try {
      await requestAPI(`sessions/${encodeURIComponent(name)}/stop`, { method: 'POST', body: '{}' });
      this._message.textContent = `Session ${name} stopped`;
    } catch (err) {
      this._message.textContent = `Stop failed: ${(err as Error).message}`;
    }
    void this._poll.refresh();
  }

  private _sessions: INamedSession[] = [];
  private _message: HTMLElement;
  private _list: HTMLElement;
  private _poll: Poll;
}
