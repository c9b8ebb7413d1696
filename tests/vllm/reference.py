"""vLLM's own `LLM.generate` on the same requests, in a process of its own (the proof test's
reference): `python -m tests.vllm.reference IN.json OUT.json`.

IN: {"model": DIR, "requests": [{"prompt": [...], "params": {...}}], "gaps": [...],
"tokenizer": bool (load the model's tokenizer: structured output needs it)}. OUT: each
request's output token ids; for each entry of "gaps" ({"prompt": prompt + the common output
prefix, "tokens": [a, b]}) the two tokens' logprobs at the next position (raw logits:
the logprob gap equals the logit gap) and the top token's.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _params(cls: Any, params: dict[str, Any]) -> Any:
    """vLLM's SamplingParams; a "structured_outputs" dict becomes StructuredOutputsParams."""
    from vllm.sampling_params import StructuredOutputsParams

    params = dict(params)
    if "structured_outputs" in params:
        params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
    return cls(detokenize=False, **params)


def main(path_in: str, path_out: str) -> None:
    from vllm import LLM, SamplingParams

    with open(path_in) as f:
        job = json.load(f)
    vocab = int(job.get("vocab_size", 512))
    llm = LLM(
        job["model"],
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        enforce_eager=True,
        skip_tokenizer_init=not job.get("tokenizer"),  # structured output needs it
        max_logprobs=vocab,
        # Whole prompts in one step: vLLM CPU's own chunked prefill fails on a seeded request
        # ("CPU Generator does not use offset" when it rewinds the generator of a partial one).
        max_num_batched_tokens=16384,
        seed=0,
    )
    out: dict[str, object] = {}
    if job.get("requests"):
        params = [_params(SamplingParams, r["params"]) for r in job["requests"]]
        prompts = [{"prompt_token_ids": r["prompt"]} for r in job["requests"]]
        results = llm.generate(prompts, params, use_tqdm=False)
        out["outputs"] = [list(r.outputs[0].token_ids) for r in results]
        # Log-probabilities of the requests that asked: per position the token's value and rank
        # and the top k ({id: logprob}); the prompt's first position None.
        out["logprobs"] = [
            {
                "prompt": _rows(
                    res.prompt_logprobs, r["prompt"], r["params"].get("prompt_logprobs")
                ),
                "output": _rows(
                    res.outputs[0].logprobs, res.outputs[0].token_ids, r["params"].get("logprobs")
                ),
            }
            for r, res in zip(job["requests"], results, strict=True)
        ]
    if job.get("gaps"):
        one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=vocab, detokenize=False)
        results = llm.generate(
            [{"prompt_token_ids": g["prompt"]} for g in job["gaps"]], one, use_tqdm=False
        )
        gaps = []
        for g, r in zip(job["gaps"], results, strict=True):
            lps = r.outputs[0].logprobs[0]
            a, b = g["tokens"]
            top = max(lps.values(), key=lambda lp: lp.logprob).logprob
            gaps.append(
                {
                    "a": lps[a].logprob,
                    "b": lps[b].logprob,
                    "top": top,
                    "gap": abs(lps[a].logprob - lps[b].logprob),
                }
            )
        out["gaps"] = gaps
    with open(path_out, "w") as f:
        json.dump(out, f)


def _rows(entries: object, ids: list[int], k: int | None) -> list[object] | None:
    if k is None or entries is None:
        return None
    out: list[object] = []
    for e, t in zip(entries, ids, strict=False):  # type: ignore[call-overload]
        if e is None:
            out.append(None)
            continue
        top = {str(i): lp.logprob for i, lp in e.items() if 1 <= lp.rank <= k}
        out.append({"logprob": e[t].logprob, "rank": e[t].rank, "top": top})
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
