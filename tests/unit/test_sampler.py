"""The sampler fails a row whose distribution is not valid, alone; the other rows sample as usual."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.errors import SamplingError
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from tests.factories import make_seq, make_unchecked_params

VOCAB = 50


def seq_with(request_id: str, params: SamplingParams):
    seq = make_seq(request_id)
    seq.params = params
    return seq


def test_unchecked_params_really_hold_the_refused_values() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=1e-300)
    assert make_unchecked_params(temperature=1e-300).temperature == 1e-300


def test_poisoned_rows_fail_alone_and_the_valid_rows_sample_as_without_them() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB) * 5
    logits[4, 7] = float("nan")  # a row whose logits went NaN (e.g. a numerical fault upstream)
    seqs = [
        seq_with("greedy", SamplingParams(temperature=0.0, logprobs=2)),
        seq_with("tiny-temperature", make_unchecked_params(temperature=1e-300)),
        seq_with("seeded", SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=5, logprobs=1)),
        seq_with("tiny-top-p", make_unchecked_params(temperature=1.0, top_p=1e-300)),
        seq_with("nan-logits", SamplingParams(temperature=0.0)),
        seq_with("greedy-2", SamplingParams(temperature=0.0)),
    ]
    result = Sampler(seed=1).sample(logits, seqs)

    assert sorted(result.failed) == [1, 3, 4]
    for i, words in ((1, "temperature=1e-300"), (3, "top_p=1e-300"), (4, "not finite")):
        err = result.failed[i]
        assert isinstance(err, SamplingError) and err.http_status == 400
        assert seqs[i].request_id in str(err) and words in str(err)
        assert result.logprobs[i] is None

    valid = [0, 2, 5]
    alone = Sampler(seed=1).sample(logits[valid], [seqs[i] for i in valid])
    assert alone.failed == {}
    assert [result.tokens[i] for i in valid] == alone.tokens
    assert [result.logprobs[i] for i in valid] == alone.logprobs
    assert result.tokens[0] == int(logits[0].argmax()) and result.tokens[5] == int(logits[5].argmax())
    assert set(result.logprobs[0]) >= {result.tokens[0]} and len(result.logprobs[0]) >= 2


def test_a_batch_of_only_poisoned_rows_reports_each_and_raises_nothing() -> None:
    logits = torch.full((2, VOCAB), float("nan"))
    seqs = [seq_with("a", SamplingParams(temperature=0.0)), seq_with("b", SamplingParams(temperature=1.0))]
    result = Sampler().sample(logits, seqs)
    assert sorted(result.failed) == [0, 1]


def test_all_greedy_valid_batch_matches_argmax() -> None:
    logits = torch.randn(3, VOCAB)
    seqs = [seq_with(f"g{i}", SamplingParams(temperature=0.0)) for i in range(3)]
    result = Sampler().sample(logits, seqs)
    assert result.failed == {} and result.tokens == logits.argmax(dim=-1).tolist()


def test_finite_rows_whose_sum_overflows_still_sample_and_inf_rows_fail() -> None:
    """The finite check sums each row first; a row of huge but finite logits overflows that sum and
    must still count as finite, while a row holding +inf or -inf fails."""
    logits = torch.zeros(3, VOCAB)
    logits[0, :] = 3e38            # finite, sum overflows to inf
    logits[0, 9] = 3.2e38          # the argmax
    logits[1, 3] = float("inf")
    logits[2, 4] = float("-inf")
    seqs = [seq_with(f"r{i}", SamplingParams(temperature=0.0)) for i in range(3)]
    result = Sampler().sample(logits, seqs)
    assert sorted(result.failed) == [1, 2]
    assert result.tokens[0] == 9
