"""Many random MoE layer calls, each checked against float64 and against the reference pipeline.

    python -m tests.support.soak --calls 1000 [--world-size 2] [--ranks-per-gpu 2] [--seed 1] [--max-seconds S]
        [--calls-per-case 5] [--out DIR]
    python -m tests.support.soak --replay DIR/soak.json [--replay-index N] [--ranks-per-gpu 2]

Every rank of a pool (``tests/support/dist_pool.py``: NCCL with one rank per GPU, or gloo with
``--ranks-per-gpu`` ranks sharing each GPU, or gloo on CPU without CUDA) builds random layers and
calls them. A *case* is one layer: random hidden and FFN sizes (multiples of 8), experts per rank,
k, expert kind (GELU FFN with biases or SwiGLU without), dropping or not, capacity factor, minimum
capacity and dtype (bf16 or fp16 on a GPU, fp32 on CPU), drawn alike on every rank. Each case
then makes a few *calls*, each with fresh tokens, a token count of its own on every rank (empty
ranks included), skewed routing at random (some experts empty, routes dropped), train or eval, and
in train mode forward and backward.

The layer under test asks for ``"overlap": "auto"``: the fused pipeline on a GPU, the reference
one on CPU. Beside it run the reference pipeline in the same dtype and a float64 copy of the same
weights (the ground truth); the gate's noise is seeded alike for all three, so they route alike.
A call *mismatches* when its output, input gradient or any parameter gradient is not finite, or
further from float64 (relative Frobenius norm) than both the dtype's tolerance (bf16 and fp16: 1e-2
for outputs, 2e-2 for gradients; fp32: 1e-5 / 1e-4) and twice the reference pipeline's own distance
from float64 in the same dtype. The second bound is for tensors that no implementation in that dtype
gets close to float64: with routing skewed to saturation, an expert's routes carry gates of 1e-10
and less, and in fp16 (bf16 has fp32's range) their gradients underflow before the weight-gradient
GEMMs; stock DeepSpeed's are as far off. The distance from the reference pipeline is reported too.
The gate's weight gradient on a rank of fewer than 4 tokens is reported and not judged: with one
token and k=1 it is the token's features times a single number, the gradient of the route's gate
value, which is one dot product rounded in the dtype (the expert's output row with the output
gradient). Two correct implementations' errors are then two draws of one random rounding, and one
is more than twice the other about 30% of the time (for half-normal errors, (2/pi) atan(1/2)); a
few tokens more average it out. A wrong gate gradient shows on every rank with more tokens.
A call *hangs* when a wait of the layer gives up (``wait_timeout_s``, set by ``--timeout``); the
rank then stops, and so does the run.

The report (printed, and ``soak.json`` under ``--out``): calls, calls on the fused pipeline, cases,
mismatches (each with its case, the case's seed, and its call), hangs, and the largest error of each
kind. ``--replay`` runs one recorded mismatch or hang again, on as many ranks as it had, and prints
every tensor's distances on every rank. A GPU test (``tests/gpu/test_soak.py``) and a CPU test run a
small count; the figures for thousands of calls are in docs/benchmarks.md.
"""

import argparse
import json
import os
import random
import sys
import time

import torch

from tests.support.moe_helpers import rel

TOLERANCES = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (1e-2, 2e-2), torch.float32: (1e-5, 1e-4)}
MAX_TOKENS = 384  # per rank; the fused workspace is sized for it up front
JUDGED_GATE_TOKENS = 4  # the gate's weight gradient is judged on ranks of at least this many tokens


