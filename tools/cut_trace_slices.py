"""Re-cut the trace slices shipped in kvsched/data/ from the full upstream trace files.

    python tools/cut_trace_slices.py DIR [--seconds 300]

DIR holds the upstream files under their names in kvsched/data/README.md
(`mooncake_conversation.jsonl`, `azure2023_code.csv`). Each slice is the rows that arrive in
the first `--seconds` of its trace, copied byte for byte (line endings included): a contiguous
window from the trace's start, nothing filtered or reordered. Prints each slice's rows and size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvsched.traces import parse_azure_timestamp

OUT = Path(__file__).resolve().parents[1] / "kvsched" / "data"
SLICES = {  # upstream file -> shipped slice
    "mooncake_conversation.jsonl": "mooncake_conversation_slice.jsonl",
    "azure2023_code.csv": "azure2023_code_slice.csv",
}


def arrival_s(line: bytes, first: list[float], csv: bool) -> float:
    """Seconds of this row after the trace's first row (`first` holds that row's time)."""
    if csv:
        t = parse_azure_timestamp(line.decode().split(",", 1)[0]).timestamp()
    else:
        t = json.loads(line)["timestamp"] / 1000.0
    if not first:
        first.append(t)
    return t - first[0]


def cut(src: Path, dst: Path, seconds: float) -> int:
    csv = src.suffix == ".csv"
    kept: list[bytes] = []
    first: list[float] = []
    with src.open("rb") as f:
        if csv:
            kept.append(f.readline())  # header
        for line in f:
            if line.strip() and arrival_s(line, first, csv) >= seconds:
                break
            kept.append(line)
    dst.write_bytes(b"".join(kept))
    return len(kept) - int(csv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("source", type=Path, help="folder with the full upstream trace files")
    ap.add_argument("--seconds", type=float, default=300.0, help="window from the trace's start")
    args = ap.parse_args()
    for name, slice_name in SLICES.items():
        dst = OUT / slice_name
        rows = cut(args.source / name, dst, args.seconds)
        print(f"{dst}: {rows} rows, {dst.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
