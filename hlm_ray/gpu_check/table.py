"""The gpu-check results: one `Row` per check, a Markdown table per tier, and a JSON file.

    rows = [Row("losses", "PASS", "cwt |Δ| 2e-05", 1.2, tier="bare")]
    print(format_table(rows, "cuda:0 (NVIDIA H100)", versions()))
    write_results(rows, device, versions(), Path("runs/gpu-check"))  # gpu_check.md + .json

A verdict is PASS (measured and within its target), MISS (ran and failed, or raised) or SKIP
(not run: what it needs does not import here, or an earlier check it reads did not run).
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

VERDICTS = ("PASS", "MISS", "SKIP")


@dataclass
class Row:
    check: str
    verdict: str  # PASS | MISS | SKIP
    figures: str  # what was measured, or why it failed or was skipped
    seconds: float = 0.0
    tier: str = "bare"


def versions() -> dict[str, str]:
    """What the checks ran on: python, torch, CUDA, transformers, tokenizers, the GPU."""
    import tokenizers
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gpu": torch.cuda.get_device_name(0) if cuda else "none",
    }


def format_table(rows: list[Row], device: str, info: dict[str, str] | None = None) -> str:
    """Markdown: the device and versions, then one table per tier in the order rows came."""
    lines = [f"gpu-check on {device}"]
    if info:
        lines += ["", ", ".join(f"{k} {v}" for k, v in info.items())]
    tiers = list(dict.fromkeys(r.tier for r in rows))
    for tier in tiers:
        lines += ["", f"{tier} tier:", "", "| check | verdict | figures | s |", "|---|---|---|---|"]
        lines += [
            f"| {r.check} | {r.verdict} | {_cell(r.figures)} | {r.seconds:.0f} |"
            for r in rows
            if r.tier == tier
        ]
    return "\n".join(lines)


def write_results(rows: list[Row], device: str, info: dict[str, str], out: Path) -> str:
    """`<out>/gpu_check.md` (the table) and `<out>/gpu_check.json`; returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(rows, device, info)
    (out / "gpu_check.md").write_text(table + "\n")
    record = {"device": device, "versions": info, "rows": [asdict(r) for r in rows]}
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1) + "\n")
    return table


def exit_status(rows: list[Row]) -> int:
    """0 when nothing was a MISS (a SKIP is reported, not failed: a bare node has no Ray)."""
    return 0 if all(r.verdict != "MISS" for r in rows) else 1


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")
