"""A stand-in peer of `bench compare` that is not installed: it needs a module nowhere to be found."""

REQUIRES = ("json", "baige_stand_in_no_such_module")


def formats(variants):
    raise AssertionError("formats of a peer that is not installed")


def open_row(model_dir, fmt, cache, threads, options):
    raise AssertionError("open_row of a peer that is not installed")
