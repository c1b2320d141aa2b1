#!/usr/bin/env python3
"""Loss curves and a speed/memory summary of examples/train_moe.py runs, read from their metrics files.

    python3 scripts/plot_losses.py plot --out loss_curves.png stock=stock.jsonl comet=comet.jsonl
    python3 scripts/plot_losses.py resume-check --full full.jsonl --resumed resumed.jsonl --from-step 30

``plot`` draws each run's per-step training loss (top) and each run's difference from the first run
(bottom) into one PNG, prints a table (steady-state tokens/s, ratio to the first run, ms/step, peak
GPU memory, final and eval loss) and the per-step loss differences, and can write the same as JSON
and Markdown. It uses matplotlib with the Agg backend (no display) when matplotlib is importable and
otherwise a small built-in PNG writer, so a machine without matplotlib still gets the picture.
Exit status: 0; 1 when a difference exceeds --max-diff-tol or --tail-diff-tol; 2 when a metrics
file is missing or holds no losses.

``resume-check`` compares a resumed run with the uninterrupted one: the resumed run must start at
--from-step, log every later step, use the same learning rate at each step (exactly) and reach the
same losses (within --first-tol on its first step, --tol on all). Exit status 0 when they agree.
"""

import argparse
import json
import math
import os
import struct
import sys
import zlib

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]


# --------------------------------------------------------------------------------------------
# Metrics files
# --------------------------------------------------------------------------------------------


class Run:
    """One metrics file: per-step losses and learning rates, the start, train_end and eval records."""

    def __init__(self, label, path):
        self.label, self.path = label, path
        self.losses, self.lrs, self.starts = {}, {}, []
        self.train_end, self.eval = {}, {}
        if not os.path.exists(path):
            self.error = "missing"
            return
        with open(path) as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    print(f"{path}:{number}: not JSON, skipped", file=sys.stderr)
                    continue
                event = record.get("event")
                if event == "start":
                    self.starts.append(record)
                elif event == "train_end":
                    self.train_end = record
                elif event == "eval":
                    self.eval = record
                elif "loss" in record:
                    # A resumed run appends: the latest record of a step wins.
                    self.losses[record["step"]] = record["loss"]
                    if "lr" in record:
                        self.lrs[record["step"]] = record["lr"]
        self.error = None if self.losses else "no losses"

    @property
    def info(self):
        return self.starts[0] if self.starts else {}

    @property
    def steps(self):
        return sorted(self.losses)


def parse_run(text):
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, got {text!r}")
    return label, path


def difference(run, base):
    """Per-step loss differences run - base on the steps both logged, and a summary of them."""
    common = sorted(set(run.losses) & set(base.losses))
    diffs = {s: run.losses[s] - base.losses[s] for s in common}
    if not diffs:
        return diffs, dict(common_steps=0)
    worst = max(common, key=lambda s: abs(diffs[s]))
    return diffs, dict(common_steps=len(common), first_step=common[0], last_step=common[-1],
                       max_abs_diff=abs(diffs[worst]), max_abs_diff_step=worst,
                       mean_abs_diff=sum(abs(d) for d in diffs.values()) / len(diffs))


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


# --------------------------------------------------------------------------------------------
# plot: summary table and picture
# --------------------------------------------------------------------------------------------


def summarize(runs, tail):
    base = runs[0]
    rows = []
    for run in runs:
        info, end = run.info, run.train_end
        tokens = end.get("steady_tokens_per_s")
        base_tokens = base.train_end.get("steady_tokens_per_s")
        rows.append(dict(label=run.label, path=run.path, error=run.error, backend=info.get("backend"),
                         zero_stage=info.get("zero_stage"), dtype=info.get("dtype"), steps=len(run.losses),
                         tokens_per_step=info.get("tokens_per_step"), steady_tokens_per_s=tokens,
                         ratio_to_first=tokens / base_tokens if tokens and base_tokens else None,
                         step_ms=end.get("step_ms"), timed_steps=end.get("timed_steps"),
                         peak_mem_mib=end.get("peak_mem_mib"), final_loss=end.get("final_loss"),
                         eval_loss=run.eval.get("eval_loss")))
    comparisons = []
    for run in runs[1:]:
        diffs, stats = difference(run, base)
        last = sorted(diffs)[-tail:]
        mine, theirs = run.train_end.get("steady_tokens_per_s"), base.train_end.get("steady_tokens_per_s")
        stats.update(label=run.label, base=base.label, tail_steps=len(last),
                     tail_mean_diff=sum(diffs[s] for s in last) / len(last) if last else None,
                     tokens_per_s_ratio=mine / theirs if mine and theirs else None)
        comparisons.append(stats)
    return dict(runs=rows, comparisons=comparisons)


