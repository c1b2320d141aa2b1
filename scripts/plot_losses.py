#!/usr/bin/env python3
"""Loss curves and a speed/memory summary of examples/train_moe.py runs, read from their metrics files.

    python3 scripts/plot_losses.py plot --out loss_curves.png stock=stock.jsonl comet=comet.jsonl
    python3 scripts/plot_losses.py resume-check --full full.jsonl --resumed resumed.jsonl --from-step 30
    python3 scripts/plot_losses.py rounds stock/1=s1.jsonl comet/1=c1.jsonl stock/2=s2.jsonl comet/2=c2.jsonl

``plot`` draws each run's per-step training loss (top) and each run's difference from the first run
(bottom) into one PNG, prints a table (steady-state tokens/s, ratio to the first run, ms/step, peak
GPU memory, final and eval loss) and the per-step loss differences, and can write the same as JSON
and Markdown. The PNG needs matplotlib (drawn with the Agg backend, no display); without it the
table and the checks still run.
Exit status: 0; 1 when a difference exceeds --max-diff-tol or --tail-diff-tol; 2 when a metrics
file is missing or holds no losses.

``resume-check`` compares a resumed run with the uninterrupted one: the resumed run must start at
--from-step, log every later step, use the same learning rate at each step (exactly) and reach the
same losses (within --first-tol on its first step, --tol on all). Exit status 0 when they agree.

``rounds`` summarises interleaved runs, labelled ARM/ROUND. On the GPU machine a job's throughput
drifts by a few % from one run to the next, so an A/B is trusted only when its arms alternate.
Each arm's tokens/s is divided by the first arm's in the same round. It prints, per arm, those
ratios, their geometric mean and range, and the largest peak memory against the first arm's.
Exit status 2 when a metrics file is missing or a round lacks the first arm.
"""

import argparse
import importlib.util
import json
import math
import os
import sys

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
    write_summary(args, summary, text, [f"CHECK FAILED: {m}" for m in checks])
    if args.out:
        drawable = [run for run in runs if run.losses]
        if not drawable:
            print(f"no losses to draw; {args.out} not written", file=sys.stderr)
        elif importlib.util.find_spec("matplotlib") is None:
            print(f"matplotlib is not installed; {args.out} not written (pip install matplotlib)", file=sys.stderr)
        else:
            plot_matplotlib(drawable, args.out, args.title)
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
        if run.error or not run.train_end.get("steady_tokens_per_s"):
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
            tokens = run.train_end.get("steady_tokens_per_s") if run else None
            ref_tokens = ref.train_end.get("steady_tokens_per_s") if ref else None
            row["tokens_per_s"][number] = tokens
            if tokens and ref_tokens:
                row["ratio"][number] = tokens / ref_tokens
            if run and run.train_end.get("peak_mem_mib") is not None:
                row["peak_mem_mib"] = max(row["peak_mem_mib"] or 0.0, run.train_end["peak_mem_mib"])
        ratios = list(row["ratio"].values())
        row["ratio_geomean"] = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
        row["ratio_min"], row["ratio_max"] = (min(ratios), max(ratios)) if ratios else (None, None)
        summary["arms"].append(row)
    base_mem = summary["arms"][0]["peak_mem_mib"]
    for row in summary["arms"]:
        row["peak_mem_vs_base_mib"] = (row["peak_mem_mib"] - base_mem if row["peak_mem_mib"] is not None
                                       and base_mem is not None else None)
    return summary, problems


def rounds_table(summary):
    head = ["arm"] + [f"round {n} tokens/s" for n in summary["rounds"]] + [
        f"vs {summary['base']} (geomean, range)", "peak MiB", f"peak vs {summary['base']}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["arms"]:
        spread = (f"{row['ratio_geomean']:.3f}x ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})"
                  if row["ratio_geomean"] is not None else "-")
        cells = [row["arm"]] + [fmt(row["tokens_per_s"][n], ",.0f") for n in summary["rounds"]] + [
            spread, fmt(row["peak_mem_mib"], ",.0f"), fmt(row["peak_mem_vs_base_mib"], "+,.0f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("\nratios: each round's tokens/s over the same round's " + summary["base"] + " run; peak MiB: "
                 "the largest over the arm's rounds and ranks")
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
    plot.add_argument("runs", nargs="+", type=parse_run, metavar="LABEL=METRICS.jsonl",
                      help="runs to compare; the first is the baseline of the ratios and differences")
    plot.add_argument("--out", help="PNG to write")
    add_summary_outputs(plot, "examples/train_moe.py: training loss")
    plot.add_argument("--tail", type=int, default=20, help="last common steps whose mean losses are compared")
    plot.add_argument("--max-diff-tol", type=float, default=None,
                      help="fail (exit 1) when a run's per-step loss differs from the first run's by more")
    plot.add_argument("--tail-diff-tol", type=float, default=None,
                      help="fail (exit 1) when the mean loss of the last --tail steps differs by more")
    plot.set_defaults(func=cmd_plot)
    check = commands.add_parser("resume-check", help="a resumed run against the uninterrupted run")
    check.add_argument("--full", required=True, help="metrics of the uninterrupted run")
    check.add_argument("--resumed", required=True, help="metrics of the run resumed from the checkpoint")
    check.add_argument("--from-step", type=int, required=True, help="the step of the checkpoint it resumed from")
    check.add_argument("--first-tol", type=float, default=5e-3, help="largest |loss diff| at the first resumed step")
    check.add_argument("--tol", type=float, default=2e-2, help="largest |loss diff| at any resumed step")
    check.set_defaults(func=cmd_resume_check)
    rounds = commands.add_parser("rounds", help="interleaved A/B runs: tokens/s ratios per round, peak memory")
    rounds.add_argument("runs", nargs="+", type=parse_round_run, metavar="ARM/ROUND=METRICS.jsonl",
                        help="the runs; the first arm named is the baseline of every round's ratios")
    add_summary_outputs(rounds, "examples/train_moe.py: interleaved runs")
    rounds.set_defaults(func=cmd_rounds)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
