"""vLLM's own `LLM.generate` on the same requests, in a process of its own (the proof test's
reference): `python -m tests.vllm.reference IN.json OUT.json`.

IN: {"model": DIR, "requests": [{"prompt": [...], "params": {...}, "lora": NAME}], "gaps": [...],
"tokenizer": bool (load the model's tokenizer: structured output needs it),
"lora": {"modules": {NAME: DIR}, "max_loras": N, "max_lora_rank": R}} ("lora" optional: with
it vLLM runs with LoRA enabled and each request's adapter as its LoRARequest; the base requests
go in a generate call of their own: vLLM 0.32's CPU LoRA kernels give a base request batched
with adapter requests the last adapter slot's weights, kvsched/worker_vllm/lora.py). OUT: each
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
    lora = job.get("lora") or {}
    lora_args = {}
    if lora:
        lora_args = {
            "enable_lora": True,
            "max_loras": lora["max_loras"],
            "max_cpu_loras": max(lora["max_loras"], len(lora["modules"])),
            "max_lora_rank": lora["max_lora_rank"],
        }
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
        **lora_args,
    )
    out: dict[str, object] = {}
    if job.get("requests"):
        params = [_params(SamplingParams, r["params"]) for r in job["requests"]]
        prompts = [{"prompt_token_ids": r["prompt"]} for r in job["requests"]]
        loras = _lora_requests(lora, job["requests"]) if lora else [None] * len(prompts)
        outputs: list[list[int]] = [[] for _ in prompts]
        # Log-probabilities of the requests that asked: per position the token's value and rank
        # and the top k ({id: logprob}); the prompt's first position None.
        rows: list[object] = [None for _ in prompts]
        for batch in (  # base requests apart from adapter requests (see the docstring)
            [i for i, lr in enumerate(loras) if lr is None],
            [i for i, lr in enumerate(loras) if lr is not None],
        ):
            if not batch:
                continue
            results = llm.generate(
                [prompts[i] for i in batch],
                [params[i] for i in batch],
                use_tqdm=False,
                lora_request=[loras[i] for i in batch] if lora else None,
            )
            for i, res in zip(batch, results, strict=True):
                r = job["requests"][i]
                outputs[i] = list(res.outputs[0].token_ids)
                rows[i] = {
                    "prompt": _rows(
                        res.prompt_logprobs, r["prompt"], r["params"].get("prompt_logprobs")
                    ),
                    "output": _rows(
                        res.outputs[0].logprobs,
                        res.outputs[0].token_ids,
                        r["params"].get("logprobs"),
                    ),
                }
        out["outputs"] = outputs
        out["logprobs"] = rows
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


def _lora_requests(lora: dict, requests: list[dict]) -> list:  # type: ignore[type-arg]
    """Each request's LoRARequest (None: the base model), ids as vLLM's server numbers
    --lora-modules: 1, 2, ... in the order given."""
    from vllm.lora.request import LoRARequest

    by_name = {
        name: LoRARequest(name, i, path)
        for i, (name, path) in enumerate(lora["modules"].items(), start=1)
    }
    return [by_name[r["lora"]] if r.get("lora") else None for r in requests]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