def table(summary):
    head = ("run", "backend", "ZeRO", "dtype", "steps", "tokens/s", "vs first", "ms/step", "peak MiB", "final loss",
            "eval loss")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["runs"]:
        cells = (row["label"] + (f" ({row['error']})" if row["error"] else ""), row["backend"] or "-",
                 fmt(row["zero_stage"], "d"), row["dtype"] or "-", str(row["steps"]),
                 fmt(row["steady_tokens_per_s"], ",.0f"),
                 fmt(row["ratio_to_first"], ".3f") + ("x" if row["ratio_to_first"] else ""),
                 fmt(row["step_ms"], ".1f"), fmt(row["peak_mem_mib"], ",.0f"), fmt(row["final_loss"], ".4f"),
                 fmt(row["eval_loss"], ".4f"))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("\ntokens/s: all ranks together, steps after the timing warm-up, checkpoint saves left out; "
                 "peak MiB: torch.cuda.max_memory_allocated, the largest rank")
    for c in summary["comparisons"]:
        if c["tokens_per_s_ratio"] is not None:
            lines.append(f"\n{c['label']} / {c['base']} tokens/s: {c['tokens_per_s_ratio']:.3f}x")
        if not c["common_steps"]:
            lines.append(f"\n{c['label']} vs {c['base']}: no common steps")
            continue
        lines.append(f"\n{c['label']} vs {c['base']} over steps {c['first_step']}-{c['last_step']} "
                     f"({c['common_steps']} steps): max |loss diff| {c['max_abs_diff']:.4f} at step "
                     f"{c['max_abs_diff_step']}, mean |loss diff| {c['mean_abs_diff']:.4f}, "
                     f"mean loss over the last {c['tail_steps']} of them differs by {fmt(c['tail_mean_diff'], '+.4f')}")
    return "\n".join(lines)


