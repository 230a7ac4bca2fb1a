"""cnr.bench.spans: exclusive seconds per phase of named functions, put back on exit."""

from __future__ import annotations

import threading
import time

import pytest

from cnr.bench.spans import Spans

INNER_S, OUTER_S = 0.2, 0.02


def inner() -> str:
    time.sleep(INNER_S)
    return "inner"


def outer() -> str:
    time.sleep(OUTER_S)
    return inner() + "+outer"  # looked up at call time, as restore() looks up what it calls


class Holder:
    def method(self, x: int) -> int:
        return x + 1


def test_phases_are_exclusive_and_the_functions_come_back():
    before = (outer, inner, Holder.__dict__["method"])
    phases = {"outer": [f"{__name__}:outer"], "inner": [f"{__name__}:inner"], "method": [f"{__name__}:Holder.method"]}
    with Spans(phases) as spans:
        start = time.perf_counter()
        assert globals()["outer"]() == "inner+outer"
        total = time.perf_counter() - start
        assert Holder().method(1) == 2  # a method wrapped on its class still binds self
        seconds, calls = spans.take()
        assert calls == {"outer": 1, "inner": 1, "method": 1}
        # the inner call's time is the inner phase's only: the phases add up to the call
        assert seconds["inner"] >= INNER_S and OUTER_S <= seconds["outer"] < INNER_S
        assert seconds["outer"] + seconds["inner"] == pytest.approx(total, abs=0.01)
        assert spans.take() == ({"outer": 0.0, "inner": 0.0, "method": 0.0}, {"outer": 0, "inner": 0, "method": 0})
    assert (outer, inner, Holder.__dict__["method"]) == before


def test_calls_on_other_threads_pass_through_untimed():
    with Spans({"inner": [f"{__name__}:inner"]}) as spans:
        thread = threading.Thread(target=lambda: globals()["inner"]())
        thread.start()
        thread.join()
        assert spans.take() == ({"inner": 0.0}, {"inner": 0})


@pytest.mark.parametrize("target,message", [
    ("no_colon", "is not allowed; give 'module:function'"),
    (f"{__name__}:INNER_S", "is not a plain function"),
    (f"{__name__}:missing", "is not a plain function"),
])
def test_a_bad_target_is_refused_and_nothing_stays_wrapped(target, message):
    with pytest.raises(ValueError, match=message):
        with Spans({"inner": [f"{__name__}:inner"], "bad": [target]}):
            pass
    assert globals()["inner"] is inner
