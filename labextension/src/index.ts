/**
 * nbdist's JupyterLab extension: a left-sidebar panel of the nbdist clusters on this
 * server (ranks, live metrics, actions), a status-bar item for the active notebook's
 * cluster, and past runs of the history as main-area charts.
 *
 * In Notebook 7 the panel goes to its collapsible left panel ("nbdist: Show Clusters
 * and Ranks" in the command palette opens it); the status-bar item needs a status bar
 * and is left out where there is none. Nothing fails either way.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, WidgetTracker, MainAreaWidget } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { ClusterModel, IRunRecord } from './api';
import { NamedSessionsView } from './named';
import { ClusterPanel } from './panel';
import { runChartWidget, runWidgetId } from './runchart';
import { StatusItem } from './status';

const ICON_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <circle cx="5" cy="6" r="2.5"/><circle cx="19" cy="6" r="2.5"/>
    <circle cx="5" cy="18" r="2.5"/><circle cx="19" cy="18" r="2.5"/>
    <rect x="10" y="10" width="4" height="4" rx="1"/>
    <path d="M7 7l4 4M17 7l-4 4M7 17l4-4M17 17l-4-4" stroke="#616161" stroke-width="1.5"/>
  </g>
</svg>`;

export const nbdistIcon = new LabIcon({ name: 'nbdist:icon', svgstr: ICON_SVG });

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'nbdist:plugin',
  description: 'Clusters, ranks and live metrics of nbdist jobs driven from notebooks.',
  autoStart: true,
  optional: [IStatusBar, INotebookTracker, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    notebooks: INotebookTracker | null,
    palette: ICommandPalette | null
  ) => {
    const model = new ClusterModel();
    const runs = new WidgetTracker<MainAreaWidget<Widget>>({ namespace: 'nbdist-runs' });
    const openRun = (record: IRunRecord) => {
      // One chart per run of each history: two histories' run 1 are two charts.
      const existing = runs.find(w => w.id === runWidgetId(record));
      if (existing) {
        app.shell.activateById(existing.id);
        return;
      }
      const widget = runChartWidget(record, model.palette);
      void runs.add(widget);
      app.shell.add(widget, 'main');
      app.shell.activateById(widget.id);
    };
    const panel = new ClusterPanel(model, app.serviceManager, openRun);
    panel.title.icon = nbdistIcon;
    // Named sessions outlive their kernel: listed with Attach (into the active notebook) and Stop.
    panel.addSection(new NamedSessionsView(notebooks).node);

    // JupyterLab: a tab of the left sidebar. Notebook 7 has a collapsible left panel in its
    // own shell (no ILabShell); a shell with no left area at all gets the panel in the
    // main area from the command below instead.
    let inLeft = true;
    try {
      app.shell.add(panel, 'left', { rank: 900 });
    } catch {
      inLeft = false;
    }

    app.commands.addCommand('nbdist:open-panel', {
      label: 'nbdist: Show Clusters and Ranks',
      execute: () => {
        if (inLeft) {
          app.shell.activateById(panel.id);
          return;
        }
        if (!panel.isAttached) {
          const widget = new MainAreaWidget({ content: panel });
          widget.id = 'nbdist-main-panel';
          widget.title.label = 'nbdist';
          widget.title.closable = true;
          app.shell.add(widget, 'main');
        }
        app.shell.activateById('nbdist-main-panel');
      }
    });
    palette?.addItem({ command: 'nbdist:open-panel', category: 'nbdist' });

    if (statusBar && notebooks) {
      const item = new StatusItem(model, notebooks);
      statusBar.registerStatusItem('nbdist:status', {
        item,
        align: 'left',
        rank: 4,
        isActive: () => item.active,
        activeStateChanged: item.activeChanged
      });
    }
  }
};

export default plugin;
