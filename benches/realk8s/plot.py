#!/usr/bin/env python3
"""Draws the curves of sweep.py's results as SVG (no plotting library needed): one chart per figure,
one line per MIG mode and claim kind measured at two node counts or more, against nodes on log axes.

    benches/realk8s/plot.py benches/realk8s/results.jsonl --label after --out docs/scale
"""
import argparse
import json
import math
import os

FIGURES = {
    "scheduler-cpu": ("kube-scheduler CPU per pod scheduled (ms)", lambda r: r.get("scheduler_cpu_ms_per_pod")),
}
COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#637939"]


def chart(title, series, width=640, height=400):
    left, right, top, bottom = 70, 190, 40, 50
    xs = sorted({x for points in series.values() for x, _ in points})
    ys = [y for points in series.values() for _, y in points]
    lx = lambda v: math.log10(v)  # noqa: E731
    x0, x1 = lx(min(xs)), lx(max(xs)) if max(xs) > min(xs) else lx(min(xs)) + 1
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    if y1 == y0:
        y1 += 1
    px = lambda v: left + (lx(v) - x0) / (x1 - x0) * (width - left - right)  # noqa: E731
    py = lambda v: height - bottom - (math.log10(v) - y0) / (y1 - y0) * (height - top - bottom)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2 - right / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>']
    for decade in range(y0, y1 + 1):
        y = py(10 ** decade)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{10 ** decade:g}</text>')
    for x in xs:
        out.append(f'<line x1="{px(x):.1f}" y1="{top}" x2="{px(x):.1f}" y2="{height - bottom}" stroke="#eee"/>')
        out.append(f'<text x="{px(x):.1f}" y="{height - bottom + 16}" text-anchor="middle">{x}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">nodes</text>')
    for index, (name, points) in enumerate(sorted(series.items())):
        colour = COLOURS[index % len(COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(points))
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in points:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>')
        ly = top + 16 * index
        out.append(f'<line x1="{width - right + 10}" y1="{ly}" x2="{width - right + 28}" y2="{ly}" stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{width - right + 32}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--label", help="only the lines of this label")
    ap.add_argument("--out", default="docs/scale", help="file prefix: PREFIX-<figure>.svg")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.results) if line.strip()]
    if args.label is not None:
        rows = [r for r in rows if r.get("label") == args.label]
    for figure, (title, value) in FIGURES.items():
        series = {}
        for r in rows:
            v = value(r)
            if v:
                series.setdefault(f'{r["mig_mode"]} / {r["claim"]}', {})[r["nodes"]] = v  # last run wins
        # A curve needs two node counts at least; single runs are in the tables.
        series = {k: sorted(v.items()) for k, v in series.items() if len(v) > 1}
        if not series:
            continue
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        path = f"{args.out}-{figure}.svg"
        open(path, "w").write(chart(title, series))
        print(path)


if __name__ == "__main__":
    main()
