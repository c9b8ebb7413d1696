"""vLLM's own `LLM.chat` on chat conversations, in a process of its own (the gateway test's
reference): `python -m tests.vllm.chat_reference IN.json OUT.json`.

IN: {"model": DIR, "chats": [[{"role": ..., "content": ...}, ...], ...], "max_tokens": N}.
OUT: {"texts": [...], "token_ids": [[...], ...]}: greedy, the model's own chat template and
tokenizer, as vLLM's server would answer them.
"""

from __future__ import annotations

import json
import sys


def main(path_in: str, path_out: str) -> None:
    from vllm import LLM, SamplingParams

    with open(path_in) as f:
        job = json.load(f)
    llm = LLM(
        job["model"],
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        enforce_eager=True,
        max_num_batched_tokens=16384,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]))
    results = llm.chat(job["chats"], params, use_tqdm=False)
    out = {
        "texts": [r.outputs[0].text for r in results],
        "token_ids": [list(r.outputs[0].token_ids) for r in results],
    }
    with open(path_out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
