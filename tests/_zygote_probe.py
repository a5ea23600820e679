"""A zygote for ``tests/test_zygote.py``: ``python tests/_zygote_probe.py FD RUN_DIR`` serves
forks whose ``run(args)`` reports what the forked process sees (environment, working folder,
``sys.path``, session, stdin) as one JSON line on stdout, then sleeps ``args[1]`` seconds and
returns ``int(args[0])``."""

import json
import os
import sys
import time


def run(args: list[str]) -> int:
    print(json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path[:3], "pid": os.getpid(),
                      "sid": os.getsid(0), "ppid": os.getppid(), "stdin": os.readlink("/proc/self/fd/0"),
                      "argv": sys.argv[1:]}))
    print("to stderr", file=sys.stderr)
    time.sleep(float(args[1]))
    return int(args[0])


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from varuna_sdk.cluster.zygote import serve

    sys.exit(serve(int(sys.argv[1]), ["json"], run))