def plot_matplotlib(runs, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": (3, 1.3)})
    base = runs[0]
    for index, run in enumerate(runs):
        color = tuple(c / 255 for c in COLORS[index % len(COLORS)])
        steps = run.steps
        top.plot(steps, [run.losses[s] for s in steps], color=color, linewidth=1.2, label=run.label)
        if index:
            diffs, _ = difference(run, base)
            bottom.plot(sorted(diffs), [diffs[s] for s in sorted(diffs)], color=color, linewidth=1.0,
                        label=f"{run.label} - {base.label}")
    top.set_ylabel("training loss (mean over ranks)")
    top.set_title(title)
    top.grid(alpha=0.3)
    top.legend()
    bottom.axhline(0.0, color="black", linewidth=0.6)
    bottom.set_xlabel("step")
    bottom.set_ylabel("loss difference")
    bottom.grid(alpha=0.3)
    if len(runs) > 1:
        bottom.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


# A 5x7 bitmap font for the built-in writer: 7 rows of 5 bits per glyph, as hex bytes, top row
# first. Upper case prints as lower case; other characters print as blanks.
GLYPHS = {
    '0': "0e11131519110e", '1': "040c040404040e", '2': "0e11010204081f", '3': "1f02040201110e",
    '4': "02060a121f0202", '5': "1f101e0101110e", '6': "0608101e11110e", '7': "1f010204080808",
    '8': "0e11110e11110e", '9': "0e11110f01020c", '.': "00000000000c0c", '-': "0000001f000000",
    '+': "0004041f040400", 'a': "00000e010f110f", 'b': "1010161911111e", 'c': "00000e1010110e",
    'd': "01010d1311110f", 'e': "00000e111f100e", 'f': "0609081c080808", 'g': "000f11110f010e",
    'h': "10101619111111", 'i': "04000c0404040e", 'j': "0200060202120c", 'k': "10101214181412",
    'l': "0c04040404040e", 'm': "00001a15151111", 'n': "00001619111111", 'o': "00000e1111110e",
    'p': "00001e111e1010", 'q': "00000d130f0101", 'r': "00001619101010", 's': "00000e100e011e",
    't': "08081c08080906", 'u': "0000111111130d", 'v': "00001111110a04", 'w': "0000111115150a",
    'x': "0000110a040a11", 'y': "000011110f010e", 'z': "00001f0204081f", '(': "02040808080402",
    ')': "08040202020408", '/': "01020204080810", '=': "00001f001f0000", '|': "04040404040404",
    ',': "00000000060408", '_': "0000000000001f", '%': "18190204081303", ':': "000c0c000c0c00",
}


class Canvas:
    """An RGB image in memory with lines, rectangles and bitmap text, saved as PNG."""

    def __init__(self, width, height, background=(255, 255, 255)):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def dot(self, x, y, color):
        if 0 <= x < self.width and 0 <= y < self.height:
            at = 3 * (y * self.width + x)
            self.pixels[at:at + 3] = bytes(color)

    def rect(self, x0, y0, x1, y1, color):
        for y in range(max(0, y0), min(self.height, y1 + 1)):
            for x in range(max(0, x0), min(self.width, x1 + 1)):
                self.dot(x, y, color)

    def line(self, x0, y0, x1, y1, color, width=1, clip=None):
        x0, y0, x1, y1 = round(x0), round(y0), round(x1), round(y1)
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        error = dx + dy
        lo, hi = -(width // 2), width - width // 2
        while True:
            if clip is None or (clip[0] <= x0 <= clip[2] and clip[1] <= y0 <= clip[3]):
                for oy in range(lo, hi):
                    for ox in range(lo, hi):
                        self.dot(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                break
            twice = 2 * error
            if twice >= dy:
                error += dy
                x0 += sx
            if twice <= dx:
                error += dx
                y0 += sy

    def text(self, x, y, text, color=(0, 0, 0), scale=2, anchor="left"):
        advance = 6 * scale
        if anchor == "right":
            x -= advance * len(text)
        elif anchor == "center":
            x -= advance * len(text) // 2
        for index, char in enumerate(text.lower()):
            rows = bytes.fromhex(GLYPHS.get(char, "00" * 7))
            for row, bits in enumerate(rows):
                for column in range(5):
                    if bits & (0x10 >> column):
                        gx, gy = x + index * advance + column * scale, y + row * scale
                        self.rect(gx, gy, gx + scale - 1, gy + scale - 1, color)

    def save(self, path):
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride]) for y in range(self.height))

        def chunk(kind, data):
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        with open(path, "wb") as handle:
            handle.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) +
                         chunk(b"IEND", b""))


def nice_ticks(lo, hi, count=5):
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    magnitude = 10**math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def tick_label(value, step):
    decimals = max(0, -math.floor(math.log10(step))) if step > 0 else 0
    return f"{value:.{decimals + (1 if step / 10**math.floor(math.log10(step)) == 2.5 else 0)}f}"


