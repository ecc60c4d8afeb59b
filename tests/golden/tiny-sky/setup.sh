set -euo pipefail
# These VMs are this task's from here on (a fresh cluster runs setup first): the goodput ledger's allocation start
date +%s.%N > "$HOME"/.dtlaunch-allocation-start
# dtlaunch comes with the job: the wheel next to task.yaml was built from the installation that rendered
# it, so the node runs exactly the code that planned the job, and no package index is asked for dtlaunch.
pip install './dtlaunch-0.1.0-py3-none-any.whl[train]'
