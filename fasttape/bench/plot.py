"""The bench's picture: each step split into floor / recording / backward,
TF and fasttape side by side (matplotlib, optional)."""


PLOT_PARTS = (("floor", "#9e9e9e"), ("recording", "#f2a541"),
              ("backward", "#3b7dd8"))


def step_parts(row):
    """{"tf": {...}, "fasttape": {...}}: each step time split into the floor
    (the forward with no tape), recording (the tape's cost during the
    forward) and backward (the rest: the gradient or JVP computation), in ms.
    Medians are taken separately, so a split can be slightly negative on a
    noisy machine; it is shown as 0."""
    out = {}
    for impl, total, rec in (("tf", "tf_ms", "record_overhead_tf_ms"),
                             ("fasttape", "fasttape_ms",
                              "record_overhead_fasttape_ms")):
        floor = row["floor_ms"]
        recording = row[rec]
        out[impl] = {"floor": floor, "recording": recording,
                     "backward": row[total] - floor - recording,
                     "total": row[total]}
    return out


def _check_plotting():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib, which is not installed: "
            "pip install 'fasttape[plot]' (or pip install matplotlib)") from None


def plot(rows, path):
    """Per workload, TF's and fasttape's step time stacked as floor /
    recording / backward, side by side; one panel (own scale) per workload."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(rows)
    ncols = min(n, 5)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(max(2.6 * ncols, 5.2), 3.0 * nrows + 0.6),
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax, row in zip(axes.flat, rows):
        parts = step_parts(row)
        bottom = [0.0, 0.0]
        for part, color in PLOT_PARTS:
            heights = [max(parts[impl][part], 0.0) for impl in ("tf", "fasttape")]
            ax.bar([0, 1], heights, bottom=bottom, color=color, width=0.6,
                   label=part)
            bottom = [b + h for b, h in zip(bottom, heights)]
        for x, impl in enumerate(("tf", "fasttape")):
            ax.annotate(f"{parts[impl]['total']:.3g}", (x, bottom[x]),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks([0, 1], ["tf", "fasttape"])
        ax.set_ylim(0, max(bottom) * 1.15 or 1.0)
        ax.set_title(f"{row['workload']} ({row['ratio']:.2f}x)", fontsize=10)
        ax.set_ylabel("ms per step", fontsize=8)
        ax.tick_params(labelsize=8)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=9)
    fig.suptitle("ms per step, medians (title: ratio fasttape / tf)", fontsize=10)
    fig.savefig(path, dpi=110)