def draw_panel(canvas, box, series, xlim, ylabel, xlabel=None, zero_line=False):
    """Lines of (color, {x: y}) in box (left, top, right, bottom) with ticks, grid and labels."""
    left, top, right, bottom = box
    ys = [y for _, points in series for y in points.values() if math.isfinite(y)]
    if zero_line:
        ys.append(0.0)
    lo, hi = (min(ys), max(ys)) if ys else (0.0, 1.0)
    pad = (hi - lo) * 0.05 or max(abs(hi), 1e-3) * 0.05
    lo, hi = lo - pad, hi + pad
    x_lo, x_hi = xlim
    x_hi = x_hi if x_hi > x_lo else x_lo + 1

    def px(x):
        return left + (x - x_lo) / (x_hi - x_lo) * (right - left)

    def py(y):
        return bottom - (y - lo) / (hi - lo) * (bottom - top)

    grid, axis = (225, 225, 225), (60, 60, 60)
    y_ticks = nice_ticks(lo, hi)
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0
    for value in y_ticks:
        canvas.line(left, py(value), right, py(value), grid)
        canvas.text(left - 8, round(py(value)) - 7, tick_label(value, y_step), axis, anchor="right")
    x_ticks = nice_ticks(x_lo, x_hi)
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else 1.0
    for value in x_ticks:
        canvas.line(px(value), top, px(value), bottom, grid)
        if xlabel:
            canvas.text(round(px(value)), bottom + 8, tick_label(value, x_step), axis, anchor="center")
    if zero_line:
        canvas.line(left, py(0.0), right, py(0.0), (0, 0, 0))
    for color, points in series:
        xs = sorted(x for x in points if math.isfinite(points[x]))
        for a, b in zip(xs, xs[1:]):
            canvas.line(px(a), py(points[a]), px(b), py(points[b]), color, width=2, clip=box)
        if len(xs) == 1:
            canvas.rect(round(px(xs[0])) - 2, round(py(points[xs[0]])) - 2, round(px(xs[0])) + 2,
                        round(py(points[xs[0]])) + 2, color)
    for x0, y0, x1, y1 in ((left, top, right, top), (left, bottom, right, bottom), (left, top, left, bottom),
                           (right, top, right, bottom)):
        canvas.line(x0, y0, x1, y1, axis)
    canvas.text(left, top - 20, ylabel, axis)
    if xlabel:
        canvas.text((left + right) // 2, bottom + 30, xlabel, axis, anchor="center")


def plot_builtin(runs, out, title):
    canvas = Canvas(1000, 720)
    base = runs[0]
    steps = [s for run in runs for s in run.steps]
    xlim = (min(steps), max(steps)) if steps else (0, 1)
    curves = [(COLORS[i % len(COLORS)], run.losses) for i, run in enumerate(runs)]
    diffs = [(COLORS[i % len(COLORS)], difference(run, base)[0]) for i, run in enumerate(runs) if i]
    canvas.text(500, 12, title, anchor="center")
    draw_panel(canvas, (110, 70, 970, 440), curves, xlim, "training loss (mean over ranks)")
    draw_panel(canvas, (110, 500, 970, 650), diffs, xlim, "loss difference to " + base.label, xlabel="step",
               zero_line=True)
    for index, run in enumerate(runs):  # legend, top right
        y = 84 + 22 * index
        canvas.rect(770, y + 5, 800, y + 8, COLORS[index % len(COLORS)])
        canvas.text(810, y, run.label)
    canvas.save(out)


def cmd_plot(args):
    runs = [Run(label, path) for label, path in args.runs]
    for run in runs:
        if run.error:
            print(f"{run.label}: {run.path}: {run.error}", file=sys.stderr)
    summary = summarize(runs, args.tail)
    text = table(summary)
    print(text)
    status = 2 if any(run.error for run in runs) else 0
    checks = []
    for c in summary["comparisons"]:
        if not c["common_steps"]:
            continue
        if args.max_diff_tol is not None and c["max_abs_diff"] > args.max_diff_tol:
            checks.append(f"{c['label']} vs {c['base']}: max |loss diff| {c['max_abs_diff']:.4f} at step "
                          f"{c['max_abs_diff_step']} exceeds {args.max_diff_tol}")
        if (args.tail_diff_tol is not None and c["tail_mean_diff"] is not None
                and abs(c["tail_mean_diff"]) > args.tail_diff_tol):
            checks.append(f"{c['label']} vs {c['base']}: mean loss over the last {c['tail_steps']} common steps "
                          f"differs by {c['tail_mean_diff']:+.4f}, more than {args.tail_diff_tol}")
    for message in checks:
        print("CHECK FAILED: " + message)
    if checks and status == 0:
        status = 1
    summary["checks_failed"] = checks
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(f"# {args.title}\n\n{text}\n" + "".join(f"\nCHECK FAILED: {m}\n" for m in checks))
    if args.out:
        drawable = [run for run in runs if run.losses]
        if drawable:
            try:
                if args.engine == "builtin":
                    raise ImportError("the built-in writer was asked for")
                plot_matplotlib(drawable, args.out, args.title)
                engine = "matplotlib"
            except Exception as error:  # not installed, or too old for these calls: still draw the curves
                if args.engine == "matplotlib":
                    raise
                print(f"matplotlib not used ({type(error).__name__}: {error}); drawing with the built-in PNG "
                      "writer", file=sys.stderr)
                plot_builtin(drawable, args.out, args.title)
                engine = "built-in"
            print(f"wrote {args.out} ({engine})")
        else:
            print(f"no losses to draw; {args.out} not written", file=sys.stderr)
    return status


# --------------------------------------------------------------------------------------------
# resume-check
# --------------------------------------------------------------------------------------------


def cmd_resume_check(args):
    full, resumed = Run("uninterrupted", args.full), Run("resumed", args.resumed)
    problems = []
    for run in (full, resumed):
        if run.error:
            problems.append(f"{run.label} run: {run.path}: {run.error}")
    if not problems:
        starts = [r.get("start_step") for r in resumed.starts]
        if args.from_step not in starts:
            problems.append(f"the resumed run started at step(s) {starts}, not at step {args.from_step}: "
                            "it did not load the checkpoint")
        expected = [s for s in full.steps if s > args.from_step]
        got = [s for s in resumed.steps if s > args.from_step]
        if not expected:
            problems.append(f"the uninterrupted run logged no step after {args.from_step}")
        elif got != expected:
            problems.append(f"the resumed run logged steps {got[:3]}...{got[-3:]} after {args.from_step}, "
                            f"the uninterrupted run {expected[:3]}...{expected[-3:]}")
        common = [s for s in expected if s in resumed.losses]
        if common:
            diffs = {s: resumed.losses[s] - full.losses[s] for s in common}
            worst = max(common, key=lambda s: abs(diffs[s]))
            print(f"resumed at step {args.from_step}; steps {common[0]}-{common[-1]}: loss at step {common[0]} "
                  f"{resumed.losses[common[0]]:.5f} vs {full.losses[common[0]]:.5f} uninterrupted; "
                  f"max |diff| {abs(diffs[worst]):.2e} at step {worst}; "
                  f"mean |diff| {sum(abs(d) for d in diffs.values()) / len(diffs):.2e}")
            if abs(diffs[common[0]]) > args.first_tol:
                problems.append(f"first resumed step {common[0]}: loss {resumed.losses[common[0]]:.5f} vs "
                                f"{full.losses[common[0]]:.5f} (|diff| {abs(diffs[common[0]]):.2e} > {args.first_tol})")
            if abs(diffs[worst]) > args.tol:
                problems.append(f"step {worst}: loss {resumed.losses[worst]:.5f} vs {full.losses[worst]:.5f} "
                                f"(|diff| {abs(diffs[worst]):.2e} > {args.tol})")
            lr_steps = [s for s in common if s in full.lrs and s in resumed.lrs]
            bad_lr = [s for s in lr_steps if not math.isclose(full.lrs[s], resumed.lrs[s], rel_tol=1e-9, abs_tol=0)]
            if bad_lr:
                s = bad_lr[0]
                problems.append(f"learning rate at step {s}: {resumed.lrs[s]:.3e} resumed vs {full.lrs[s]:.3e} "
                                "uninterrupted: the scheduler did not resume")
    for message in problems:
        print("RESUME CHECK FAILED: " + message)
    if not problems:
        print("resume check passed")
    return 1 if problems else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="loss curves (PNG) and the summary table")
    plot.add_argument("runs", nargs="+", type=parse_run, metavar="LABEL=METRICS.jsonl",
                      help="runs to compare; the first is the baseline of the ratios and differences")
    plot.add_argument("--out", help="PNG to write")
    plot.add_argument("--json", help="write the summary as JSON here")
    plot.add_argument("--markdown", help="write the table as Markdown here")
    plot.add_argument("--title", default="examples/train_moe.py: training loss")
    plot.add_argument("--tail", type=int, default=20, help="last common steps whose mean losses are compared")
    plot.add_argument("--max-diff-tol", type=float, default=None,
                      help="fail (exit 1) when a run's per-step loss differs from the first run's by more")
    plot.add_argument("--tail-diff-tol", type=float, default=None,
                      help="fail (exit 1) when the mean loss of the last --tail steps differs by more")
    plot.add_argument("--engine", choices=("auto", "matplotlib", "builtin"), default="auto",
                      help="auto: matplotlib if importable, else the built-in PNG writer")
    plot.set_defaults(func=cmd_plot)
    check = commands.add_parser("resume-check", help="a resumed run against the uninterrupted run")
    check.add_argument("--full", required=True, help="metrics of the uninterrupted run")
    check.add_argument("--resumed", required=True, help="metrics of the run resumed from the checkpoint")
    check.add_argument("--from-step", type=int, required=True, help="the step of the checkpoint it resumed from")
    check.add_argument("--first-tol", type=float, default=5e-3, help="largest |loss diff| at the first resumed step")
    check.add_argument("--tol", type=float, default=2e-2, help="largest |loss diff| at any resumed step")
    check.set_defaults(func=cmd_resume_check)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
