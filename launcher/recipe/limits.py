"""What a recipe may be (its size, nesting, value count and the problems listed at once), and how a field's
path is written: shared by the loader and the error reporter."""

MAX_BYTES = 1 << 20  # a recipe is a page of YAML; 1 MiB leaves room for long env or setup lists
MAX_DEPTH = 32
MAX_VALUES = 20_000
MAX_PROBLEMS = 20  # listed; the rest are counted
MAX_OVERRIDE_BYTES = 64 * 1024

Path_ = tuple  # a field path, e.g. ("training", "steps") or ("env", "X") or ("secrets", 0)


def dotted(path: Path_) -> str:
    return ".".join(str(p) for p in path) or "(top level)"
