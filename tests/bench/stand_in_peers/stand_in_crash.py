"""A stand-in peer of `bench compare` whose int8 row dies of SIGSEGV after printing a line (as a native
crash would), whose int4 row refuses the model, and whose int2 row runs without a batched API."""

import os
import signal
import sys

from stand_in_good import Runner

REQUIRES = ()


def formats(variants):
    return ("int8", "int4", "int2")


def open_row(model_dir, fmt, cache, threads, options):
    if fmt == "int8":
        print("stand-in: about to crash", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    if fmt == "int4":
        raise RuntimeError("the stand-in cannot convert this model\n(its last line)")
    (cache / "w").mkdir(parents=True, exist_ok=True)
    runner = Runner(cache / "w", fmt, threads)
    runner.batch = None
    return runner
