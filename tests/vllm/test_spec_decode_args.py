"""`kvsched worker --draft-model`: the arguments it refuses before loading anything (exit 2, a
message naming the flag), and the draft model's proposals going into a decode's drafts
(`worker_vllm/spec_decode.py`, no vLLM needed). Runs in the main virtualenv too."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvsched import cli
from kvsched.core.protocol import SamplingParams
from kvsched.worker_stub.executor import SeqWork
from kvsched.worker_vllm import spec_decode


def _run(capsys: pytest.CaptureFixture[str], executor: str, *args: str) -> int:
    code = cli.main(["worker", "--server", "127.0.0.1:1", "--executor", executor, *args])
    capsys.readouterr()
    return code


@pytest.mark.parametrize("executor", ["sim", "model"])
def test_draft_model_is_refused_by_executors_that_run_none(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    executor: str,
) -> None:
    code = _run(capsys, executor, "--num-speculative-tokens", "3", "--draft-model", str(tmp_path))
    assert code == 2
    assert "--draft-model: only --executor vllm runs a draft model" in caplog.text


def test_draft_model_needs_drafts_per_step_and_a_directory(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    model = ("--model", str(tmp_path))
    assert _run(capsys, "vllm", *model, "--draft-model", str(tmp_path)) == 2
    assert "--draft-model needs --num-speculative-tokens K > 0" in caplog.text
    caplog.clear()
    absent = str(tmp_path / "absent")
    k = ("--num-speculative-tokens", "3")
    assert _run(capsys, "vllm", *model, *k, "--draft-model", absent) == 2
    assert f"--draft-model {absent!r} is not a directory" in caplog.text


def _decode(req_id: str, k: int) -> SeqWork:
    tokens = [7, *spec_decode.reserve([1, 7], k)]
    return SeqWork(1, req_id, [0], 10, tokens, True, k, SamplingParams(max_tokens=8))


def _chunk(req_id: str) -> SeqWork:  # a prompt chunk that does not end the prompt
    return SeqWork(1, req_id, [0], 0, [3, 4], False, 0, SamplingParams(max_tokens=8))


def test_vllm_speculative_config_names_the_draft_model() -> None:
    assert spec_decode.vllm_config(3) == {"method": "ngram", "num_speculative_tokens": 3}
    assert spec_decode.vllm_config(2, "/m/draft") == {
        "method": "draft_model",
        "model": "/m/draft",
        "num_speculative_tokens": 2,
    }


def test_proposals_fill_the_reserved_drafts_of_the_requests_that_sampled() -> None:
    model = spec_decode.ModelDrafts()
    taken = SimpleNamespace(
        req_ids=["a", "b", "a\x00chunk"], draft_token_ids=[[5, 6, 7], [8, 9, 10], [1, 1, 1]]
    )
    # the alias of a partial prefill did not sample: its proposal is not kept
    model.update(taken, [_decode("a", 3), _decode("b", 3), _chunk("a\x00chunk")])
    assert len(model) == 2
    drafts: dict[str, list[int]] = {}
    # "a" may take 2 drafts this step (block room): the first 2 of its proposal
    assert spec_decode.split(_decode("a", 2), drafts, model) == 1
    assert spec_decode.split(_decode("c", 3), drafts, model) == 1  # no proposal: placeholders
    assert drafts == {"a": [5, 6], "c": [spec_decode.PLACEHOLDER] * 3}
    assert model.num_filled == 2
    model.drop("a")  # released (finished, or preempted: a re-placement proposes anew)
    drafts.clear()
    spec_decode.split(_decode("a", 3), drafts, model)
    assert drafts == {"a": [spec_decode.PLACEHOLDER] * 3}
    model.update(None, [_decode("b", 3)])  # a step with no proposals keeps the last ones
    spec_decode.split(_decode("b", 3), drafts, model)
    assert drafts["b"] == [8, 9, 10]
    # Without a draft model nothing is proposed: the engine's own (ngram) drafts go through.
    ngram = SeqWork(1, "n", [0], 10, [7, 11, 12], True, 2, SamplingParams(max_tokens=8))
    spec_decode.split(ngram, drafts, spec_decode.ModelDrafts())
    assert drafts["n"] == [11, 12]


@pytest.mark.vllm  # (`make test-vllm` runs it; the main virtualenv skips it)
def test_a_step_with_a_random_sampling_request_verifies_no_drafts() -> None:
    sampling_params = pytest.importorskip("vllm.sampling_params", reason="needs vLLM")
    greedy = SimpleNamespace(params=sampling_params.SamplingParams(temperature=0.0))
    sampled = SimpleNamespace(params=sampling_params.SamplingParams(temperature=1.0, seed=1))
    work = [_decode("a", 3), _decode("b", 2)]
    assert not spec_decode.no_drafts_unless_greedy(work, {"a": greedy, "b": greedy})
    assert [(w.num_draft, len(w.token_ids)) for w in work] == [(3, 4), (2, 3)]
    work.append(_chunk("c"))  # a prompt chunk of a sampled request: no drafts for anyone
    assert spec_decode.no_drafts_unless_greedy(work, {"a": greedy, "b": greedy, "c": sampled})
    assert [(w.num_draft, w.token_ids) for w in work] == [(0, [7]), (0, [7]), (0, [3, 4])]
