"""`allocsampler import-torch`: a PyTorch CUDA memory snapshot into a dataset."""

from __future__ import annotations

import argparse

HELP = "import a PyTorch CUDA memory snapshot into a dataset"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.description = ("Write a torch.cuda.memory._snapshot() pickle into a dataset: segments as "
                     "sources cuda/cuda-driver, live tensors as source torch, replayed over time "
                     "when the snapshot has a trace. Then analyze, report, top, diff read it.")
    p.add_argument("snapshot", help="the pickle (pickle.dump(torch.cuda.memory._snapshot(), f))")
    p.add_argument("--out", "-o", required=True, help="dataset directory (a new recording in it)")
    p.add_argument("--pid", type=int, default=0, help="process id to file it under (default: %(default)s)")
    p.add_argument("--comm", default="torch", help="process name to file it under (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from sampler.dataset.torch_import import import_snapshot
    from sampler.units import fmt_bytes

    s = import_snapshot(args.snapshot, args.out, pid=args.pid, comm=args.comm)
    print(f"imported {args.snapshot} into {args.out} as recording {s.recording_id}: {s.points} point(s), "
          f"{s.stacks} stacks, reserved {fmt_bytes(s.reserved_bytes)}, allocated {fmt_bytes(s.allocated_bytes)}")
    return 0
