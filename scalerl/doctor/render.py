"""The report for people: the tree (rich), then the tables behind it (nodes, instruction sets, all-reduce
sweeps, node pairs, per-rank phases of the profile). Colours on a terminal, plain text otherwise."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from scalerl.doctor.report import DoctorReport
from scalerl.health.hardware_rules import cpu_of, own_gpu
from scalerl.health.tree import FAULT, NOT_MEASURED, OK, WARNING

MARK = {OK: ("ok", "green"), WARNING: ("WARNING", "yellow"), FAULT: ("FAULT", "bold red"),
        NOT_MEASURED: ("not measured", "dim")}


def rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.1f} MB/s"


def _status(status: str) -> Text:
    word, style = MARK[status]
    return Text(f"[{word}]", style=style)


def build_tree(report: DoctorReport) -> Tree:
    root = Tree(Text.assemble(("scalerl doctor ", "bold"), _status(report.status)))
    for branch in report.tree():
        node = root.add(Text.assemble((branch["title"] + " ", "bold"), _status(branch["status"])))
        for leaf in branch["leaves"]:
            line = node.add(Text.assemble(leaf["title"] + " ", _status(leaf["status"])))
            findings = leaf["findings"]
            shown = [f for f in findings if f["status"] in (WARNING, FAULT)] or findings[:1]
            if leaf["status"] == OK:
                shown = [f for f in findings if f["status"] == OK]
            for f in shown:
                style = MARK[f["status"]][1] if f["status"] != OK else ""
                entry = line.add(Text(f["summary"], style=style))
                if f.get("fix"):
                    entry.add(Text("fix: " + f["fix"], style="cyan"))
    return root


def _nodes_table(report: DoctorReport) -> Table | None:
    nodes = report.world.get("nodes") or {}
    if not report.facts:
        return None
    table = Table(title="ranks", title_justify="left", box=None, header_style="bold")
    for column in ("node", "ranks", "device", "torch", "collectives over", "other interfaces", "launcher"):
        table.add_column(column)
    by_rank = {f["rank"]: f for f in report.facts}
    for host, ranks in nodes.items():
        f = by_rank[ranks[0]]
        s = f.get("socket") or {}
        device = ", ".join(sorted({g["name"] for g in f.get("gpus", [])})) or f.get("device", "")
        iface = f"{s.get('interface') or s.get('value') or '?'} {s.get('address') or ''}".strip()
        others = [_interface_text(i) for i in f.get("interfaces", []) if i["name"] != s.get("interface")
                  and i["kind"] != "loopback"]
        table.add_row(host, ",".join(map(str, ranks)), device, f["versions"].get("torch", ""), iface,
                      ", ".join(others) or "-", f.get("launcher", ""))
    for m in report.world.get("missing", []):
        table.add_row(m.get("expected_host", "?"), str(m["rank"]), "-", "-", "-", "-", "did not join")
    return table


def _hardware_table(report: DoctorReport) -> Table | None:
    """One row per node and kind of hardware on it: what each rank's matmuls can run in."""
    rows: dict[tuple, list[int]] = {}
    names = {r: host for host, ranks in (report.world.get("nodes") or {}).items() for r in ranks}
    for f in sorted(report.facts, key=lambda f: f["rank"]):
        cpu, gpu = cpu_of(f), own_gpu(f)
        if cpu is None and gpu is None:
            continue
        cells = [names.get(f["rank"], f.get("hostname", "?"))]
        if cpu is None:
            cells += [(f.get("cpu") or {}).get("error", "not reported")] + ["-"] * 6
        else:
            onednn = ", ".join(n for n, why in cpu.onednn_linear.items() if not why) or "none"
            cells += [cpu.model or cpu.machine, cpu.aten, cpu.level, " ".join(cpu.flags) or "-",
                      ", ".join(cpu.bf16_matmul) or "none", ", ".join(cpu.fp16_matmul) or "none", onednn]
        cells.append("-" if gpu is None else f"{gpu['name']} (cc {gpu.get('capability', '?')}, bf16 "
                                             f"{'yes' if gpu.get('bf16') else 'no' if 'bf16' in gpu else '?'})")
        rows.setdefault(tuple(cells), []).append(f["rank"])
    if not rows:
        return None
    table = Table(title="instruction sets (as scalerl's code paths see them, after SCALERL_CPU_ISA)",
                  title_justify="left", box=None, header_style="bold")
    for column in ("node", "ranks", "cpu", "torch dispatch", "SCALERL_CPU_ISA", "flags", "bf16 matmul",
                   "fp16 matmul", "oneDNN blocked", "gpu"):
        table.add_column(column)
    for cells, ranks in rows.items():
        table.add_row(cells[0], ",".join(map(str, ranks)), *cells[1:])
    return table


def _interface_text(i: dict[str, Any]) -> str:
    """"eth1 25 Gbit/s", "docker0 (docker)", "eth2 169.254.3.1 (link-local)", "ib0 (down)"."""
    tags = [i["virtual_kind"]] if i.get("virtual_kind") else []
    if i.get("ipv4") and all(a.startswith("169.254.") for a in i["ipv4"]):
        tags.append("link-local")
    if not i.get("up", True):
        tags.append("down")
    speed = f" {i['speed_mbit'] / 1000:g} Gbit/s" if i.get("speed_mbit") else ""
    return f"{i['name']}{speed}" + (f" ({', '.join(tags)})" if tags else "")