def draw_case(rng: random.Random, ep_size: int, on_gpu: bool) -> dict:
    """One layer's settings, from an RNG every rank seeds alike."""
    experts_per_rank = rng.choice([1, 2, 3, 4, 8])
    num_experts = experts_per_rank * ep_size
    k = rng.randint(1, min(num_experts, 8))
    # A few hidden sizes, odd multiples of 8 among them: the fused workspace is kept per shape.
    return dict(
        hidden=rng.choice([64, 136, 264, 512, 712]),
        ffn=8 * rng.randint(4, 160),
        num_experts=num_experts,
        k=k,
        expert_kind=rng.choice(["gelu", "swiglu"]),
        drop_tokens=rng.random() < 0.6,
        capacity_factor=rng.choice([0.5, 1.0, 1.25, 2.0]),
        min_capacity=rng.choice([0, 4]),
        dtype=rng.choice(["bf16", "fp16"]) if on_gpu else "fp32",
    )


def draw_call(rng: random.Random, ep_size: int, case: dict) -> dict:
    """One call's settings, alike on every rank; each rank's token count is its own entry."""
    # Top-1 asserts, as stock does, that a rank has at least min_capacity tokens (and one); every
    # other k takes empty ranks.
    smallest = max(1, case["min_capacity"]) if case["k"] == 1 else 0
    return dict(
        tokens=[
            rng.choice([smallest, rng.randint(smallest, 16), rng.randint(max(smallest, 1), MAX_TOKENS)])
            for _ in range(ep_size)
        ],
        skew=rng.choice([0.0, 0.0, 4.0, 50.0]),
        train=rng.random() < 0.6,
        seed=rng.randint(1, 10**6),
    )


def _build(case: dict, seed: int, device, dtype, timeout_s: float):
    from deepspeed import comm as dist

    import ds_comet
    from tests.support.moe_helpers import make_expert, reset_experts_

    moe_kwargs = dict(
        num_experts=case["num_experts"],
        ep_size=dist.get_world_size(),
        k=case["k"],
        drop_tokens=case["drop_tokens"],
        capacity_factor=case["capacity_factor"],
        eval_capacity_factor=case["capacity_factor"],
        min_capacity=case["min_capacity"],
    )
    torch.manual_seed(seed)
    template = make_expert(case["expert_kind"], case["hidden"], case["ffn"])
    layers = {}
    for name, overlap in (("tested", "auto"), ("reference", "none"), ("exact", "none")):
        section = {
            "backend": "comet",
            "overlap": overlap,
            "wait_timeout_s": timeout_s,
            "max_tokens_per_rank": MAX_TOKENS,
        }
        layer = ds_comet.MoE(case["hidden"], template, config={"moe": section}, **moe_kwargs)
        layer.set_deepspeed_parallelism()
        if name == "tested":
            reset_experts_(layer, seed)
        else:
            layer.load_state_dict(layers["tested"].state_dict())
        layers[name] = layer.to(device=device, dtype=dtype)
    layers["exact"] = layers["exact"].to(torch.float64)
    return layers


def _inputs(layers: dict, case: dict, call: dict, rank: int, device, dtype):
    """This rank's tokens and output gradient for ``call`` (skewed towards expert 0's gate row)."""
    generator = torch.Generator(device=device).manual_seed(call["seed"] * 16 + rank)
    tokens = torch.randn(call["tokens"][rank], case["hidden"], generator=generator, device=device)
    if call["skew"]:
        tokens += call["skew"] * layers["exact"].deepspeed_moe.gate.wg.weight[0].detach().float()
    tokens = tokens.to(dtype)
    return tokens, torch.randn(tokens.shape, generator=generator, device=device).to(dtype)


def _call(layers: dict, tokens, grad_out, train: bool, noise: int) -> dict:
    """Every layer's output and, in train mode, its input and parameter gradients."""
    results = {}
    for name, layer in layers.items():
        dtype = torch.float64 if name == "exact" else tokens.dtype
        layer.train(train)
        layer.zero_grad(set_to_none=True)
        inputs = tokens.to(dtype).unsqueeze(0).requires_grad_(train)
        torch.manual_seed(noise)  # the gate's noise: top-2 sampling, RSample, jitter
        with torch.set_grad_enabled(train):
            out, l_aux, _ = layer(inputs)
            if train:
                torch.autograd.backward(
                    [out, l_aux],
                    [grad_out.to(dtype).unsqueeze(0), torch.tensor(0.01, dtype=l_aux.dtype, device=l_aux.device)],
                )
        found = {"output": out.detach()[0]}
        if train:
            found["input grad"] = inputs.grad[0]
            found.update({f"grad {pname}": param.grad for pname, param in layer.named_parameters()})
        results[name] = found
    return results


