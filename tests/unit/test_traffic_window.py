"""The planner's capacity model input: the window of ended requests, and the targets it gives."""

from __future__ import annotations

from pdserve.capacity.profile import EngineProfile, Profile, TransferProfile
from pdserve.capacity.traffic_window import MIN_REQUESTS, CapacityModel, TrafficWindow
from pdserve.engine.contract import RequestPhase, RequestRecord


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def record(prompt: int, cached: int, out: int, priority: str = "interactive", ran: bool = True) -> RequestRecord:
    phase = RequestPhase(prompt_tokens=prompt, cached_prompt_tokens=cached, output_tokens=out) if ran else None
    return RequestRecord("r", "", "openai", "stop", priority=priority, phase=phase)


def test_the_window_summarises_what_ended_in_it_and_forgets_the_rest() -> None:
    clock = Clock()
    w = TrafficWindow(60.0, clock)
    for i in range(MIN_REQUESTS - 1):
        clock.t = float(i)
        w.request_ended(record(100, 50, 20))
    assert w.observed() is None                      # too few to say
    w.request_ended(record(0, 0, 0, ran=False))      # refused: never ran
    w.request_ended(record(300, 0, 60, priority="batch"))
    clock.t = 10.0
    w.request_ended(record(300, 0, 60))
    seen = w.observed()
    assert seen.requests == MIN_REQUESTS and abs(seen.rate - MIN_REQUESTS / 10.0) < 1e-9
    assert seen.prompt_mean == (4 * 100 + 300) / 5 and seen.output_mean == (4 * 20 + 60) / 5
    assert abs(seen.prefix_share - 200 / 700) < 1e-9
    clock.t = 65.0                                   # the first four fell out of the window
    assert w.observed() is None


def test_targets_follow_the_observed_rate() -> None:
    e = EngineProfile(1, [16, 512], [0.01, 0.2], [1, 32], [0.02, 0.05], 64)
    prof = Profile(host={}, model={"name": "m", "kv_bytes_per_token": 1000},
                   engine={"block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 512, "num_kv_blocks": 10_000},
                   engines={"1": e}, roles={"prefill": 1, "decode": 1, "colocated": 1}, transfer=TransferProfile(0, 1e9))
    model = CapacityModel(prof, ttft_s=1.0, itl_s=0.1, colocated=False)
    clock = Clock()
    w = TrafficWindow(100.0, clock)
    for i in range(100):
        clock.t = i * 0.1                            # 10 requests/s
        w.request_ended(record(128, 0, 64))
    low = model.targets(w.observed())
    for i in range(400):
        clock.t = 10 + i * 0.025                     # then 40 requests/s
        w.request_ended(record(128, 0, 64))
    high = model.targets(w.observed())
    assert high.decode > low.decode >= 1 and high.prefill >= low.prefill >= 1
    assert "requests/s" in high.explanation and "decode" in high.explanation
