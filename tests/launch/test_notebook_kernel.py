"""manygpu.notebook_launcher from a real notebook: a .ipynb run cell by cell in a Jupyter
kernel (nbclient + ipykernel), with functions defined in the notebook itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

CELLS = [
    "import os, time\nimport torch\nimport manygpu\nfrom manygpu import Parallel",
    # Functions defined in the notebook: they cannot be pickled, the workers are forked.
    """def train(n):
    with Parallel(strategy="ddp") as par:
        total = par.reduce(torch.tensor([float(par.rank + 1)]), "sum").item()
        return par.rank, par.world_size, total, n""",
    "print(manygpu.notebook_launcher(train, args=(7,), nproc=2))",
    """def boom():
    with Parallel(strategy="ddp") as par:
        if par.rank == 1:
            raise ValueError("boom from rank 1")
        par.reduce(torch.ones(1))  # rank 0 loses its peer: a consequence
manygpu.notebook_launcher(boom, nproc=2)""",
    """def sleeper(folder):
    with open(os.path.join(folder, f"pid{os.environ['RANK']}"), "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(600)
manygpu.notebook_launcher(sleeper, args=(FOLDER,), nproc=2)  # interrupted""",
    # Checked inside the kernel, still alive: its workers are gone, not merely orphaned.
    """import glob
alive = []
for name in sorted(glob.glob(os.path.join(FOLDER, "pid*"))):
    try:
        os.kill(int(open(name).read()), 0)
        alive.append(name)
    except ProcessLookupError:
        pass
print("after the interrupt:", len(glob.glob(os.path.join(FOLDER, "pid*"))), "workers,", alive)""",
]


def _outputs(cell: Any) -> tuple[str, list[tuple[str, str]]]:
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    errors = [(o.ename, o.evalue) for o in cell.outputs if o.output_type == "error"]
    return text, errors


def test_a_notebook_cell_runs_workers_returns_errors_and_stops_on_interrupt(
    tmp_path: Path,
) -> None:
    sources = [c.replace("FOLDER", repr(str(tmp_path))) for c in CELLS]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    for cell in nb.cells[3:5]:  # expected to raise: the run goes on
        cell.metadata["tags"] = ["raises-exception"]
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        interrupt_on_timeout=True,  # "interrupt the kernel" once the sleepers have started
        timeout_func=lambda cell: 10 if "sleeper" in cell.source else 120,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    text, errors = _outputs(nb.cells[2])
    assert "[(0, 2, 3.0, 7), (1, 2, 3.0, 7)]" in text and not errors, (text, errors)
    # One exception in the cell, naming the rank that failed on its own (not rank 0,
    # whose collective lost it), with the worker's traceback as its cause.
    _, errors = _outputs(nb.cells[3])
    assert errors == [
        ("LaunchError", "notebook_launcher: rank 1 failed: ValueError: boom from rank 1")
    ]
    cause = "".join(nb.cells[3].outputs[-1].traceback)
    assert "rank 1's traceback" in cause and 'raise ValueError("boom from rank 1")' in cause
    # Ctrl-C: KeyboardInterrupt in the cell, every worker gone, the kernel still usable.
    text, errors = _outputs(nb.cells[4])
    assert [e[0] for e in errors] == ["KeyboardInterrupt"], (text, errors)
    assert "manygpu: interrupted; stopped 2 workers" in text, text
    assert _outputs(nb.cells[5])[0] == "after the interrupt: 2 workers, []\n"
