"""Per-request sampling and stopping parameters, validated at the door."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.structured import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
# Ranges that keep sampling finite. ``logits / temperature`` overflows float32 (inf, then NaN in
# softmax) for tiny temperatures; vLLM clamps anything below 1e-2 to 1e-2, we refuse it instead
# (nothing silently changed): 1e-2 already makes any real logit gap decisive, so 0 (greedy) is
# the way to ask for "the most likely token". A top_p below 1e-6 becomes 0 in float32 and
# would filter out every token; any top_p <= 1/vocab keeps only the top token anyway.
MIN_TEMPERATURE = 1e-2
MIN_TOP_P = 1e-6
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_PENALTY = 2.0            # presence/frequency penalties, as OpenAI bounds them
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0       # OpenAI's range for each entry of logit_bias
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_BAD_WORDS = 64           # vLLM's bad_words: strings, each tokenized one or two ways
MAX_BAD_WORD_TOKENS = 32
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy, otherwise it is at least ``MIN_TEMPERATURE``.
    ``top_k == 0`` and ``top_p == 1`` disable those filters; ``top_p`` is at least ``MIN_TOP_P``.
    ``logprobs`` asks for the chosen token's log-probability plus that many top alternatives.
    ``prompt_logprobs`` (vLLM's) asks the same of every prompt token after the first; such a
    request does not read the prefix cache (a cached token has no logits), it computes its prompt.
    Penalties (applied to the logits before greedy or sampled choice, in this order):
    ``repetition_penalty`` (vLLM's: a logit of a token already in the prompt or the output is
    divided by it when positive, multiplied when negative; 1 = off), then ``frequency_penalty``
    times how often a token occurs in the output plus ``presence_penalty`` if it occurs at all
    (OpenAI's; subtracted, 0 = off). ``min_p`` drops tokens less likely than ``min_p`` times the
    most likely one (sampling only). ``min_tokens``: EOS and ``stop_token_ids`` cannot end the
    request before that many tokens (they are masked out of the choice until then).
    ``logit_bias``: (token id, bias) pairs added to those tokens' logits before the choice
    (OpenAI's; -100 to 100: -100 in effect bans a token, 100 all but forces it).
    ``allowed_token_ids`` (vLLM's): when set, only these tokens may be chosen.
    Text (vLLM's): ``skip_special_tokens`` leaves special tokens out of the text;
    ``include_stop_str_in_output`` keeps the stop string that ended the text in it.
    ``bad_words`` (vLLM's, as token sequences the router tokenized): a sequence's last token is
    banned whenever the output so far ends with the rest of it (a one-token word always).
    ``spaces_between_special_tokens`` (vLLM's): added-vocabulary tokens in the text are set
    apart from their neighbours by a space, as the slow tokenizers of transformers do.
    ``cache_salt`` (vLLM's): only requests with the same salt share prefix-cached KV blocks
    (the salt seeds the chain hash of the first block); not a sampling field, it travels with them.
    ``structured``: a grammar every sampled token must follow (``engine/structured.py``); the
    request ends with EOS once the grammar is complete.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = False
    bad_words: tuple[tuple[int, ...], ...] = ()
    cache_salt: str | None = None
    structured: StructuredOutput | None = None
    # Output tokens an earlier attempt of this request already produced (a migration re-prefills
    # them as part of the prompt): the penalties count them, seeded draws continue after them and
    # the grammar consumes them first. Set by the router, never by a client.
    prior_output: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Normalise list inputs to tuples so the object stays hashable and immutable.
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.prior_output, tuple):
            object.__setattr__(self, "prior_output", tuple(self.prior_output))
        if not isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if not isinstance(self.bad_words, tuple) or not all(isinstance(w, tuple) for w in self.bad_words):
            object.__setattr__(self, "bad_words", tuple(tuple(w) for w in self.bad_words))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        elif not isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in self.logit_bias))
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or ``min_tokens`` changes this request's logits before the choice."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_tokens > 0 or bool(self.logit_bias)
                or bool(self.allowed_token_ids) or bool(self.bad_words))

    def _validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise InvalidRequestError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or not (
                self.temperature == 0.0 or self.temperature >= MIN_TEMPERATURE):
            raise InvalidRequestError(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                f"got {self.temperature}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool):
            raise InvalidRequestError(f"top_p must be a number in [{MIN_TOP_P}, 1], got {self.top_p!r}")
        if not (MIN_TOP_P <= self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in [{MIN_TOP_P}, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not (SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(f"seed must fit in 64 bits ({SEED_MIN} to {SEED_MAX}), got {self.seed}")
        for tok in self.stop_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {tok!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"a stop string may be at most {MAX_STOP_STRING_CHARS} characters")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequestError(f"{name} must be a number between {-MAX_PENALTY} and {MAX_PENALTY}, "
                                          f"got {value!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not math.isfinite(rp) \
                or not 0.0 < rp <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(f"repetition_penalty must be greater than 0 and at most "
                                      f"{MAX_REPETITION_PENALTY} (1 = off), got {rp!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be a number between 0 and 1 (0 = off), got {self.min_p!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        for tok in self.allowed_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise InvalidRequestError(f"allowed_token_ids must be non-negative integers, got {tok!r}")
        if len(self.bad_words) > 2 * MAX_BAD_WORDS:
            raise InvalidRequestError(f"bad_words may hold at most {MAX_BAD_WORDS} words")
        for word in self.bad_words:
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in word):
                raise InvalidRequestError(f"each of bad_words must be 1-{MAX_BAD_WORD_TOKENS} token ids, got {word!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise InvalidRequestError(f"cache_salt must be a string of 1-{MAX_CACHE_SALT_CHARS} characters")
        for name in ("skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, "
                                      f"got {len(self.logit_bias)}")
        for pair in self.logit_bias:
            tok, bias = pair if len(pair) == 2 else (None, None)
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids (non-negative integers), got {tok!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                    or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias values must be numbers between {-MAX_LOGIT_BIAS:g} and "
                                          f"{MAX_LOGIT_BIAS:g}, got {bias!r} for token {tok}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise InvalidRequestError("structured must be a StructuredOutput")
            if self.ignore_eos:
                raise InvalidRequestError("ignore_eos cannot be combined with a structured output: the request "
                                          "ends with EOS when its grammar is complete")
            if self.min_tokens:
                raise InvalidRequestError("min_tokens cannot be combined with a structured output: the grammar "
                                          "decides where the output ends")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"prompt_logprobs must be an integer between 0 and {MAX_LOGPROBS}, "
                                      f"got {self.prompt_logprobs!r}")
        if self.logprobs is not None:
            if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int):
                raise InvalidRequestError(f"logprobs must be an integer, got {self.logprobs!r}")
            if not (0 <= self.logprobs <= MAX_LOGPROBS):
                raise InvalidRequestError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")


def continuation(prompt_token_ids: Sequence[int], params: SamplingParams, produced: Sequence[int], *,
                 prompt_logprobs_sent: bool) -> tuple[list[int], SamplingParams]:
    """The prompt and parameters that continue a request after ``produced``, output tokens the
    client already got, on another worker (a migration, or a retry after a worker was lost).

    The new prompt is the old one followed by ``produced`` (prefilled again, or its KV moved);
    ``max_tokens`` and ``min_tokens`` are what is left of the budgets; ``prior_output`` grows by
    ``produced``, so penalties, seeded draws and the grammar go on after them; and
    ``prompt_logprobs`` is dropped once ``prompt_logprobs_sent`` (the client has them with the
    first token)."""
    n = len(produced)
    new = replace(params, max_tokens=params.max_tokens - n, min_tokens=max(0, params.min_tokens - n),
                  prior_output=params.prior_output + tuple(produced),
                  prompt_logprobs=None if prompt_logprobs_sent else params.prompt_logprobs)
    return [*prompt_token_ids, *produced], new
