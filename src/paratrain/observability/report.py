"""`paratrain report RUN_DIR...`: one self-contained HTML page comparing runs.

Reads each run's ``config.toml``, ``metrics.jsonl`` and (when present) ``summary.json``; draws
loss and val_loss by step and by tokens, throughput, MFU, memory, global batch and per-rank step
time with matplotlib; embeds the PNG as base64 so the page is one file with no external
resource (it opens offline and survives being mailed). A table gives each run's layout, world
size, final and best losses and speed; another the config keys that differ between the runs.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import statistics
import tomllib

import matplotlib

matplotlib.use("Agg")  # no display: the page embeds PNG bytes
import matplotlib.pyplot as plt  # noqa: E402 - after the backend choice

from paratrain.config import ConfigError  # noqa: E402


def load_run(run_dir: str) -> dict:
    """config, rows and summary of one run directory, or ConfigError when it is not a run."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    config = os.path.join(run_dir, "config.toml")
    if not (os.path.isfile(metrics) and os.path.isfile(config)):
        raise ConfigError(
            f"'{run_dir}' is not a paratrain run (no config.toml and metrics.jsonl in it); pass a run.out_dir"
        )
    try:
        with open(config, "rb") as f:
            cfg = tomllib.load(f)
        with open(metrics) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"'{run_dir}': cannot read its config.toml/metrics.jsonl ({e}); is the run complete?")
    summary = {}
    if os.path.isfile(os.path.join(run_dir, "summary.json")):
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    name = os.path.basename(os.path.normpath(run_dir))
    return {"dir": run_dir, "name": name, "config": cfg, "rows": rows, "summary": summary}


def _series(rows: list[dict], key: str, x: str = "step") -> tuple[list, list]:
    xs, ys, total = [], [], 0
    for r in rows:
        total += r.get("tokens", 0)
        if key in r and isinstance(r[key], (int, float)):
            xs.append(total if x == "tokens" else r["step"])
            ys.append(r[key])
    return xs, ys


def plot_runs(runs: list[dict]) -> bytes:
    """The comparison plots as PNG bytes, one panel per quantity present in any run."""
    panels = [
        ("loss", "step", "loss by step"),
        ("loss", "tokens", "loss by tokens"),
        ("val_loss", "step", "validation loss"),
        ("tokens_per_s", "step", "throughput (tokens/s)"),
        ("mfu", "step", "MFU"),
        ("memory_gib", "step", "memory (GiB, max over ranks)"),
        ("global_batch_size", "step", "global batch size"),
        ("rank_step_time_s", "step", "per-rank step time (s)"),
        # Mixture of experts (docs/moe.md).
        ("aux_loss", "step", "MoE auxiliary loss"),
        ("expert_imbalance", "step", "MoE tokens per expert: max / mean"),
    ]
    panels = [p for p in panels if any(p[0] in r for run in runs for r in run["rows"])]
    cols = 2
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(11, 3.3 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, x, title) in zip(axes.flat, panels):
        for i, run in enumerate(runs):
            c = colors[i % len(colors)]
            if key == "rank_step_time_s":  # one line per rank, at the gathered steps
                gathered = [r for r in run["rows"] if key in r]
                for rank in range(len(gathered[0][key]) if gathered else 0):
                    ax.plot(
                        [r["step"] for r in gathered],
                        [r["rank_local_time_s"][rank] for r in gathered],
                        marker="o",
                        ms=3,
                        color=c,
                        alpha=1 - 0.6 * rank / max(1, len(gathered[0][key])),
                        label=f"{run['name']} rank {rank}",
                    )
                ax.set_title("per-rank local time (data + forward, s)", fontsize=10)
                continue
            xs, ys = _series(run["rows"], key, x)
            if xs:
                ax.plot(xs, ys, lw=1.2, color=c, label=run["name"], marker="o" if len(xs) < 3 else None)
            ax.set_title(title, fontsize=10)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _flat(cfg: dict) -> dict:
    return {f"{sec}.{k}": v for sec, sub in cfg.items() if isinstance(sub, dict) for k, v in sub.items()}