def _compare(results: dict, dtype, num_tokens: int = JUDGED_GATE_TOKENS) -> dict:
    """The largest relative errors by kind (from float64, the reference pipeline's from float64, and
    from the reference pipeline), and what failed (the module docstring's rule) on a rank of
    ``num_tokens`` tokens."""
    out_tol, grad_tol = TOLERANCES[dtype]
    worst, failed = {}, []
    for what, exact in results["exact"].items():
        tested, reference = results["tested"][what], results["reference"][what]
        if exact is None or tested is None:
            if (exact is None) != (tested is None):
                failed.append(f"{what}: a gradient is missing on one side")
            continue
        kind = "output" if what == "output" else "gate gradient" if ".gate." in what else "gradient"
        if tested.numel() == 0:
            continue
        if not torch.isfinite(tested).all():
            failed.append(f"{what}: not finite")
            continue
        errors = {
            f"{kind} vs float64": rel(tested, exact),
            f"{kind}: reference vs float64": rel(reference, exact),
            f"{kind} vs reference": rel(tested, reference),
        }
        for name, value in errors.items():
            worst[name] = max(worst.get(name, 0.0), value)
        if kind == "gate gradient" and num_tokens < JUDGED_GATE_TOKENS:
            continue  # reported, not judged: one rounding decides it (module docstring)
        from_exact, reference_from_exact = errors[f"{kind} vs float64"], errors[f"{kind}: reference vs float64"]
        allowed = max(out_tol if what == "output" else grad_tol, 2 * reference_from_exact)
        if from_exact > allowed:
            failed.append(
                f"{what}: {from_exact:.2e} from float64, where the reference pipeline is "
                f"{reference_from_exact:.2e} from it ({errors[f'{kind} vs reference']:.2e} from the "
                f"reference)"
            )
    return dict(worst=worst, failed=failed)


def soak_rank(
    seed: int, calls: int, timeout_s: float = 30.0, calls_per_case: int = 5, progress: int = 0, max_seconds: float = 0.0
) -> dict:
    """Runs on every rank of a pool: ``calls`` checked calls of random layers (rank 0 prints a line
    every ``progress`` calls, with the mismatches of every rank, when it is not 0; past
    ``max_seconds``, when not 0, the ranks stop together before the next case). Returns this rank's
    tally."""
    from deepspeed import comm as dist

    from ds_comet.kernels.ops import CometWaitTimeout

    rank, ep_size = dist.get_rank(), dist.get_world_size()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    rng = random.Random(seed)
    tally = dict(calls=0, fused_calls=0, cases=0, mismatches=[], hangs=[], worst={}, seconds=0.0)
    start = time.monotonic()
    while tally["calls"] < calls:
        if max_seconds and _agree_to_stop(time.monotonic() - start > max_seconds, device):
            break
        case = draw_case(rng, ep_size, on_gpu)
        dtype = dtypes[case["dtype"]]
        case_seed = rng.randint(1, 10**6)
        layers = _build(case, case_seed, device, dtype, timeout_s)
        tally["cases"] += 1
        recorded = dict(case, seed=case_seed)  # what --replay needs to build the same layer
        for index in range(min(calls_per_case, calls - tally["calls"])):
            call = draw_call(rng, ep_size, case)
            tokens, grad_out = _inputs(layers, case, call, rank, device, dtype)
            try:
                results = _call(layers, tokens, grad_out, call["train"], call["seed"])
            except CometWaitTimeout as error:  # the wait gave up: the rank cannot go on
                tally["hangs"].append(dict(case=recorded, call=dict(call, index=index), error=str(error)))
                tally["seconds"] = time.monotonic() - start
                return tally
            tally["calls"] += 1
            tally["fused_calls"] += int(layers["tested"].deepspeed_moe.pipelines.reason is None)
            compared = _compare(results, dtype, call["tokens"][rank])
            for kind, value in compared["worst"].items():
                tally["worst"][kind] = max(tally["worst"].get(kind, 0.0), value)
            if compared["failed"]:
                tally["mismatches"].append(dict(case=recorded, call=dict(call, index=index), failed=compared["failed"]))
            if progress and tally["calls"] % progress == 0:
                # A run cut short by an outer time limit still shows how far it got. Every rank makes
                # the same calls, so every rank is here together for the sum.
                mismatches = _sum_over_ranks(len(tally["mismatches"]), device)
                if rank == 0:
                    print(
                        f"soak: {tally['calls']}/{calls} calls, {tally['fused_calls']} fused, {mismatches} "
                        f"mismatches over all ranks, {time.monotonic() - start:.0f} s",
                        flush=True,
                    )
        del layers
        if on_gpu:
            torch.cuda.empty_cache()
    tally["seconds"] = time.monotonic() - start
    return tally


