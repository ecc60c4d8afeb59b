"""The trace beside the plan: the tracker's categories grouped into the planner's terms, extrapolated from
shallow models to the recipe's depth, moment by moment. Pure: no torch.

Why extrapolation is exact: at a fixed moment of the step every tracked tensor is either per layer (a layer's
weights and states, a layer's activations) or independent of the depth (embedding, head, loss, the buffers of
one or two units), so each moment's memory is affine in the number of layers. Two depths give the line; a
third checks it. The peak is then taken over the extrapolated moments, since which moment peaks can change
with depth (the layers' activations grow, the loss does not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Tracker category -> planner term. The tracker's Activation/Temp/Inputs are split between the layers' term
# (the slope of the fit, x layers) and the constant loss/backward term (its intercept) by extrapolation.
CATEGORY_TERMS = {
    "Sharded Param": "params",
    "Parameter": "params",
    "Buffer": "params",
    "Sharded Grad": "grads",
    "Gradient": "grads",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Unsharded Param": "buffers",
    "Unsharded Grad": "buffers",
    "All Gather": "buffers",
    "Reduce Scatter": "buffers",
    "Other": "buffers",
    "Activation": "acts",
    "Temp": "acts",
    "Inputs": "acts",
}
# The rows compared, and which planner terms make each one.
ROWS = {
    "params": ("params",),
    "grads": ("grads",),
    "optimizer": ("optimizer",),
    "activations": ("activations",),
    "loss & layer in backward": ("loss", "backward"),
    "buffers": ("buffers",),
}
WARN_RATIO = 0.10  # a term more than this far from the trace is flagged...
WARN_SHARE = 0.05  # ...when it is at least this share of the total
LINEARITY_TOLERANCE = 0.01  # the third depth must fall this close to the line


def group(categories: dict[str, int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for cat, v in categories.items():
        if cat == "Total":
            continue
        term = CATEGORY_TERMS.get(cat, "buffers")
        out[term] = out.get(term, 0.0) + v
    return out


@dataclass
class Point:
    """One traced depth: moment -> tracker categories at that moment's own peak."""

    layers: int
    moments: dict[str, dict[str, int]]
    seconds: float
    collectives: dict[str, int] = field(default_factory=dict)  # "phase|kind|ranks" -> calls (trace.fake)


@dataclass
class TracedStep:
    """The trace at the recipe's depth: moment -> term -> bytes (activations = the layers' slope x layers,
    `loss & layer in backward` = the rest of the activations), and the linearity check."""

    layers: int
    moments: dict[str, dict[str, float]]
    depths: list[int]
    seconds: float
    linearity: float | None  # worst relative miss of the third depth's moment totals; None without one
    exact: bool  # traced at the full depth, no extrapolation
    collectives: dict[str, int] = field(default_factory=dict)  # "phase|kind|ranks" -> calls at `layers`

    @property
    def totals(self) -> dict[str, float]:
        return {m: sum(t.values()) for m, t in self.moments.items()}

    @property
    def peak_at(self) -> str:
        totals = self.totals
        return max(totals, key=totals.__getitem__)


def _split(grouped: dict[str, float], act_slope: float, layers: int) -> dict[str, float]:
    acts = grouped.pop("acts", 0.0)
    per_layer = act_slope * layers
    return {**grouped, "activations": per_layer, "loss & layer in backward": acts - per_layer}


def extrapolate(points: list[Point], layers: int) -> TracedStep:
    """The step at `layers` from traces at two (or three, the last checking) depths, or one at full depth."""
    seconds = sum(p.seconds for p in points)
    if len(points) == 1 and points[0].layers == layers:
        p = points[0]
        moments = {m: _split(group(c), 0.0, layers) for m, c in p.moments.items()}
        for t in moments.values():  # no slope without a second depth: report the activations whole
            t["activations"], t["loss & layer in backward"] = t["loss & layer in backward"], 0.0
        return TracedStep(layers, moments, [p.layers], seconds, None, True, dict(p.collectives))
    a, b = points[0], points[1]
    span = b.layers - a.layers
    moments = {}
    for m in a.moments.keys() & b.moments.keys():
        ga, gb = group(a.moments[m]), group(b.moments[m])
        line = {
            k: ga.get(k, 0.0) + (gb.get(k, 0.0) - ga.get(k, 0.0)) * (layers - a.layers) / span
            for k in ga.keys() | gb.keys()
        }
        slope = (gb.get("acts", 0.0) - ga.get("acts", 0.0)) / span
        moments[m] = _split(line, slope, layers)
    linearity = None
    if len(points) > 2:
        c = points[2]
        worst = 0.0
        for m in moments.keys() & c.moments.keys():
            ta, tb = sum(a.moments[m].values()), sum(b.moments[m].values())
            predicted = ta + (tb - ta) * (c.layers - a.layers) / span
            measured = sum(c.moments[m].values())
            worst = max(worst, abs(predicted - measured) / max(measured, 1))
        linearity = worst
    # a collective is per layer or per step, as a tensor is: the count is affine in the depth too
    calls = {
        k: round(
            a.collectives.get(k, 0) + (b.collectives.get(k, 0) - a.collectives.get(k, 0)) * (layers - a.layers) / span
        )
        for k in a.collectives.keys() | b.collectives.keys()
    }
    return TracedStep(layers, moments, [p.layers for p in points], seconds, linearity, False, calls)