def differing_keys(runs: list[dict]) -> dict[str, list]:
    """Config keys whose value is not the same in every run (run.out_dir always differs: left out)."""
    flats = [_flat(r["config"]) for r in runs]
    keys = sorted(set().union(*flats))
    out = {}
    for k in keys:
        values = [f.get(k, "(absent)") for f in flats]
        if k != "run.out_dir" and any(v != values[0] for v in values):
            out[k] = values
    return out


def run_table_row(run: dict) -> dict:
    rows, s, cfg = run["rows"], run["summary"], run["config"]
    losses = [r["loss"] for r in rows]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    steady = rows[min(2, len(rows) - 1) :] if rows else []
    layout = s.get("layout") or {k: cfg.get("parallel", {}).get(k) for k in ("dp_replicate", "dp_shard", "tp", "pp")}
    return {
        "run": run["name"],
        "world size": s.get("world_size", "?"),
        "layout": ", ".join(f"{k}={v}" for k, v in layout.items()),
        "steps": rows[-1]["step"] if rows else 0,
        "global batch": rows[-1]["global_batch_size"] if rows else "",
        "final loss": f"{losses[-1]:.4f}" if losses else "",
        "best loss": f"{min(losses):.4f}" if losses else "",
        "best val_loss": f"{min(val):.4f}" if val else "",
        "tokens/s (median)": f"{statistics.median(r['tokens_per_s'] for r in steady):.0f}" if steady else "",
        "step time s (median)": f"{statistics.median(r['step_time_s'] for r in steady):.4f}" if steady else "",
        "MFU (median)": (
            f"{100 * statistics.median(r['mfu'] for r in steady if 'mfu' in r):.1f}%"
            if any("mfu" in r for r in steady)
            else ""
        ),
        "max memory GiB": (
            f"{max(r['memory_gib'] for r in rows if 'memory_gib' in r):.3f}"
            if any("memory_gib" in r for r in rows)
            else ""
        ),
    }


def _table(header: list[str], body: list[list]) -> str:
    th = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; margin: 12px 0 24px; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; }
th { background: #f3f3f3; }
img { max-width: 100%; }
"""


def render_html(runs: list[dict], png: bytes) -> str:
    table_rows = [run_table_row(r) for r in runs]
    header = list(table_rows[0])
    diff = differing_keys(runs)
    diff_html = (
        _table(["key", *[r["name"] for r in runs]], [[k, *map(json.dumps, v)] for k, v in diff.items()])
        if diff
        else "<p>The runs share every config key (other than run.out_dir).</p>"
    )
    names = ", ".join(html.escape(r["name"]) for r in runs)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>paratrain report: {names}</title>
<style>{STYLE}</style></head>
<body>
<h1>paratrain report</h1>
<p>Runs: {names}</p>
<h2>Runs</h2>
{_table(header, [list(r.values()) for r in table_rows])}
<h2>Config keys that differ</h2>
{diff_html}
<h2>Curves</h2>
<img onload="this.dataset.loaded = 1" alt="loss, throughput, MFU, memory, global batch and per-rank time of each run" src="data:image/png;base64,{base64.b64encode(png).decode()}">
</body></html>
"""


def write_report(run_dirs: list[str], *, out: str, png: str = "") -> dict:
    runs = [load_run(d) for d in run_dirs]
    for path, flag in ((out, "--out"), (png, "--png")):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ConfigError(f"{flag} {path}: its folder does not exist; create it or write elsewhere")
    names = [r["name"] for r in runs]
    for r in runs:  # two runs named alike (a/run, b/run): tell them apart by their paths
        if names.count(r["name"]) > 1:
            r["name"] = os.path.normpath(r["dir"])
    image = plot_runs(runs)
    with open(out, "w") as f:
        f.write(render_html(runs, image))
    if png:
        with open(png, "wb") as f:
            f.write(image)
    return {"runs": len(runs), "out": out}
