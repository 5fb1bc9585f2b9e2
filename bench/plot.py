"""Draw the publish benchmark's medians (``bench/publish.py --json``) as a bar chart.

    python bench/plot.py results.json docs/img/performance.png

Needs matplotlib (the ``panels`` extra).
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(source: str, target: str) -> None:
    with open(source) as handle:
        data = json.load(handle)
    rows = data["rows"]
    names = [row["variant"] for row in rows]
    rates = [row["rate"] for row in rows]
    colours = ["#4c72b0" if row["confirms"] else "#bbbbbb" for row in rows]
    figure, axis = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.2))
    bars = axis.barh(names, rates, color=colours)
    axis.invert_yaxis()
    axis.set_xlabel("messages per second (higher is better)")
    axis.set_title(
        f"{data['messages']:,} persistent 256-byte messages, window {data['window']}\n"
        f"median of {data['rounds']} interleaved rounds; grey: no confirms (not loss-proof)",
        fontsize=9,
    )
    for bar, row in zip(bars, rows, strict=True):
        axis.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {row['rate']:,.0f}/s  {row['vs_aio_pika']:.2f}x",
            va="center",
            fontsize=8,
        )
    axis.set_xlim(0, max(rates) * 1.3)
    figure.tight_layout()
    figure.savefig(target, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
