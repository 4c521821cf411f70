"""Each long-input scenario sized once per process against the server's context, and one that cannot fit said once.

Why apart from the session: sizing reads only the server's max_model_len, a token counter and where to say a
misfit; the session hands over those three (as callables: a worker learns max_model_len only when it joins the
master's run, and the events log is the run's, opened later) instead of itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from k3load.events import Event
from k3load.rundir import JsonlLog
from k3load.workload.long_input import LongInputFit, fit_long_input
from k3load.workload.scenario import Scenario

log = logging.getLogger("k3load")
UNSAID_CONTEXT = 4096  # the size played where the server does not say its max_model_len


class LongInputs:
    """`max_model_len()`: the server's context (None: unsaid); `counter(scenario)`: a token count for its texts;
    `events()`: the run's log (None: none open)."""

    def __init__(self, max_model_len: Callable[[], int | None], counter: Callable[[Scenario], Callable[[str], int]],
                 events: Callable[[], JsonlLog | None]) -> None:
        self.max_model_len, self.counter, self.events = max_model_len, counter, events
        self._fits: dict[str, LongInputFit] = {}

    def document(self, scenario: Scenario) -> str | None:
        """The reference document a long-input scenario carries (None for other scenarios)."""
        return self._fit(scenario).document if scenario.long_input else None

    def fits(self, scenario: Scenario) -> bool:
        """False for a long-input scenario that cannot fit the server's context at all (unknown when the
        server does not say its max_model_len: then it is played, sized for 4,096 tokens, as before)."""
        return not scenario.long_input or self._fit(scenario).fits or not self.max_model_len()

    def _fit(self, scenario: Scenario) -> LongInputFit:
        """Sized once per process; a scenario that cannot fit is said once (`long_input_unfit`)."""
        if scenario.name not in self._fits:
            context = self.max_model_len()
            fit = fit_long_input(scenario, context or UNSAID_CONTEXT, self.counter(scenario))
            self._fits[scenario.name] = fit
            if not fit.fits and context:
                self._say_unfit(fit)
        return self._fits[scenario.name]

    def _say_unfit(self, fit: LongInputFit) -> None:
        log.warning("k3load: long-input scenario %s does not fit: its fixed part (%d tokens) and answer budget "
                    "(%d) exceed the server's max_model_len %d; none of its requests are sent", fit.scenario,
                    fit.fixed_tokens, fit.max_tokens, fit.max_model_len)
        events = self.events()
        if events is not None:
            events.event(Event.LONG_INPUT_UNFIT, scenario=fit.scenario, fixed_tokens=fit.fixed_tokens,
                         max_tokens=fit.max_tokens, max_model_len=fit.max_model_len)
