"""How long each lab's cells stay silent: the longest wait between two signs of life.

    python benchmarks/silences.py [labs/NN-*.ipynb ...]    (default: every lab)

Runs each notebook top to bottom in a fresh kernel (a learner's Run All) and times, per code
cell, the gaps between its start, each output it sends (stdout, stderr, a figure, a value) and
its end. A learner watching a cell sees nothing during such a gap. Prints, per lab, its run time
and every cell whose longest gap exceeds 10 s (the labs' target), then a table for docs.
"""
import argparse
import glob
import os
import sys
import time

import nbformat
from jupyter_client.manager import start_new_kernel

TARGET_S = 10.0


def silences(path: str, timeout: float = 300.0) -> list[dict]:
    nb = nbformat.read(path, as_version=4)
    km, kc = start_new_kernel(kernel_name="python3", cwd=os.path.dirname(os.path.abspath(path)))
    rows = []
    try:
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            t0 = time.monotonic()
            msg_id = kc.execute(cell.source, allow_stdin=False)
            last, longest, error = t0, 0.0, None
            while True:
                msg = kc.get_iopub_msg(timeout=timeout)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind = msg["msg_type"]
                if kind in ("stream", "display_data", "execute_result", "error", "update_display_data"):
                    now = time.monotonic()
                    longest, last = max(longest, now - last), now
                    if kind == "error":
                        error = msg["content"]["ename"]
                elif kind == "status" and msg["content"]["execution_state"] == "idle":
                    now = time.monotonic()
                    longest = max(longest, now - last)
                    break
            rows.append({"cell": cell.get("id", str(index)), "seconds": now - t0, "silent": longest,
                         "error": error, "first_line": cell.source.splitlines()[0][:60] if cell.source else ""})
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*")
    args = parser.parse_args()
    labs = args.labs or sorted(glob.glob("labs/*.ipynb"))
    print(f"load average before: {os.getloadavg()}", flush=True)
    table = []
    for lab in labs:
        rows = silences(lab)
        total = sum(r["seconds"] for r in rows)
        worst = max(rows, key=lambda r: r["silent"])
        over = [r for r in rows if r["silent"] > TARGET_S]
        errors = [r for r in rows if r["error"] and r["error"] != "CheckFailed"]
        print(f"{os.path.basename(lab)}: {total:.0f} s, longest silence {worst['silent']:.1f} s "
              f"(cell {worst['cell']}: {worst['first_line']!r}); over {TARGET_S:.0f} s: {len(over)}"
              + (f"; ERRORS {[(r['cell'], r['error']) for r in errors]}" if errors else ""), flush=True)
        for r in over:
            print(f"    cell {r['cell']}: silent {r['silent']:.1f} s of {r['seconds']:.1f} s: "
                  f"{r['first_line']!r}", flush=True)
        table.append((os.path.basename(lab), total, worst, over))
    print(f"load average after: {os.getloadavg()}\n")
    print("| notebook | run | longest silence (cell) | cells silent > 10 s |\n|---|---|---|---|")
    for name, total, worst, over in table:
        print(f"| `{name}` | {total:.0f} s | {worst['silent']:.1f} s ({worst['cell']}) | "
              f"{', '.join(r['cell'] for r in over) or 'none'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