def _sweep_table(bandwidth: dict[str, Any]) -> Table | None:
    sweeps = bandwidth.get("sweeps") or []
    if not sweeps:
        return None
    table = Table(title="all-reduce sweep (busbw = algbw x 2(n-1)/n)", title_justify="left", box=None,
                  header_style="bold")
    for column in ("scope", "ranks", "size", "time", "algbw", "busbw"):
        table.add_column(column, justify="right" if column not in ("scope",) else "left")
    for sweep in sweeps:
        scope = sweep["scope"] + (f" {sweep['node']}" if sweep.get("node") else "")
        for r in sweep["results"]:
            table.add_row(scope, str(len(sweep["ranks"])), f"{r['size'] / 2**20:g} MiB", f"{r['time_s'] * 1e3:.2f} ms",
                          rate(r["algbw"]), rate(r["busbw"]))
            scope = ""
    return table


def _pairs_table(bandwidth: dict[str, Any]) -> Table | None:
    pairs = bandwidth.get("pairs") or []
    if not pairs:
        return None
    table = Table(title="node pairs (both send SIZE to each other at once; rate = SIZE / time)", title_justify="left",
                  box=None, header_style="bold")
    for column in ("node", "node", "size", "rate"):
        table.add_column(column)
    for p in pairs:
        table.add_row(p["a"], p["b"], f"{p['size'] / 2**20:g} MiB", rate(p["bytes_per_s"]))
    return table


def _profile_table(profile: dict[str, Any]) -> Table | None:
    records = profile.get("per_rank") or []
    if not records:
        return None
    phases = list(dict.fromkeys(p for r in records for p in r["phases"]))
    table = Table(title="per rank and phase, seconds per step: own work+waiting (for peers and in collectives)",
                  title_justify="left", box=None, header_style="bold")
    table.add_column("rank")
    for phase in phases + ["step"]:
        table.add_column(phase, justify="right")
    for r in sorted(records, key=lambda r: r["rank"]):
        cells = []
        for phase in phases:
            p = r["phases"].get(phase)
            cells.append("-" if p is None else f"{p['busy_s']:.3f}" + (f"+{p['wait_s']:.3f}" if p["wait_s"] >= 0.0005 else ""))
        cells.append(f"{r['step_s']:.3f}")
        table.add_row(str(r["rank"]), *cells)
    return table


def _waterfall_table(profile: dict[str, Any]) -> Table | None:
    """The MFU waterfall of the profiled steps: from the peak, each slice lost, down to the achieved MFU."""
    data = profile.get("mfu_waterfall")
    if not data:
        return None
    from scalerl.perf.mfu_waterfall import MfuWaterfall

    waterfall = MfuWaterfall.from_json(data)
    table = Table(title=f"MFU waterfall: peak 100% -> achieved {100 * waterfall.achieved_mfu:.2f}% (seconds per step, "
                        "mean over ranks; each slice from the step's timers and counters)",
                  title_justify="left", box=None, header_style="bold")
    for column in ("slice", "MFU points", "s/step", "left"):
        table.add_column(column, justify="left" if column == "slice" else "right")
    for row in waterfall.rows():
        sign = "" if row["key"] in ("peak", "achieved") else "-"
        table.add_row(row["label"], f"{sign}{100 * row['points']:.2f}", f"{row['seconds']:.4f}",
                      f"{100 * row['level']:.2f}%")
    lines = [f"the ideal and the measured slices cover {100 * waterfall.attributed_share:.1f}% of the step"]
    if waterfall.compute_by_phase:
        lines.append("of compute below peak: " + ", ".join(
            f"{name} {seconds:.4f} s" for name, seconds in waterfall.compute_by_phase.items()))
    lines += data.get("problems", []) + waterfall.notes
    table.caption, table.caption_justify = "\n".join(lines), "left"
    return table


def _plan_table(profile: dict[str, Any]) -> Table | None:
    plan = profile.get("plan")
    if not plan:
        return None
    table = Table(title=f"planned vs measured per phase ({plan.get('source') or 'the plan'}; seconds per step, mean "
                        "over ranks; peak GiB per rank, the largest): error = planned / measured - 1",
                  title_justify="left", box=None, header_style="bold")
    for column in ("phase", "planned s", "measured s", "error", "planned GiB", "measured GiB", "error"):
        table.add_column(column, justify="left" if column == "phase" else "right")

    def number(x, digits=3):
        return "-" if x is None else f"{x:.{digits}f}"

    def error(x):
        return "-" if x is None else f"{x:+.0%}"

    for row in plan["rows"]:
        table.add_row(row["phase"], number(row["planned_s"]), number(row["measured_s"]), error(row["time_error"]),
                      number(row["planned_gb"]), number(row["measured_gb"]), error(row["memory_error"]))
    return table


def render(report: DoctorReport, stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    console = Console(file=stream, width=160, highlight=False, soft_wrap=False,
                      force_terminal=stream.isatty() if hasattr(stream, "isatty") else False)
    world = report.world
    console.print(f"scalerl doctor: {', '.join(report.modes)}; {len(world.get('joined', []))} of "
                  f"{world.get('world_size', 1)} rank(s) on {len(world.get('nodes', {}))} node(s) "
                  f"({world.get('launcher', 'single')})")
    console.print(build_tree(report))
    bandwidth = report.measurements.get("bandwidth", {})
    for table in (_nodes_table(report), _hardware_table(report), _sweep_table(bandwidth), _pairs_table(bandwidth),
                  _profile_table(report.measurements.get("profile", {})),
                  _waterfall_table(report.measurements.get("profile", {})),
                  _plan_table(report.measurements.get("profile", {}))):
        if table is not None:
            title, table.title = table.title, None  # on its own line: a title never wraps to a narrow table
            console.print()
            console.print(Text(str(title), style="bold"))
            console.print(table)
    console.print()
    console.print(f"exit code {report.exit_code}: " + ("a fault would stop or cripple training" if report.exit_code
                                                       else "no fault"))