def replay_rank(case: dict, call: dict, timeout_s: float = 30.0) -> dict:
    """Runs on every rank of a pool as large as the recorded call's ranks: one recorded call again
    (``case`` with its ``seed``, as a report records it), and every tensor's distances on this rank:
    {name: (from float64, the reference pipeline's from float64, from the reference pipeline)}."""
    from deepspeed import comm as dist

    from tests.support.moe_helpers import rel

    rank = dist.get_rank()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[case["dtype"]]
    layers = _build(case, case["seed"], device, dtype, timeout_s)
    tokens, grad_out = _inputs(layers, case, call, rank, device, dtype)
    results = _call(layers, tokens, grad_out, call["train"], call["seed"])
    distances = {}
    for name, exact in results["exact"].items():
        tested, reference = results["tested"][name], results["reference"][name]
        if exact is not None and tested is not None and tested.numel():
            distances[name] = (rel(tested, exact), rel(reference, exact), rel(tested, reference))
    return dict(
        tokens=call["tokens"][rank],
        fused=layers["tested"].deepspeed_moe.pipelines.reason is None,
        distances=distances,
        failed=_compare(results, dtype, call["tokens"][rank])["failed"],
    )


def _agree_to_stop(mine: bool, device) -> bool:
    """Whether any rank wants to stop: every rank must make the same calls, so they decide together."""
    return _reduce_over_ranks(int(mine), device, "max") > 0


def _sum_over_ranks(value: int, device) -> int:
    return _reduce_over_ranks(value, device, "sum")


def _reduce_over_ranks(value: int, device, how: str) -> int:
    from deepspeed import comm as dist

    flag = torch.tensor([value], device=device if torch.distributed.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.SUM)
    return int(flag.item())


