"""Real Jupyter kernels for the notebook tests (``test_notebooks.py``, ``test_notebook_job.py``).

``kernel_manager(folder)`` starts nothing yet: it returns a ``jupyter_client.KernelManager`` for a
kernel spec written under ``folder`` whose command is *this* interpreter (the project's venv:
``sys.executable -m ipykernel_launcher``), so the tests never pick up another ``python3``
kernel installed for the user or the system. ``env`` entries are added to the kernel's
environment (e.g. ``TMPDIR``, so whatever the kernel creates in temporary folders is findable).

``Kernel`` runs code in a started kernel the way a notebook cell does and returns its outputs
(streams, display data, the result, the error) — for tests that drive a kernel cell by cell.
``execute_notebook`` runs a whole ``.ipynb`` with ``nbclient`` and returns the executed notebook.

Imports only jupyter_client, nbclient, nbformat and the standard library.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

KERNEL_NAME = "varuna-venv"


def kernel_manager(folder: Path, env: dict[str, str] | None = None) -> KernelManager:
    """A KernelManager whose kernel runs this interpreter (kernel spec written to ``folder``)."""
    spec_dir = Path(folder) / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "varuna-sdk venv", "language": "python", "env": dict(env or {})}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)])
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)


@dataclass
class CellResult:
    """What one execution produced: ``status`` ("ok" / "error"), ``stdout``, ``stderr``, every
    output message's content (``outputs``: (msg_type, content)), the error's ``ename``/``evalue``."""

    status: str
    stdout: str = ""
    stderr: str = ""
    outputs: list[tuple[str, dict]] = field(default_factory=list)
    ename: str | None = None
    evalue: str | None = None

    def mimetypes(self) -> set[str]:
        return {k for t, c in self.outputs if t in ("display_data", "execute_result") for k in c.get("data", {})}

    def text(self) -> str:
        """stdout, stderr and the text/plain of every display and result, joined."""
        parts = [self.stdout, self.stderr]
        parts += [c.get("data", {}).get("text/plain", "") for t, c in self.outputs
                  if t in ("display_data", "execute_result")]
        return "\n".join(parts)

    @property
    def result(self) -> str | None:
        """The cell's value (text/plain of its execute_result), None if it had none."""
        for t, c in self.outputs:
            if t == "execute_result":
                return c["data"].get("text/plain")
        return None


class Kernel:
    """A started kernel driven cell by cell. ``run(code)`` executes like a notebook cell;
    ``value(expr)`` returns ``json.loads`` of what ``expr`` prints as JSON in the kernel."""

    def __init__(self, km: KernelManager, cwd: Path, startup_timeout_s: float = 120.0):
        self.km = km
        km.start_kernel(cwd=str(cwd))
        self.kc = km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=startup_timeout_s)

    def run(self, code: str, timeout_s: float = 120.0) -> CellResult:
        res = CellResult(status="?")

        def hook(msg: dict[str, Any]) -> None:
            t, c = msg["msg_type"], msg["content"]
            if t == "stream":
                if c["name"] == "stdout":
                    res.stdout += c["text"]
                else:
                    res.stderr += c["text"]
            elif t in ("display_data", "execute_result", "update_display_data", "error"):
                res.outputs.append((t, c))
                if t == "error":
                    res.ename, res.evalue = c["ename"], c["evalue"]

        reply = self.kc.execute_interactive(code, timeout=timeout_s, output_hook=hook, allow_stdin=False)
        res.status = reply["content"]["status"]
        if res.status == "error" and res.ename is None:
            res.ename, res.evalue = reply["content"].get("ename"), reply["content"].get("evalue")
        return res

    def ok(self, code: str, timeout_s: float = 120.0) -> CellResult:
        """``run`` and fail (with the kernel's error) unless the cell succeeded."""
        res = self.run(code, timeout_s)
        assert res.status == "ok", f"cell failed: {res.ename}: {res.evalue}\n--- code:\n{code}\n--- output:\n{res.text()}"
        return res

    def value(self, expr: str, timeout_s: float = 120.0) -> Any:
        out = self.ok(f"import json as _json\nprint(_json.dumps({expr}, default=str))", timeout_s).stdout
        return json.loads(out.strip().splitlines()[-1])

    def shutdown(self, now: bool = False) -> None:
        """Ask the kernel to exit (``now``: kill it) and wait for it."""
        try:
            self.kc.stop_channels()
        finally:
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=now)


@contextlib.contextmanager
def kernel_session(root: Path, setup: str, close: str, setup_timeout_s: float = 300.0,
                   close_timeout_s: float = 150.0) -> Iterator[Kernel]:
    """A kernel started in ``root`` (``kernel.root``) that has run ``setup``; at the end ``close``
    runs in it (jobs closed, providers released) and the kernel is shut down, even when a test
    failed."""
    k = Kernel(kernel_manager(root), cwd=root)
    k.root = root
    try:
        k.ok(setup, timeout_s=setup_timeout_s)
        yield k
    finally:
        try:
            if k.km.has_kernel:
                k.run(close, timeout_s=close_timeout_s)
        finally:
            k.shutdown()


def execute_notebook(path: Path, cwd: Path, km: KernelManager, cell_timeout_s: float):
    """Execute the notebook at ``path`` top to bottom in ``km``'s kernel (working directory
    ``cwd``); returns the executed ``NotebookNode`` — also when a cell failed: then the error is
    raised (``nbclient.exceptions.CellExecutionError``) after the kernel was shut down."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, km=km, timeout=cell_timeout_s, allow_errors=False,
                            resources={"metadata": {"path": str(cwd)}})
    try:
        client.execute()
    finally:
        if km.has_kernel:  # nbclient leaves a kernel it did not create running
            km.shutdown_kernel(now=False)
    return nb
