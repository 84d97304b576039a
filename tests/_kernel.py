"""A real Jupyter kernel for tests: start it, run cells, interrupt it, kill it."""
from __future__ import annotations

import contextlib
import sys

from jupyter_client import KernelManager


@contextlib.contextmanager
def running_kernel():
    # The kernel runs this interpreter (the project's venv), in its own process group
    # like a Jupyter server starts it, so Interrupt signals the whole group.
    km = KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = sys.executable
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield km, kc
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def execute(kc, code: str, timeout: float = 120.0) -> dict:
    """Run one cell; return its status, stdout, stderr and error name/value."""
    out = {"stdout": "", "stderr": "", "ename": None, "evalue": "", "traceback": "", "result": None}

    def hook(msg):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out[content["name"]] += content["text"]
        elif kind == "error":
            out["ename"], out["evalue"] = content["ename"], content["evalue"]
            out["traceback"] = "\n".join(content["traceback"])
        elif kind == "execute_result":
            out["result"] = content["data"].get("text/plain")

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook, allow_stdin=False)
    out["status"] = reply["content"]["status"]
    return out
