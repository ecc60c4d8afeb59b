#!/usr/bin/env bash
# `make demo`: a first run, with only what it needs. Installs torch's CPU build, then dtlaunch with its
# [train] extra (no SLURM, SkyPilot, DeepSpeed or Hugging Face packages) into the venv, then plans and renders
# the 70B recipe and trains the tiny one here (2 CPU ranks), resuming it. Each step is numbered and timed.
#
# The venv is `make install`'s own: this install leaves a stamp of its own (VENV/.installed-demo), so a later
# `make install` adds the rest into the same venv rather than starting over. Where either stamp is newer than
# pyproject.toml and constraints.txt, nothing is installed.
#
# Usage: scripts/demo.sh   (from the repository's root; `make demo` runs it)
# Env:   VENV         the venv (default .venv)
#        TORCH_INDEX  a package index to take torch from, e.g. https://download.pytorch.org/whl/cpu where the
#                     default index serves torch's CUDA build (several GB) for this platform
set -euo pipefail

VENV=${VENV:-.venv}
TORCH_INDEX=${TORCH_INDEX:-}
PY=$VENV/bin/python
DTLAUNCH=$VENV/bin/dtlaunch
STEPS=4
START=$SECONDS
STEP_START=$SECONDS
STEP=0

step() {  # step "what": ends the previous step with its time, and numbers this one
    done_step
    STEP=$((STEP + 1))
    STEP_START=$SECONDS
    echo "[$STEP/$STEPS] $1 ..."
}

skipped() {  # skipped "what": a numbered step with nothing to do
    done_step
    STEP=$((STEP + 1))
    STEP_START=
    echo "[$STEP/$STEPS] $1: already installed in $VENV (skipped)"
}

done_step() {
    if ((STEP > 0)) && [[ -n $STEP_START ]]; then
        echo "      done in $((SECONDS - STEP_START)) s"
    fi
}

fresh() {  # fresh STAMP: the stamp exists and is newer than what the install reads
    [[ -e $1 && $1 -nt pyproject.toml && $1 -nt constraints.txt ]]
}

if fresh "$VENV/.installed" || fresh "$VENV/.installed-demo"; then
    skipped "torch (CPU)"
    skipped "dtlaunch (core + train)"
else
    step "installing torch (CPU) into $VENV (torch==2.13.0)"
    [[ -x $PY ]] || python3 -m venv "$VENV"
    # torch first, as `make install` does: a bare `torch` would pull the multi-GB CUDA build. pip's
    # byte-compiling stays on: --no-compile saved ~30 s of install on 2 cores but cost ~60 s in the training
    # step where PYTHONDONTWRITEBYTECODE=1 is set (every process compiles torch's modules again).
    torch_index=()
    [[ -z $TORCH_INDEX ]] || torch_index=(--index-url "$TORCH_INDEX")
    "$PY" -m pip install -q -c constraints.txt "${torch_index[@]}" torch==2.13.0
    step "installing dtlaunch (core + train: click, PyYAML, msgspec, pydantic, rich, Jinja2, safetensors, matplotlib, psutil, py-spy)"
    "$PY" -m pip install -q -c constraints.txt -e '.[train]'
    touch "$VENV/.installed-demo"
fi

step "plan and render: Llama 3 70B on 8 nodes x 8 H100"
"$DTLAUNCH" plan recipes/llama70b.yaml
echo "== render: the SLURM job script and the SkyPilot task for it (neither needs SLURM or SkyPilot installed)"
"$DTLAUNCH" render recipes/llama70b.yaml --target slurm -o rendered/llama70b-slurm
"$DTLAUNCH" render recipes/llama70b.yaml --target sky -o rendered/llama70b-sky

step "up: train recipes/tiny.yaml on this machine (2 CPU ranks, torchrun), then resume it"
# runs/demo, not the recipe's own runs/tiny, and a job named demo: the README's first run then starts fresh, and
# its `dtlaunch logs tiny` names one job. --fresh: a demo run again starts over, its previous run's files kept
# under runs/demo/previous/.
"$DTLAUNCH" up recipes/tiny.yaml --target local -o runs/demo --fresh --set name=demo --set training.steps=20
echo "== up again with more steps: resumes from the step-20 checkpoint"
"$DTLAUNCH" up recipes/tiny.yaml --target local -o runs/demo --set name=demo --set training.steps=30
"$DTLAUNCH" status
"$DTLAUNCH" plot runs/demo
done_step
echo "demo done in $((SECONDS - START)) s. SLURM, SkyPilot, DeepSpeed and Hugging Face support: \`make install\` adds"
echo "them (and the dev tools) to $VENV; README.md lists each extra."
