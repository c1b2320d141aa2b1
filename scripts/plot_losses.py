#!/usr/bin/env python3
"""Loss curves and a speed/memory summary of examples/train_moe.py runs, read from DeepSpeed's csv_monitor output.

    python3 scripts/plot_losses.py plot --out loss_curves.png stock=runs/stock comet=runs/comet
    python3 scripts/plot_losses.py resume-check --full runs/full --resumed runs/resumed --from-step 30
    python3 scripts/plot_losses.py rounds stock/1=runs/s1 comet/1=runs/c1 stock/2=runs/s2 comet/2=runs/c2

Each run is the directory the csv_monitor wrote (its output_path/job_name; ``--monitor-dir`` of the
example): one CSV per tag, ``step,<name>`` rows; or, for losses alone, a ``.jsonl`` file of
examples/train_hf_trainer.py's ``--losses``. A run resumed into the same directory appends to
the same files; the last row of a step wins.

``plot`` draws each run's per-step training loss (top) and each run's difference from the first run
(bottom) into one PNG, prints a table (steady-state tokens/s, ratio to the first run, ms/step, peak
accelerator memory, final and eval loss, the busiest expert's share) and the per-step loss
differences, and can write the same as JSON and Markdown. The PNG needs matplotlib (drawn with the
Agg backend, no display).
Exit status: 0; 1 when a difference exceeds --max-diff-tol or --tail-diff-tol; 2 when a run directory
is missing or holds no losses; 3 when --out was asked for and the PNG cannot be drawn (matplotlib
not importable, nothing to draw). The table and checks are printed in every case.

``resume-check`` compares a resumed run with the uninterrupted one: the resumed run must start at
--from-step, log every later step, use the same learning rate at each step (exactly) and reach the
same losses (within --first-tol on its first step, --tol on all). Exit status 0 when they agree, 1
when they do not or a run cannot be read.

``rounds`` summarises interleaved runs, labelled ARM/ROUND. On the GPU machine a job's throughput
drifts by a few % from one run to the next, so an A/B is trusted only when its arms alternate.
Each arm's tokens/s is divided by the first arm's in the same round. It prints, per arm, those
ratios, their geometric mean and range, and the largest peak memory against the first arm's.
Exit status 2 when a run directory is missing or a round lacks the first arm.
"""

import argparse
import csv
import json
import math
import os
import re
import sys

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
# csv_monitor's file names: the event tag with "/" as "_" (ds_comet.training_metrics names the tags).
LOSS_FILE = "Train_Steps_loss.csv"
LR_FILE = "Train_Steps_lr.csv"
EXPERT_TOKENS_FILE = re.compile(r"Train_Steps_expert_tokens_layer(\d+)_expert(\d+)\.csv")


# --------------------------------------------------------------------------------------------
# Run directories
# --------------------------------------------------------------------------------------------


def read_monitor_csv(path):
    """[(step, value)] of one csv_monitor file, in file order.

    csv_monitor writes a ``step,<name>`` header each time a process first writes the tag, so a run
    resumed into the same directory leaves a header in the middle: rows whose step is not a number
    are skipped.
    """
    rows = []
    with open(path, newline="") as handle:
        for number, row in enumerate(csv.reader(handle), 1):
            if len(row) != 2:
                if row:
                    print(f"{path}:{number}: not a step,value row, skipped", file=sys.stderr)
                continue
            try:
                step = int(float(row[0]))
            except ValueError:
                continue  # a header
            try:
                rows.append((step, float(row[1])))
            except ValueError:
                print(f"{path}:{number}: value {row[1]!r} is not a number, skipped", file=sys.stderr)
    return rows