def per_step(collectives: dict[str, int], grad_accum: int) -> dict[tuple[str, int], int]:
    """(kind, ranks) -> calls in one optimizer step of `grad_accum` micro-steps, from a trace's counts by phase
    (every micro-step before the last alike, then the last, then the optimizer step)."""
    times = {"micro-step": grad_accum - 1, "last micro-step": 1, "optimizer step": 1}
    out: dict[tuple[str, int], int] = {}
    for key, n in collectives.items():
        phase, kind, ranks = key.split("|")
        out[(kind, int(ranks))] = out.get((kind, int(ranks)), 0) + n * times[phase]
    return {k: v for k, v in sorted(out.items()) if v}


@dataclass
class Row:
    term: str
    planned: float
    traced: float

    @property
    def ratio(self) -> float | None:
        return self.planned / self.traced if self.traced else None


def compare(planned: dict[str, float], traced: dict[str, float], exact_split: bool = True) -> list[Row]:
    """Rows of planner vs trace at one moment (planner terms from `plan.moments.timeline`)."""
    rows = []
    for row, terms in ROWS.items():
        p = sum(planned.get(t, 0.0) for t in terms)
        rows.append(Row(row, p, traced.get(row, 0.0)))
    if not exact_split:  # one depth: the trace cannot tell the layers from the rest; compare their sum
        acts = [r for r in rows if r.term in ("activations", "loss & layer in backward")]
        merged = Row("activations + loss", sum(r.planned for r in acts), sum(r.traced for r in acts))
        rows = [r for r in rows if r not in acts] + [merged]
    rows.append(Row("total", sum(r.planned for r in rows), sum(r.traced for r in rows)))
    return rows


def flagged(rows: list[Row]) -> list[Row]:
    """Rows off by more than WARN_RATIO that weigh at least WARN_SHARE of the traced total (and the total)."""
    total = next(r for r in rows if r.term == "total")
    out = []
    for r in rows:
        big = r.term == "total" or max(r.traced, r.planned) >= WARN_SHARE * total.traced
        if big and (r.ratio is None or abs(r.ratio - 1) > WARN_RATIO):
            out.append(r)
    return out


@dataclass
class Comparison:
    """The trace beside the plan: the rows at the traced peak, every moment's totals, and what to warn about."""

    peak_traced: str
    peak_planned: str
    rows: list[Row]
    moments: list[tuple[str, float, float]]  # (moment, planned tensors, traced tensors)
    context: float
    fragmentation: float  # the planner's fraction, applied to the traced peak
    gpu: float
    warnings: list[str]
    traced: TracedStep

    @property
    def traced_total(self) -> float:
        return next(r.traced for r in self.rows if r.term == "total")

    @property
    def projected(self) -> float:
        """What the trace says a GPU needs: its tensors plus the context and slack it cannot see."""
        return self.traced_total * (1 + self.fragmentation) + self.context

    @property
    def fits(self) -> bool:
        return self.projected <= self.gpu

    def to_dict(self) -> dict:
        return {
            "depths": self.traced.depths,
            "seconds": round(self.traced.seconds, 1),
            "linearity": self.traced.linearity,
            "peak_at": self.peak_traced,
            "planner_peak_at": self.peak_planned,
            "terms": {
                r.term: {
                    "planned": int(r.planned),
                    "traced": int(r.traced),
                    "ratio": None if r.ratio is None else round(r.ratio, 4),
                }
                for r in self.rows
            },
            "moments": {m: {"planned": int(p), "traced": int(t)} for m, p, t in self.moments},
            "projected_total": int(self.projected),
            "fits": self.fits,
            "warnings": list(self.warnings),
            "collectives": dict(self.traced.collectives),  # "phase|kind|ranks" -> calls, at the recipe's depth
        }


def compare_plan(
    planned: dict[str, dict[str, float]], traced: TracedStep, context: float, fragmentation: float, gpu: float
) -> Comparison:
    """`planned` is `launcher.plan.moments.timeline` for the plan; `traced` the extrapolated trace."""
    peak_t = traced.peak_at
    peak_p = max(planned, key=lambda m: sum(planned[m].values()))
    split = not traced.exact
    rows = compare(planned.get(peak_t, {}), traced.moments[peak_t], split)
    moments = [(m, sum(planned[m].values()), traced.totals[m]) for m in planned if m in traced.moments]
    warnings = []
    if peak_t != peak_p:
        warnings.append(f"the trace peaks at {peak_t}, the planner at {peak_p}")
    for r in flagged(rows):
        ratio = "no traced bytes" if r.ratio is None else f"planner/trace {r.ratio:.2f}"
        warnings.append(f"{r.term}: planned {r.planned / 1e9:.2f} GB, traced {r.traced / 1e9:.2f} GB ({ratio})")
    for m, p, t in moments:
        if t and abs(p / t - 1) > WARN_RATIO and m != peak_t:
            warnings.append(f"{m}: planned {p / 1e9:.2f} GB, traced {t / 1e9:.2f} GB (planner/trace {p / t:.2f})")
    if traced.linearity is not None and traced.linearity > LINEARITY_TOLERANCE:
        warnings.append(
            f"memory is not affine in depth here (depth {traced.depths[-1]} is {traced.linearity:.1%} "
            "off the line): the extrapolation is uncertain"
        )
    return Comparison(peak_t, peak_p, rows, moments, context, fragmentation, gpu, warnings, traced)
