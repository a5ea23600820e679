"""``varuna dashboard RUN_DIR``: serve a job's (or a folder of runs') live dashboard behind a
login until Ctrl-C.

The one module of ``varuna_sdk`` that imports the top-level ``dashboard`` package (``server``,
``store``), and only inside ``dashboard_command``: nothing else in ``cli`` may import it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def dashboard_command(args: argparse.Namespace) -> int:
    """``varuna dashboard RUN_DIR``: serve the job's dashboard behind a login until Ctrl-C.
    Prints the URL and where the credentials come from, never the password."""
    try:
        from dashboard.server import load_credentials, serve
        from dashboard.store import resolve_event_log
    except ImportError as e:
        print(f"varuna: the dashboard needs panel and bokeh ({e}); install the project with `pip install -e .`",
              file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port (0-65535)")
    if not 0 < args.refresh <= 3600:   # (also false for NaN)
        raise ValueError(f"--refresh {args.refresh} must be between 0 and 3600 seconds")
    from dashboard.server import is_folder_of_runs

    what = f"the jobs in {Path(args.run_dir).resolve()}" if is_folder_of_runs(args.run_dir) else \
        str(resolve_event_log(args.run_dir))
    creds, where = load_credentials(args.run_dir, args.credentials)
    server = serve(args.run_dir, credentials=creds, port=args.port, address=args.address,
                   allow_origins=args.allow_origin, job_id=args.job_id, refresh_s=args.refresh, start=False,
                   certfile=args.certfile, keyfile=args.keyfile)
    host = "localhost" if args.address in ("127.0.0.1", "::1", "localhost") else args.address
    scheme = "https" if args.certfile else "http"
    print(f"[varuna] dashboard of {what} at {scheme}://{host}:{server.port}/ (read-only; sign in with {where}); "
          "Ctrl-C stops it", flush=True)
    server.start()
    try:
        server.io_loop.start()  # panel stops the loop on Ctrl-C
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print("[varuna] dashboard stopped", flush=True)
    return 0
