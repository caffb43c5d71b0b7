"""``fxpipe show PLAN [--json] [--png OUT]``: a saved plan's summary, its JSON, or its pictures."""

from __future__ import annotations

import argparse
import json

__all__ = ["add_parser", "run"]

EXAMPLES = """examples:
  fxpipe show r101.plan.json                       # stages, times, memory, bottleneck
  fxpipe show r101.plan.json --json | jq .predicted
  fxpipe show r101.plan.json --png r101.png        # stage bars; r101.timeline.png: the simulated schedule
"""


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("show", help="print the summary of a saved plan (or its JSON, or draw it)",
                            epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter, parents=parents)
    parser.add_argument("plan", help="a plan saved by fxpipe plan --save or plan.save()")
    parser.add_argument("--json", action="store_true", help="print the plan's JSON (checked and migrated)")
    parser.add_argument("--png", help="draw the stages into this PNG, and the timeline next to it (*.timeline.png)")


def run(args: argparse.Namespace) -> int:
    import fxpipe
    plan = fxpipe.load_plan(args.plan)
    print(json.dumps(plan.to_dict(), indent=1) if args.json else plan.summary())
    if args.png:
        stem = args.png[:-4] if args.png.lower().endswith(".png") else args.png
        plan.plot().savefig(args.png)
        plan.timeline().savefig(f"{stem}.timeline.png")
        if not args.json:
            print(f"saved {args.png} and {stem}.timeline.png")
    return 0
