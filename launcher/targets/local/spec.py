"""The recipe's `targets.local` section: how the local target restarts and where its runs go."""

from ...recipe.fields import Int, Spec, Str


class LocalTarget(Spec, kw_only=True):
    max_restarts: Int(0, 1000) = 3
    run_dir: Str = "runs"
