"""Kernel side: the rows of ``nbdist.strategies.plan.compare.compare`` as a table and a chart, and
``autoplan``'s ranked plans as a table.

``compare`` and ``autoplan`` run on the ranks; their rows come back to the
notebook (``%dist_pull rows --rank 0``) and are shown here: pandas for the
tables, plotly for the chart (imported when called, never on the ranks).

Example::

    rows = %dist_pull rows --rank 0
    from nbdist.dashboard.plan_comparison import comparison_chart, comparison_table, plans_table
    comparison_table(rows); comparison_chart(rows)
    plans_table(%dist_pull plan.table --rank 0)
"""

from __future__ import annotations

from nbdist.dashboard.palette import rank_colour

__all__ = ["ALL_RANKS", "comparison_chart", "comparison_table", "plans_table"]

ALL_RANKS = "#5f6b7a"  # the bar of all ranks together: a slate grey, unlike any rank's colour


def comparison_table(rows: list[dict]):
    """The rows as a pandas DataFrame, one line per strategy, one column per rank's memory/bytes.

    Example::

        comparison_table(rows)  # strategy | samples/s | step ms | peak MiB r0 | ... | loss
    """
    import pandas as pd

    records = []
    for row in rows:
        record = {"strategy": row["strategy"]}
        if "layout" in row:
            record["layout"] = row["layout"]
        record |= {
            "samples/s": round(row["samples_per_s"], 1),
            "step ms": round(row["step_ms"], 2),
        }
        for r, value in enumerate(row["peak_mib"]):
            record[f"peak MiB r{r}"] = round(value, 2)
        for r, value in enumerate(row["comm_mib"]):
            record[f"comm MiB/step r{r}"] = round(value, 3)
        record["loss"] = row["loss"]
        records.append(record)
    return pd.DataFrame.from_records(records).set_index("strategy")


# autoplan's row keys and the column each becomes; estimate and measurement side by side.
_PLAN_COLUMNS = (
    ("dp", "dp"),
    ("tp", "tp"),
    ("pp", "pp"),
    ("shard", "shard"),
    ("ac", "AC"),
    ("est_mib", "est. MiB"),
    ("peak_mib", "peak MiB"),
    ("est_comm_mib", "est. comm MiB"),
    ("comm_mib", "comm MiB"),
    ("steps_per_s", "steps/s"),
    ("samples_per_s", "samples/s"),
    ("step_ms", "step ms"),
    ("loss", "loss"),
    ("rank", "rank"),
    ("status", "status"),
)


def plans_table(rows: list[dict]):
    """``autoplan``'s table as a pandas DataFrame, one line per plan, the chosen one first.

    Memory and communication appear twice: as estimated before anything ran
    (``est.``) and as measured on the busiest rank (empty for plans not
    measured); ``status`` says why a plan was dropped or not measured.

    Example::

        plans_table(plan.table)   # plan | dp | tp | pp | shard | AC | est. MiB | peak MiB | ...
    """
    import pandas as pd

    def cell(value):
        return round(value, 3) if isinstance(value, float) else value

    records = [
        {"plan": row["plan"], **{col: cell(row.get(key)) for key, col in _PLAN_COLUMNS}}
        for row in rows
    ]
    df = pd.DataFrame.from_records(records).set_index("plan")
    df["rank"] = df["rank"].astype("Int64")  # whole numbers, <NA> for plans not measured
    return df


def comparison_chart(rows: list[dict]):
    """A plotly figure: throughput, peak memory per rank, bytes per rank and step, side by side.

    Example::

        comparison_chart(rows).show()   # or just ``comparison_chart(rows)`` as a cell's last line
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = [row["strategy"] for row in rows]
    fig = make_subplots(
        rows=1,
        cols=3,
        subplot_titles=("throughput (samples/s)", "peak memory (MiB)", "communicated (MiB/step)"),
    )
    # All ranks together in a grey no rank has; each rank in its colour, as on the dashboard.
    total = go.Bar(
        x=names, y=[r["samples_per_s"] for r in rows], name="all ranks", marker_color=ALL_RANKS
    )
    fig.add_trace(total, 1, 1)
    for rank in range(len(rows[0]["peak_mib"])):
        color = rank_colour(rank)
        for col, key in ((2, "peak_mib"), (3, "comm_mib")):
            bar = go.Bar(
                x=names,
                y=[r[key][rank] for r in rows],
                name=f"rank {rank}",
                marker_color=color,
                legendgroup=f"r{rank}",
                showlegend=col == 2,  # one legend entry per rank for both charts
            )
            fig.add_trace(bar, 1, col)
    fig.update_yaxes(title_text="samples/s", row=1, col=1)
    fig.update_yaxes(title_text="MiB per rank", row=1, col=2)
    fig.update_yaxes(title_text="MiB per step", row=1, col=3)
    # The legend under the charts: beside them it would cover the third chart at narrow widths.
    fig.update_layout(
        barmode="group",
        height=400,
        margin=dict(t=40, b=30, l=40, r=10),
        legend=dict(orientation="h", x=0, y=-0.15, yanchor="top"),
    )
    return fig
