"""Exit codes of the entry points that job scripts and scripts/sweep.py act on (no torch import, so that
the sweep expands and checks YAML without loading torch)."""

# sysexits' EX_TEMPFAIL ("try again"): the run stopped on a signal after writing checkpoint.pt (or, while its loss
# is above the divergence guard's threshold, keeping the last one written before); the same command resumes.
# A finished run exits 0, an error 1.
EXIT_PREEMPTED = 75