def summarize(tallies: list) -> dict:
    """One report from every rank's tally."""
    worst = {}
    for tally in tallies:
        for kind, value in tally["worst"].items():
            worst[kind] = max(worst.get(kind, 0.0), value)
    return dict(
        ranks=len(tallies),
        calls=tallies[0]["calls"],
        fused_calls=min(t["fused_calls"] for t in tallies),
        cases=tallies[0]["cases"],
        mismatches=sum(len(t["mismatches"]) for t in tallies),
        hangs=sum(len(t["hangs"]) for t in tallies),
        worst=worst,
        seconds=max(t["seconds"] for t in tallies),
        first_mismatches=[m for t in tallies for m in t["mismatches"]][:5],
        first_hangs=[h for t in tallies for h in t["hangs"]][:5],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--world-size", type=int, default=2, help="ranks in the expert-parallel group")
    parser.add_argument(
        "--ranks-per-gpu",
        type=int,
        default=None,
        help="gloo ranks sharing each GPU (default: one NCCL rank per GPU when there are enough)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=30.0, help="the layers' wait_timeout_s")
    parser.add_argument("--progress", type=int, default=50, help="rank 0 prints a line every this many calls")
    parser.add_argument("--calls-per-case", type=int, default=5, help="calls of each random layer")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=0.0,
        help="stop, with a full report, at the first case that starts past this many seconds",
    )
    parser.add_argument("--out", default="soak_out")
    parser.add_argument(
        "--replay",
        metavar="SOAK_JSON",
        default=None,
        help="run one recorded mismatch or hang of a report again and print every tensor's distances",
    )
    parser.add_argument("--replay-index", type=int, default=0, help="which of the report's mismatches and hangs")
    args = parser.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.support.dist_pool import DistPool

    replayed = None
    if args.replay:
        with open(args.replay) as handle:
            tallies = json.load(handle)["tallies"]
        recorded = [entry for tally in tallies for entry in tally["mismatches"] + tally["hangs"]]
        if not 0 <= args.replay_index < len(recorded):
            raise SystemExit(
                f"{args.replay} records {len(recorded)} mismatches and hangs; --replay-index "
                f"{args.replay_index} is not one of them"
            )
        replayed = recorded[args.replay_index]
        if "seed" not in replayed["case"]:
            raise SystemExit(f"{args.replay} predates recording each case's seed: its calls cannot be replayed")
        args.world_size = len(replayed["call"]["tokens"])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        pool = DistPool(args.world_size)
    else:
        per_gpu = args.ranks_per_gpu or (1 if gpus >= args.world_size else -(-args.world_size // gpus))
        if per_gpu * gpus < args.world_size:
            raise SystemExit(f"{gpus} GPUs with {per_gpu} ranks each cannot hold {args.world_size} ranks")
        pool = DistPool(args.world_size, backend="nccl" if per_gpu == 1 else "gloo", gpu_ranks=per_gpu)
    if replayed is not None:
        try:
            answers = pool.run(replay_rank, case=replayed["case"], call=replayed["call"], timeout_s=args.timeout)
        finally:
            pool.stop()
        print(json.dumps(replayed, default=str))
        for rank, answer in enumerate(answers):
            print(
                f"rank {rank}: {answer['tokens']} tokens, {'fused' if answer['fused'] else 'reference'} pipeline; "
                f"failed: {answer['failed'] or 'nothing'}"
            )
            for name, (tested, reference, between) in answer["distances"].items():
                print(f"  {name:60} {tested:10.2e} {reference:10.2e} {between:10.2e}")
        print("columns: from float64, the reference pipeline's from float64, from the reference pipeline")
        return
    try:
        # A generous bound for the whole run: each call waits at most --timeout, and a rank that
        # gives up returns at once; the pool's own timeout catches a rank that never answers.
        tallies = pool.run(
            soak_rank,
            timeout=max(600.0, 20.0 * args.calls),
            seed=args.seed,
            calls=args.calls,
            timeout_s=args.timeout,
            progress=args.progress,
            max_seconds=args.max_seconds,
            calls_per_case=args.calls_per_case,
        )
    finally:
        pool.stop()
    report = summarize(tallies)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.json"), "w") as handle:
        json.dump(dict(report, tallies=tallies), handle, indent=1, default=str)
    print(json.dumps({key: value for key, value in report.items() if not key.startswith("first_")}, indent=1))
    for entry in report["first_mismatches"] + report["first_hangs"]:
        print(json.dumps(entry, default=str))
    sys.exit(1 if report["mismatches"] or report["hangs"] else 0)


if __name__ == "__main__":
    main()
