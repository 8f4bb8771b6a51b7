"""Each distributed training script, ended many times: every run must exit 0 (tests/test_exit.py).

Started as the ranks of one job (RANK, WORLD_SIZE, MASTER_PORT set), with a JSON list of
[script, [args...]] (a training script: each run gets a --run_dir of its own) or [script, [args...], false] (a
script without one; "{run_dir}" in its args becomes the run's own folder) and a repeat count. Each rank imports torch and the project once, then forks one
child per run: the children of all ranks meet at MASTER_PORT + k, run the script as `python SCRIPT`
does (its __main__, through run_cli) and end as that process would, interpreter shutdown included.
The rank prints one JSON line per run: the script, the run and the child's exit status (a negative
status is a signal: -6 is an abort at exit).
"""

import json
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402,F401  (imported once, before the forks: the runs cost their own time only)

import models  # noqa: E402,F401
import utils.training  # noqa: E402,F401


def main() -> None:
    runs, repeats, run_root = json.loads(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    port, k = int(os.environ["MASTER_PORT"]), 0
    for script, args, *run_dir in runs:
        for repeat in range(repeats):
            k += 1
            pid = os.fork()
            if pid == 0:  # the run: it never returns here, it ends as the script's own process would
                os.environ["MASTER_PORT"] = str(port + k)
                folder = str(run_root / f"{k:02d}_{Path(script).stem}")
                own = ["--run_dir", folder] if run_dir != [False] else []
                sys.argv = [script, *[a.replace("{run_dir}", folder) for a in args], *own]
                os.chdir(REPO)
                runpy.run_path(str(REPO / script), run_name="__main__")
                sys.exit(0)
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            print(json.dumps({"script": script, "args": args, "repeat": repeat, "status": status}), flush=True)


if __name__ == "__main__":
    main()
