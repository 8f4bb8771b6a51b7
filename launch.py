"""torchrun, for runs that must stop on a signal sent to the whole job step: the same command line and options.

    python launch.py --nproc-per-node 4 train_ddp.py --config baseline      # = torchrun --nproc-per-node 4 ...

A stop request (SIGUSR1 or SIGTERM: utils.stopping) makes the training scripts checkpoint the step they are on
and exit 75. `sbatch --signal=USR1@N` without `B:`, the form most sites' pages show, and `scancel --signal=USR1
JOBID` send SIGUSR1 to every process of the job's steps, torchrun included; torchrun handles SIGTERM, SIGINT,
SIGHUP and SIGQUIT (it passes them on to its workers) but dies at once of SIGUSR1, its default action, and its
workers are then killed before their checkpoint is written. Here torchrun runs in this process with SIGUSR1
handled as it handles the others: it passes the signal on, waits for the workers to stop (on torch >= 2.15 up
to TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds, 600 here rather than 30, as a checkpoint takes a while to write;
torch 2.6-2.14 wait 30 s), and this launcher exits 75 as they do, instead of torchrun's traceback. Everything
else, restarts included, is torchrun's. The job scripts (submit_multinode.sh) launch with it.

A worker that stops on bad input (a config, data or model refused: exit 2; a diverged loss: 3; a failed write: 4;
utils/training.py's EXIT_CODES) has said why in one line, and this launcher adds nothing to it: torchrun's report of
the failed ranks (its elastic traceback, about 25 lines) and its log lines about them are left out, and it exits with
the worker's code. Any other failure (a crash, a killed rank) is one line too: the rank, its exit code or signal, and
that its own output is above; plain torchrun prints its report in either case.

Only SIGUSR1 makes it exit 75, the code after which a job requeues itself. SIGTERM also reaches it when srun
ends a job step because a task on another node failed: the workers are still asked to checkpoint and stop, but
it exits 143 (128 + SIGTERM), so that a failed run fails its job instead of being requeued to fail again; after
a SIGUSR1, a SIGTERM (srun's, once another node's launcher has exited 75) is ignored while the workers stop. A
SIGTERM the job script was sent (scancel, preemption) is the job script's to act on, whatever this exits.
"""

import contextlib
import io
import logging
import os
import re
import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun
from torch.distributed.run import determine_local_world_size, parse_args

from utils.config import ConfigError
from utils.stopping import EXIT_STOPPED
from utils.training import EXIT_CODES, run_cli

SAID = set(EXIT_CODES.values())
"""The exit codes of a worker that has said why it stopped, in one line (utils.training.run_cli)."""

SHUTDOWN_TIMEOUT_S = 600
"""How long torchrun waits for its workers to stop before it kills them (torch >= 2.15 reads it)."""


_usr1_received = False


def _stop(signum, _frame) -> None:
    global _usr1_received
    _usr1_received = True
    # srun sends SIGTERM to the launchers of a step as soon as one of them has exited 75, maybe while this one still
    # waits for its workers' checkpoint: ignored, it would cut that wait short (torchrun's handler raises again).
    for other in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(other, signal.SIG_IGN)
    # What torchrun's own handler does for the signals it knows: its agent then stops the workers with this signal.
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def check_command(argv: list[str]) -> None:
    """ConfigError (one line, exit 2 through run_cli) for a command torchrun would refuse with its usage block, or
    for a script that is not there, which torchrun would start on every worker and report once per worker."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parse_args(argv)
    except SystemExit as exit_:
        if not exit_.code:  # --help, printed to stdout
            raise
        line = (said.getvalue().strip().splitlines() or ["bad arguments"])[-1]
        raise ConfigError(f"{line.split('error: ', 1)[-1]} (see --help)") from None
    try:  # torchrun reads it only after its parser, with a traceback for a bad value
        determine_local_world_size(args.nproc_per_node)
    except ValueError as error:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node}: {error} (give a number, gpu, cpu or "
                          "auto)") from None
    if not (args.module or args.no_python or Path(args.training_script).is_file()):
        raise ConfigError(f"{args.training_script}: no such script (give a path to a training script, e.g. "
                          "train_ddp.py, or -m MODULE)")


class _WorkersSaidWhy(logging.Filter):
    """torchrun's log lines about stopping workers (elastic/multiprocessing/api.py): the SIGTERM it sends the others
    once one has stopped, and "failed (exitcode: N)" where N says the worker has told why (SAID)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        failed = re.match(r"failed \(exitcode: (-?\d+)\)", text)
        return not (re.match(r"Sending process \d+ closing signal", text) or (failed and int(failed[1]) in SAID))


def _failed(error: ChildFailedError) -> int:
    """The exit code of the first rank that failed; one line unless that rank said why itself."""
    rank, failure = error.get_first_failure()
    code = failure.exitcode
    if code not in SAID:
        how = f"died of {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
        print(f"launch.py: {error.name}: rank {rank} {how} (its output is above)", file=sys.stderr, flush=True)
    return code if code > 0 else 1


def main() -> int:
    check_command(sys.argv[1:])
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    # torchrun sets 1 per worker, with a banner, where it is unset: the same value without it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_WorkersSaidWhy())
    # Set before torchrun starts its workers; torchrun (re)sets handlers only for the signals it knows.
    signal.signal(signal.SIGUSR1, _stop)
    try:
        torchrun(sys.argv[1:])
    except SignalException as stop:
        code = EXIT_STOPPED if _usr1_received else 128 + stop.sigval
        print(f"launch.py: {stop.sigval.name}: the workers were asked to checkpoint their step and stop; continue "
              f"with the same command and --resume auto (exit code {code})", file=sys.stderr, flush=True)
        return code
    except ChildFailedError as error:  # torchrun's report of the failed ranks: said above, or in one line here
        return _failed(error)
    return 0


if __name__ == "__main__":
    run_cli(main)