class Run:
    """One run's csv_monitor directory.

    ``losses`` and ``lrs``: {step: value} (the last row of a step wins); ``start_steps``: the
    Run/start_step of every launch that wrote here, in order; ``info``: the other Run/ values of the
    first launch; ``summary``: each Summary/ tag's last value (a resumed launch's over the first's);
    ``expert_tokens``: {layer: {expert: tokens over the whole run}}.
    """

    def __init__(self, label, path):
        self.label, self.path = label, path
        self.losses, self.lrs, self.start_steps = {}, {}, []
        self.info, self.summary, self.expert_tokens = {}, {}, {}
        if path.endswith(".jsonl") and os.path.isfile(path):
            self._read_loss_lines(path)
            return
        if not os.path.isdir(path):
            self.error = "missing"
            return
        names = sorted(os.listdir(path))
        for name in names:
            if not name.endswith(".csv"):
                continue
            rows = read_monitor_csv(os.path.join(path, name))
            if name == LOSS_FILE:
                self.losses = dict(rows)
            elif name == LR_FILE:
                self.lrs = dict(rows)
            elif name == "Run_start_step.csv":
                self.start_steps = [int(value) for _, value in rows]
            elif name.startswith("Run_") and rows:
                self.info[name[len("Run_") : -len(".csv")]] = rows[0][1]
            elif name.startswith("Summary_") and rows:
                self.summary[name[len("Summary_") : -len(".csv")]] = rows[-1][1]
            elif EXPERT_TOKENS_FILE.fullmatch(name):
                layer, expert = (int(group) for group in EXPERT_TOKENS_FILE.fullmatch(name).groups())
                # A resumed run may log a window again: count each logged step once, its last row.
                self.expert_tokens.setdefault(layer, {})[expert] = sum(dict(rows).values())
        if self.losses:
            self.error = None
        elif any(name.endswith(".csv") for name in names):
            self.error = f"no {LOSS_FILE}"
        else:
            self.error = "no csv_monitor files (the run's directory is the csv_monitor's output_path/job_name)"

    def _read_loss_lines(self, path):
        """The Hugging Face Trainer example's ``--losses`` file: one {"step": ..., "loss": ...} a line."""
        with open(path) as handle:
            for number, line in enumerate(handle, 1):
                try:
                    record = json.loads(line)
                    self.losses[int(record["step"])] = float(record["loss"])
                except (ValueError, KeyError, TypeError):
                    print(f"{path}:{number}: not a step/loss record, skipped", file=sys.stderr)
        self.error = None if self.losses else "no step/loss records"
        if self.losses:
            self.summary["final_loss"] = self.losses[max(self.losses)]

    @property
    def steps(self):
        return sorted(self.losses)

    def busiest_expert_share(self):
        """Over the whole run, the largest (tokens of one expert / mean tokens per expert) of any layer;
        1.0 is a perfectly even load. None without expert counts."""
        shares = []
        for experts in self.expert_tokens.values():
            total = sum(experts.values())
            if total:
                shares.append(max(experts.values()) * len(experts) / total)
        return max(shares) if shares else None


def parse_run(text):
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=DIR, got {text!r}")
    return label, path


def difference(run, base):
    """Per-step loss differences run - base on the steps both logged, and a summary of them."""
    common = sorted(set(run.losses) & set(base.losses))
    diffs = {s: run.losses[s] - base.losses[s] for s in common}
    if not diffs:
        return diffs, dict(common_steps=0)
    worst = max(common, key=lambda s: abs(diffs[s]))
    return diffs, dict(
        common_steps=len(common),
        first_step=common[0],
        last_step=common[-1],
        max_abs_diff=abs(diffs[worst]),
        max_abs_diff_step=worst,
        mean_abs_diff=sum(abs(d) for d in diffs.values()) / len(diffs),
    )


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def write_summary(args, summary, text, notes):
    """The summary as JSON to --json, and the table with its notes as Markdown to --markdown."""
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(f"# {args.title}\n\n{text}\n" + "".join(f"\n{note}\n" for note in notes))


# --------------------------------------------------------------------------------------------
# plot: summary table and picture
# --------------------------------------------------------------------------------------------


STEP_PARTS = ("moe_forward", "moe_backward", "optimizer", "rest")


def step_parts(summary):
    """The example's --step-shares parts of a step (ms), or None each where the run has none."""
    return {f"{part}_ms": summary.get(f"{part}_ms") for part in STEP_PARTS}


def summarize(runs, tail):
    base = runs[0]
    rows = []
    for run in runs:
        tokens = run.summary.get("steady_tokens_per_s")
        base_tokens = base.summary.get("steady_tokens_per_s")
        zero_stage = run.info.get("zero_stage")
        rows.append(
            dict(
                label=run.label,
                path=run.path,
                error=run.error,
                zero_stage=int(zero_stage) if zero_stage is not None else None,
                steps=len(run.losses),
                tokens_per_step=run.info.get("tokens_per_step"),
                steady_tokens_per_s=tokens,
                ratio_to_first=tokens / base_tokens if tokens and base_tokens else None,
                step_ms=run.summary.get("step_ms"),
                timed_steps=run.summary.get("timed_steps"),
                peak_mem_mib=run.summary.get("peak_memory_mib"),
                final_loss=run.summary.get("final_loss"),
                eval_loss=run.summary.get("eval_loss"),
                busiest_expert_share=run.busiest_expert_share(),
                **step_parts(run.summary),
            )
        )
    comparisons = []
    for run in runs[1:]:
        diffs, stats = difference(run, base)
        last = sorted(diffs)[-tail:]
        mine, theirs = run.summary.get("steady_tokens_per_s"), base.summary.get("steady_tokens_per_s")
        stats.update(
            label=run.label,
            base=base.label,
            tail_steps=len(last),
            tail_mean_diff=sum(diffs[s] for s in last) / len(last) if last else None,
            tokens_per_s_ratio=mine / theirs if mine and theirs else None,
        )
        comparisons.append(stats)
    return dict(runs=rows, comparisons=comparisons)


