"""A request that goes on after some output on another worker (a retry after a loss, a live
migration): the prompt grows by that output, the budgets shrink by it, the penalties, seeds and
grammar see it as ``prior_output``, and the prompt's logprobs are not asked again once sent."""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams, continuation


def test_continuation_after_some_output_carries_it_and_shrinks_the_budgets() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=3, prompt_logprobs=2, prior_output=(7,))
    prompt, after = continuation([1, 2], params, [5, 6], prompt_logprobs_sent=True)
    assert prompt == [1, 2, 5, 6]
    assert (after.max_tokens, after.min_tokens) == (8, 1)
    assert after.prior_output == (7, 5, 6)
    assert after.prompt_logprobs is None
    assert params.max_tokens == 10 and params.prior_output == (7,)   # the original is untouched


def test_continuation_keeps_prompt_logprobs_until_sent_and_floors_min_tokens() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=1, prompt_logprobs=2)
    prompt, first = continuation((1, 2), params, [], prompt_logprobs_sent=False)
    assert prompt == [1, 2] and first == params
    _, later = continuation((1, 2), params, [4, 4, 4], prompt_logprobs_sent=False)
    assert later.min_tokens == 0 and later.max_tokens == 7 and later.prompt_logprobs == 2
