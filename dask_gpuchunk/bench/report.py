"""Print, save (JSON) and plot (PNG) a benchmark report."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..devices import gpu_available

__all__ = ["format_table", "machine_info", "machine_line", "report_of", "save"]


def _gbps(x: float) -> str:
    return f"{x / 1e9:.1f} GB/s"


def report_of(benchmark: str, entries: Sequence[Any], machine: dict[str, Any],
              workload: dict[str, Any], limits: dict[str, float],
              floors: dict[str, Any] | None = None) -> dict[str, Any]:
    """A benchmark's report as :func:`save` and the tables read it: its rows
    (:class:`~dask_gpuchunk.bench.timing.Entry`), the machine, the workload, the limits
    measured and the floors derived from them."""
    return {
        "benchmark": benchmark,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine,
        "workload": workload,
        "limits": limits,
        "floors": floors or {},
        "entries": [e.as_dict() for e in entries],
    }


def machine_info() -> dict[str, Any]:
    """The machine a report was measured on: host, CPUs, versions, the GPU and its budget."""
    import dask
    import numba

    info: dict[str, Any] = {
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "numpy": np.__version__, "numba": numba.__version__, "dask": dask.__version__,
    }
    if gpu_available():
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        info.update(gpu=props["name"].decode(), gpu_memory=int(props["totalGlobalMem"]),
                    cupy=cupy.__version__)
        limit = int(cupy.get_default_memory_pool().get_limit())
        if limit:  # --device-budget, or CUPY_GPU_MEMORY_LIMIT: run as on a card of this size
            info["device_budget"] = limit
    return info


def machine_line(m: dict[str, Any]) -> str:
    """``machine: <GPU>, <cpus> CPUs, <versions>[, device budget]`` of a report's machine."""
    return (f"machine: {m.get('gpu', 'no GPU')}, {m['cpus']} CPUs, numpy {m['numpy']}, "
            f"numba {m['numba']}, dask {m['dask']}" + (f", cupy {m['cupy']}" if "cupy" in m else "")
            + (f", device budget {m['device_budget'] / 2**30:.2f} GiB (CuPy's pool capped)"
               if m.get("device_budget") else ""))


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table: one block per table, limits first."""
    lines = [machine_line(report["machine"])]
    lim = report["limits"]
    parts = [f"host copy {_gbps(lim['host_copy_traffic'])} (read+write)"]
    if "pcie_h2d" in lim:
        parts += [f"PCIe pinned H2D {_gbps(lim['pcie_h2d'])}", f"D2H {_gbps(lim['pcie_d2h'])}",
                  f"both {_gbps(lim['pcie_bidirectional'])}",
                  f"HBM copy {_gbps(lim['hbm_copy_traffic'])} (read+write)"]
    lines.append("limits: " + ", ".join(parts))
    tables: dict[str, list[dict[str, Any]]] = {}
    for e in report["entries"]:
        tables.setdefault(e["table"], []).append(e)
    for table, rows in tables.items():
        floors = report["floors"].get(table, {})
        fl = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.4f} s" for k, v in floors.items())
        lines.append("")
        lines.append(f"[{table}] floors: {fl}")
        lines.append(f"  {'':40s} {'seconds':>9s} {'x floor':>8s} {'x best':>7s}  note")
        for e in rows:
            if e["seconds"] is None:
                lines.append(f"  {e['name']:40s} {'-':>9s} {'':>8s} {'':>7s}  skipped: {e['skipped']}")
                continue
            x = e["extra"]
            note = []
            if "peak_device_bytes" in x:
                note.append(f"peak device {x['peak_device_bytes'] / 1e9:.2f} GB (pool)")
            if "peak_process_bytes" in x:
                note.append(f"{x['peak_process_bytes'] / 1e9:.2f} GB (driver, this process)")
            if e["first_run"] is not None and e["first_run"] > 1.5 * e["seconds"]:
                note.append(f"first run {e['first_run']:.3f} s")
            if "vs_cupy" in x:
                note.append(f"{e['seconds'] * 1e3:.2f} ms = {x['vs_cupy']:.2f} x {x['vs_cupy_row']}")
            if "measured_rows" in x:
                note.append(f"timed on {x['measured_rows']} rows, scaled")
            for d in x.get("placement", []):
                note.append(f"auto chose {d['choice']} (cpu {d['t_cpu'] * 1e3:.1f} ms vs gpu est "
                            f"{d['t_gpu_estimate'] * 1e3:.1f} ms per chunk)")
            vf = f"{x['vs_floor']:.2f}" if "vs_floor" in x else ""
            vb = f"{x['vs_best']:.2f}" if "vs_best" in x else ""
            lines.append(f"  {e['name']:40s} {e['seconds']:9.4f} {vf:>8s} {vb:>7s}  {'; '.join(note)}")
    return "\n".join(lines)


def save(report: dict[str, Any], out_dir: str | Path, stem: str,
         log: Callable[[str], None] | None = None) -> list[Path]:
    """Write ``<stem>.json`` and, where matplotlib is installed, ``<stem>.png`` (``log`` says
    when it is not)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{stem}.json"]
    written[0].write_text(json.dumps(report, indent=1, default=str))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if log is not None:
            log(f"no {stem}.png: matplotlib is not installed "
                "(pip install 'dask-gpuchunk[bench]')")
        return written
    tables: dict[str, list[dict[str, Any]]] = {}
    for e in report["entries"]:
        if e["seconds"] is not None:
            tables.setdefault(e["table"], []).append(e)
    if not tables:
        return written
    fig, axes = plt.subplots(len(tables), 1, figsize=(9, 1.2 + 0.45 * sum(map(len, tables.values())) + len(tables)))
    axes = [axes] if len(tables) == 1 else list(axes)
    colors = {"ours": "tab:green", "peer": "tab:gray", "limit": "tab:blue"}
    for ax, (table, rows) in zip(axes, tables.items()):
        names = [r["name"] for r in rows]
        secs = [r["seconds"] for r in rows]
        ax.barh(names, secs, color=[colors.get(r["kind"], "tab:gray") for r in rows])
        styles = {"pcie": "tab:red", "hbm": "tab:blue", "host": "tab:purple"}
        for k, v in report["floors"].get(table, {}).items():
            color = next((c for key, c in styles.items() if k.startswith(key)), "black")
            ax.axvline(v, linestyle="--", linewidth=1, color=color,
                       label=f"{k[:-2].replace('_', ' ')} {v * 1e3:.1f} ms")
        if report["floors"].get(table):
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel("seconds (log)")
        ax.set_title(f"{report['benchmark']} / {table} on {report['machine'].get('gpu', 'CPU only')}")
        ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    png = out / f"{stem}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    written.append(png)
    return written