def table(summary):
    head = (
        "run",
        "ZeRO",
        "steps",
        "tokens/s",
        "vs first",
        "ms/step",
        "peak MiB",
        "final loss",
        "eval loss",
        "busiest expert",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["runs"]:
        cells = (
            row["label"] + (f" ({row['error']})" if row["error"] else ""),
            fmt(row["zero_stage"], "d"),
            str(row["steps"]),
            fmt(row["steady_tokens_per_s"], ",.0f"),
            fmt(row["ratio_to_first"], ".3f") + ("x" if row["ratio_to_first"] else ""),
            fmt(row["step_ms"], ".1f"),
            fmt(row["peak_mem_mib"], ",.0f"),
            fmt(row["final_loss"], ".4f"),
            fmt(row["eval_loss"], ".4f"),
            fmt(row["busiest_expert_share"], ".2f") + ("x" if row["busiest_expert_share"] else ""),
        )
        lines.append("| " + " | ".join(cells) + " |")
    timed = [row for row in summary["runs"] if row["moe_forward_ms"] is not None]
    if timed:
        lines += ["\n| run | MoE layers ms (forward + backward) | optimizer step ms | rest ms |", "|---|---|---|---|"]
        for row in timed:
            moe = row["moe_forward_ms"] + row["moe_backward_ms"]
            lines.append(
                f"| {row['label']} | {moe:.2f} ({row['moe_forward_ms']:.2f} + {row['moe_backward_ms']:.2f}) | "
                f"{fmt(row['optimizer_ms'], '.2f')} | {fmt(row['rest_ms'], '.2f')} |"
            )
        lines.append("\nms a timed step on rank 0's device clock (the example's --step-shares)")
    lines.append(
        "\ntokens/s: all ranks together, steps after the timing warm-up, checkpoint saves left out; "
        "peak MiB: the accelerator allocator's peak, the largest rank (none on CPU); busiest expert: the "
        "most tokens one expert got over the run against the mean per expert, the worst layer (1.00x: "
        "even)"
    )
    for c in summary["comparisons"]:
        if c["tokens_per_s_ratio"] is not None:
            lines.append(f"\n{c['label']} / {c['base']} tokens/s: {c['tokens_per_s_ratio']:.3f}x")
        if not c["common_steps"]:
            lines.append(f"\n{c['label']} vs {c['base']}: no common steps")
            continue
        lines.append(
            f"\n{c['label']} vs {c['base']} over steps {c['first_step']}-{c['last_step']} "
            f"({c['common_steps']} steps): max |loss diff| {c['max_abs_diff']:.4f} at step "
            f"{c['max_abs_diff_step']}, mean |loss diff| {c['mean_abs_diff']:.4f}, "
            f"mean loss over the last {c['tail_steps']} of them differs by {fmt(c['tail_mean_diff'], '+.4f')}"
        )
    return "\n".join(lines)


def import_pyplot():
    """matplotlib.pyplot on the Agg backend; raises ImportError when matplotlib cannot be imported."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_matplotlib(plt, runs, out, title):

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": (3, 1.3)})
    base = runs[0]
    for index, run in enumerate(runs):
        color = tuple(c / 255 for c in COLORS[index % len(COLORS)])
        steps = run.steps
        top.plot(steps, [run.losses[s] for s in steps], color=color, linewidth=1.2, label=run.label)
        if index:
            diffs, _ = difference(run, base)
            bottom.plot(
                sorted(diffs),
                [diffs[s] for s in sorted(diffs)],
                color=color,
                linewidth=1.0,
                label=f"{run.label} - {base.label}",
            )
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
            checks.append(
                f"{c['label']} vs {c['base']}: max |loss diff| {c['max_abs_diff']:.4f} at step "
                f"{c['max_abs_diff_step']} exceeds {args.max_diff_tol}"
            )
        if (
            args.tail_diff_tol is not None
            and c["tail_mean_diff"] is not None
            and abs(c["tail_mean_diff"]) > args.tail_diff_tol
        ):
            checks.append(
                f"{c['label']} vs {c['base']}: mean loss over the last {c['tail_steps']} common steps "
                f"differs by {c['tail_mean_diff']:+.4f}, more than {args.tail_diff_tol}"
            )
    for message in checks:
        print("CHECK FAILED: " + message)
    if checks and status == 0:
        status = 1
    summary["checks_failed"] = checks
    write_summary(args, summary, text, [f"CHECK FAILED: {m}" for m in checks])
    if args.out:
        drawable = [run for run in runs if run.losses]
        try:
            plt = import_pyplot()
        except ImportError as error:
            plt = None
            print(
                f"cannot draw {args.out}: matplotlib cannot be imported ({error}); pip install matplotlib",
                file=sys.stderr,
            )
        if not drawable:
            print(f"cannot draw {args.out}: no run has losses", file=sys.stderr)
        if plt is None or not drawable:
            return status or 3
        plot_matplotlib(plt, drawable, args.out, args.title)
        print(f"wrote {args.out}")
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
        starts = resumed.start_steps
        if args.from_step not in starts:
            problems.append(
                f"the resumed run started at step(s) {starts}, not at step {args.from_step}: "
                "it did not load the checkpoint"
            )
        expected = [s for s in full.steps if s > args.from_step]
        got = [s for s in resumed.steps if s > args.from_step]
        if not expected:
            problems.append(f"the uninterrupted run logged no step after {args.from_step}")
        elif got != expected:
            problems.append(
                f"the resumed run logged steps {got[:3]}...{got[-3:]} after {args.from_step}, "
                f"the uninterrupted run {expected[:3]}...{expected[-3:]}"
            )
        common = [s for s in expected if s in resumed.losses]
        if common:
            diffs = {s: resumed.losses[s] - full.losses[s] for s in common}
            worst = max(common, key=lambda s: abs(diffs[s]))
            print(
                f"resumed at step {args.from_step}; steps {common[0]}-{common[-1]}: loss at step {common[0]} "
                f"{resumed.losses[common[0]]:.5f} vs {full.losses[common[0]]:.5f} uninterrupted; "
                f"max |diff| {abs(diffs[worst]):.2e} at step {worst}; "
                f"mean |diff| {sum(abs(d) for d in diffs.values()) / len(diffs):.2e}"
            )
            if abs(diffs[common[0]]) > args.first_tol:
                problems.append(
                    f"first resumed step {common[0]}: loss {resumed.losses[common[0]]:.5f} vs "
                    f"{full.losses[common[0]]:.5f} (|diff| {abs(diffs[common[0]]):.2e} > {args.first_tol})"
                )
            if abs(diffs[worst]) > args.tol:
                problems.append(
                    f"step {worst}: loss {resumed.losses[worst]:.5f} vs {full.losses[worst]:.5f} "
                    f"(|diff| {abs(diffs[worst]):.2e} > {args.tol})"
                )
            lr_steps = [s for s in common if s in full.lrs and s in resumed.lrs]
            bad_lr = [s for s in lr_steps if not math.isclose(full.lrs[s], resumed.lrs[s], rel_tol=1e-9, abs_tol=0)]
            if bad_lr:
                s = bad_lr[0]
                problems.append(
                    f"learning rate at step {s}: {resumed.lrs[s]:.3e} resumed vs {full.lrs[s]:.3e} "
                    "uninterrupted: the scheduler did not resume"
                )
    for message in problems:
        print("RESUME CHECK FAILED: " + message)
    if not problems:
        print("resume check passed")
    return 1 if problems else 0


# --------------------------------------------------------------------------------------------
# rounds: interleaved A/B runs
# --------------------------------------------------------------------------------------------


def parse_round_run(text):
    label, path = parse_run(text)
    arm, sep, number = label.rpartition("/")
    if not sep or not arm or not number:
        raise argparse.ArgumentTypeError(f"expected ARM/ROUND=PATH, got {text!r}")
    return arm, number, path


def summarize_rounds(entries):
    """Per arm: each round's tokens/s and its ratio to the first arm's in that round, and peak memory."""
    arms, runs, problems = [], {}, []
    for arm, number, path in entries:
        if arm not in arms:
            arms.append(arm)
        run = runs[arm, number] = Run(f"{arm}/{number}", path)
        if run.error or not run.summary.get("steady_tokens_per_s"):
            problems.append(f"{run.label}: {path}: {run.error or 'no steady tokens/s'}")
    base = arms[0]
    rounds = sorted({number for _, number in runs}, key=lambda n: (len(n), n))
    summary = dict(base=base, rounds=rounds, arms=[])
    for number in rounds:
        if (base, number) not in runs:
            problems.append(f"round {number} has no {base} run to compare with")
    for arm in arms:
        row = dict(arm=arm, tokens_per_s={}, ratio={}, peak_mem_mib=None)
        for number in rounds:
            run, ref = runs.get((arm, number)), runs.get((base, number))
            tokens = run.summary.get("steady_tokens_per_s") if run else None
            ref_tokens = ref.summary.get("steady_tokens_per_s") if ref else None
            row["tokens_per_s"][number] = tokens
            if tokens and ref_tokens:
                row["ratio"][number] = tokens / ref_tokens
            if run and run.summary.get("peak_memory_mib") is not None:
                row["peak_mem_mib"] = max(row["peak_mem_mib"] or 0.0, run.summary["peak_memory_mib"])
        ratios = list(row["ratio"].values())
        row["ratio_geomean"] = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
        row["ratio_min"], row["ratio_max"] = (min(ratios), max(ratios)) if ratios else (None, None)
        summary["arms"].append(row)
    base_mem = summary["arms"][0]["peak_mem_mib"]
    for row in summary["arms"]:
        row["peak_mem_vs_base_mib"] = (
            row["peak_mem_mib"] - base_mem if row["peak_mem_mib"] is not None and base_mem is not None else None
        )
    return summary, problems


def rounds_table(summary):
    head = (
        ["arm"]
        + [f"round {n} tokens/s" for n in summary["rounds"]]
        + [f"vs {summary['base']} (geomean, range)", "peak MiB", f"peak vs {summary['base']}"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["arms"]:
        spread = (
            f"{row['ratio_geomean']:.3f}x ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})"
            if row["ratio_geomean"] is not None
            else "-"
        )
        cells = (
            [row["arm"]]
            + [fmt(row["tokens_per_s"][n], ",.0f") for n in summary["rounds"]]
            + [spread, fmt(row["peak_mem_mib"], ",.0f"), fmt(row["peak_mem_vs_base_mib"], "+,.0f")]
        )
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "\nratios: each round's tokens/s over the same round's " + summary["base"] + " run; peak MiB: "
        "the largest over the arm's rounds and ranks"
    )
    return "\n".join(lines)


def cmd_rounds(args):
    summary, problems = summarize_rounds(args.runs)
    text = rounds_table(summary)
    print(text)
    for message in problems:
        print("ROUNDS: " + message, file=sys.stderr)
    summary["problems"] = problems
    write_summary(args, summary, text, [f"ROUNDS: {m}" for m in problems])
    return 2 if problems else 0


def add_summary_outputs(command, title):
    """The options write_summary reads."""
    command.add_argument("--json", help="write the summary as JSON here")
    command.add_argument("--markdown", help="write the table as Markdown here")
    command.add_argument("--title", default=title)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="loss curves (PNG) and the summary table")
    plot.add_argument(
        "runs",
        nargs="+",
        type=parse_run,
        metavar="LABEL=DIR",
        help="runs to compare; the first is the baseline of the ratios and differences",
    )
    plot.add_argument("--out", help="PNG to write")
    add_summary_outputs(plot, "examples/train_moe.py: training loss")
    plot.add_argument("--tail", type=int, default=20, help="last common steps whose mean losses are compared")
    plot.add_argument(
        "--max-diff-tol",
        type=float,
        default=None,
        help="fail (exit 1) when a run's per-step loss differs from the first run's by more",
    )
    plot.add_argument(
        "--tail-diff-tol",
        type=float,
        default=None,
        help="fail (exit 1) when the mean loss of the last --tail steps differs by more",
    )
    plot.set_defaults(func=cmd_plot)
    check = commands.add_parser("resume-check", help="a resumed run against the uninterrupted run")
    check.add_argument("--full", required=True, help="csv_monitor directory of the uninterrupted run")
    check.add_argument(
        "--resumed",
        required=True,
        help="csv_monitor directory of the run resumed from the checkpoint (its first run's too, "
        "when it resumed into the same directory)",
    )
    check.add_argument("--from-step", type=int, required=True, help="the step of the checkpoint it resumed from")
    check.add_argument("--first-tol", type=float, default=5e-3, help="largest |loss diff| at the first resumed step")
    check.add_argument("--tol", type=float, default=2e-2, help="largest |loss diff| at any resumed step")
    check.set_defaults(func=cmd_resume_check)
    rounds = commands.add_parser("rounds", help="interleaved A/B runs: tokens/s ratios per round, peak memory")
    rounds.add_argument(
        "runs",
        nargs="+",
        type=parse_round_run,
        metavar="ARM/ROUND=DIR",
        help="the runs; the first arm named is the baseline of every round's ratios",
    )
    add_summary_outputs(rounds, "examples/train_moe.py: interleaved runs")
    rounds.set_defaults(func=cmd_rounds)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
