"""Exit codes of the entry points that job scripts and scripts/sweep.py act on (no torch import, so that
the sweep expands and checks YAML without loading torch)."""

# sysexits' EX_TEMPFAIL ("try again"): the run stopped on a signal after writing checkpoint.pt; the same command
# resumes. A finished run exits 0, an error 1 (also a stop request while the loss is above the divergence guard's
# threshold: no checkpoint is written then, and a requeue would repeat the same updates; engine/divergence.py).
EXIT_PREEMPTED = 75

# 128 + SIGINT, as a shell reports a process Ctrl-C ended: a second Ctrl-C stopped train.py at once, without the
# checkpoint the first asked for (engine/preemption.py SecondInterrupt); the same command resumes from the last one.
EXIT_INTERRUPTED = 130
