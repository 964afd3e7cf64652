#!/usr/bin/env python3
"""Runs scale.py over a matrix of runs and appends one JSON line per run to a results file:
node counts × MIG modes × the claim kinds that mode can serve. Against ../shared/realk8s (up.sh), kept
out of CI; plot.py draws the curves from the file.

    benches/realk8s/sweep.py --bin target/release/gpu-dra --nodes 10 100 --out benches/realk8s/results.jsonl
"""
import argparse
import json
import os
import subprocess
import sys

# Which claims each layout can serve: static MIG (the admin's devices, no whole GPUs) serves MIG
# claims only; without MIG there are only whole GPUs. `unfit` asks for more GPUs than a node has.
CLAIMS = {
    "none": ["whole", "nvlink-pair", "unfit"],
    "static": ["mig-1g", "mig-mixed", "unfit"],
    "dynamic": ["whole", "mig-1g", "mig-mixed", "nvlink-pair", "unfit"],
}


def pods_for(nodes, claim):
    # Enough pods to fill a good part of a small cluster, few enough that 1,000 nodes finish.
    if claim == "unfit":
        return 20
    return {10: 50, 100: 200}.get(nodes, 100)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/gpu-dra")
    ap.add_argument("--nodes", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--modes", nargs="+", default=["none", "static", "dynamic"])
    ap.add_argument("--claims", nargs="+", help="only these claim kinds")
    ap.add_argument("--label", default="", help="recorded with each line, e.g. the commit")
    ap.add_argument("--out", default="benches/realk8s/results.jsonl")
    ap.add_argument("scale_args", nargs="*", help="passed on to scale.py (after --)")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    for nodes in args.nodes:
        for mode in args.modes:
            for claim in CLAIMS[mode]:
                if args.claims and claim not in args.claims:
                    continue
                cmd = [sys.executable, os.path.join(here, "scale.py"), "--bin", args.bin, "--nodes", str(nodes),
                       "--pods", str(pods_for(nodes, claim)), "--mig-mode", mode, "--claim", claim,
                       *args.scale_args]
                print("+", " ".join(cmd[1:]), file=sys.stderr, flush=True)
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    print(out.stderr, file=sys.stderr)
                    continue
                report = json.loads(out.stdout.strip().splitlines()[-1])
                report["label"] = args.label
                with open(args.out, "a") as f:
                    f.write(json.dumps(report) + "\n")
                print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
