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


# ------------------------------------------------------------- penalties, min_p, min_tokens
def _seq(params: SamplingParams, prompt: list[int], output: list[int], eos: frozenset[int] = frozenset()):
    seq = seq_with("pen", params)
    seq.prompt_token_ids = list(prompt)
    seq.output_token_ids = list(output)
    seq.eos_token_ids = eos
    return seq


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, -1.0, 1.9   # 3 seen in the prompt, 4 in the output
    seq = _seq(SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=2.0), [3, 7], [4])
    assert Sampler().sample(logits, [seq]).tokens == [5]          # 2.0 / 2 = 1.0 < 1.9
    plain = _seq(SamplingParams(max_tokens=4, temperature=0.0), [3, 7], [4])
    assert Sampler().sample(logits, [plain]).tokens == [3]        # the penalty is what changed it


def test_frequency_and_presence_penalties_subtract_per_output_occurrence() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 8], logits[0, 9] = 3.0, 1.5
    params = SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.6,
                            logprobs=1)
    # token 8 occurred twice in the output: 3.0 - 2 * 0.5 - 0.6 = 1.4 < 1.5
    result = Sampler().sample(logits, [_seq(params, [8, 8, 8], [8, 8])])
    assert result.tokens == [9]
    lp = torch.log_softmax(torch.cat([logits[0, :8], torch.tensor([1.4]), logits[0, 9:]]), dim=-1)
    assert result.logprobs[0][9] == pytest.approx(float(lp[9]), abs=1e-5)   # logprobs of the adjusted row
    # prompt occurrences do not count for these two (OpenAI's definition)
    assert Sampler().sample(logits, [_seq(params, [8, 8, 8], [])]).tokens == [8]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 2], logits[0, 6] = 5.0, 4.0, 1.0      # 1 is EOS, 2 a stop token id
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, stop_token_ids=(2,))
    assert Sampler().sample(logits, [_seq(params, [10], [6, 6], eos=frozenset({1}))]).tokens == [6]
    assert Sampler().sample(logits, [_seq(params, [10], [6, 6, 6], eos=frozenset({1}))]).tokens == [1]
    ignore = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler().sample(logits, [_seq(ignore, [10], [], eos=frozenset({1}))]).tokens == [1]


def test_min_p_drops_tokens_below_its_share_of_the_top_probability() -> None:
    logits = torch.full((1, VOCAB), -20.0)
    logits[0, 11], logits[0, 12], logits[0, 13] = 2.0, 1.9, -1.0   # p(13) is ~0.05 of p(11)
    params = SamplingParams(max_tokens=4, temperature=1.0, min_p=0.2)
    drawn = {Sampler(seed=s).sample(logits, [_seq(params, [1], [])]).tokens[0] for s in range(40)}
    assert drawn <= {11, 12} and len(drawn) == 2
    loose = SamplingParams(max_tokens=4, temperature=1.0, seed=None)
    seen = set()
    sampler = Sampler(seed=0)
    for _ in range(400):
        seen.add(sampler.sample(logits, [_seq(loose, [1], [])]).tokens[0])
    assert 13 in seen                                              # without min_p it does get drawn


def test_logit_bias_is_added_to_the_named_tokens_before_the_choice() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 20], logits[0, 21] = 3.0, 1.0
    assert Sampler().sample(logits, [_seq(SamplingParams(max_tokens=4, temperature=0.0,
                                                         logit_bias={21: 2.5}), [1], [])]).tokens == [21]
    banned = SamplingParams(max_tokens=4, temperature=1.0, logit_bias={20: -100.0, 21: -100.0})
    drawn = {Sampler(seed=s).sample(logits, [_seq(banned, [1], [])]).tokens[0] for s in range(60)}
    assert drawn.isdisjoint({20, 21}) and len(drawn) > 5
    params = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={20: -1.0}, logprobs=0)
    result = Sampler().sample(logits, [_seq(params, [1], [])])
    adjusted = logits[0].clone()
    adjusted[20] -= 1.0
    assert result.tokens == [20]
    assert result.logprobs[0][20] == pytest.approx(float(torch.log_softmax(adjusted, -1)[20]), abs=1e-5)
    for bad in ({-1: 1.0}, {3: 101.0}, {3: float("nan")}, {i: 1.0 for i in range(301)}):
        with pytest.raises(Exception, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_bad_words_ban_the_last_token_after_the_rest_of_the_word() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 30], logits[0, 31] = 5.0, 4.0
    params = SamplingParams(max_tokens=8, temperature=0.0, bad_words=[(7, 30), (31,)])
    assert Sampler().sample(logits, [_seq(params, [1], [5])]).tokens == [30]     # output does not end in 7
    assert Sampler().sample(logits, [_seq(params, [1], [5, 7])]).tokens != [30]  # ...now it does: 30 banned
    assert Sampler().sample(logits, [_seq(params, [1], [5, 7])]).tokens != [31]  # a one-token word: always
    # an earlier attempt's output counts (a migrated request)
    migrated = SamplingParams(max_tokens=8, temperature=0.0, bad_words=[(7, 30)], prior_output=(7,))
    assert Sampler().sample(logits, [_seq(migrated, [1, 7], [])]).tokens == [31]
    for bad in ([()], [(1,) * 33], [(-1,)]):
        with pytest.raises(Exception, match="bad_words"):
            SamplingParams(bad_words=bad)
