"""What the vLLM proof tests of the engine features share: vLLM's own `LLM.generate` run in a
process of its own (tests/vllm/reference.py), `kvsched worker --executor vllm` started as a user
would, and a daemon configured from a TOML file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.integration.harness import REPO, Proc, child_env, start_daemon

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def reference_outputs(
    model: Path,
    reqs: list[dict[str, Any]],
    tmp: Path,
    tokenizer: bool = False,
    lora: dict[str, Any] | None = None,
) -> list[list[int]]:
    """vLLM's own output token ids for each {"prompt", "params"[, "lora"]} (`tokenizer`: load
    the model's tokenizer, which structured outputs need; `lora`: {"modules": {name: dir},
    "max_loras", "max_lora_rank"} runs it with those adapters, reference.py)."""
    path_in, path_out = tmp / "ref_in.json", tmp / "ref_out.json"
    job: dict[str, Any] = {
        "model": str(model),
        "requests": [
            {"prompt": r["prompt"], "params": r["params"], "lora": r.get("lora", "")} for r in reqs
        ],
        "tokenizer": tokenizer,
    }
    if lora:
        job["lora"] = lora
    path_in.write_text(json.dumps(job))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm.reference", str(path_in), str(path_out)],
        cwd=REPO,
        env=child_env(VLLM_ENV),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    outputs: list[list[int]] = json.loads(path_out.read_text())["outputs"]
    return outputs


def daemon_with_config(toml: str, tmp: Path, *args: str) -> tuple[Proc, str]:
    path = tmp / "kvsched.toml"
    path.write_text(toml)
    return start_daemon("--config", str(path), *args)


def vllm_worker(address: str, instance: str, model: Path, num_blocks: int, *extra: str) -> Proc:
    """`kvsched worker --executor vllm` on the tiny model, float32."""
    return Proc(
        [
            "worker",
            "--server",
            address,
            "--instance",
            instance,
            "--executor",
            "vllm",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--num-blocks",
            str(num_blocks),
            "--max-model-len",
            "1024",
            "--num-slots",
            "16",
            "--max-num-batched-tokens",
            "512",
            *extra,
        ],
        env=VLLM_ENV,
        name=f"vllm-{instance}",
    )


def worker_kv_counts(worker: Proc) -> tuple[int, int, int]:
    """(pushes, failed pushes, pushes received) from the stats line a stopped worker logs."""
    m = worker.wait_for(r"KV pushes (\d+) \((\d+) failed\), received (\d+)", timeout=30)
    pushes, failed, received = (int(g) for g in m.groups())
    return pushes, failed, received
