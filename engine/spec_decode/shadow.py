"""Shadow drafts: n-gram acceptance measured on plain steps, without verifying anything.

For a point-mass draft `d` the rejection sampler accepts `d` with probability `p(d)`, and a plain
step emits `d` with the same probability `p(d)` (greedy: `d` is the argmax or it is not; sampled:
the same distribution, `engine.spec_decode.rejection_sampler`). So where a bucket runs plain, the
n-gram proposer is run anyway (a dict lookup per request) and its drafts are compared with the
tokens the plain steps then emit: draft `j` counts as accepted when it equals the `j`-th token that
follows, and the first that differs is the rejection that ends the trial. Each request's trials go
to the controller's acceptance estimate (`SpecController.observe_acceptance`), the same estimate a
verification updates, greedy and sampled alike, at lookup cost.

The pass runs when the controller asks for a prediction (a probe of speculation is due: every
16-256 steps), not every step, so it costs a lookup per request per probe interval; a trial
started at one pass is checked at the next against every token emitted in between (the tokens
are kept), so sparse passes give the same unbiased trials, only fewer.

Each pass also sums, over the requests that have a match now, the drafts the controller
would give them and the tokens those drafts are expected to add (`alpha + alpha**2 + ...`): the
controller's prediction of a speculative step (`SpecController.wants_step`'s `predict`), which
decides whether a timed probe is worth running. A prediction only gates probes: the bucket's mode
still changes only on measured, paired step costs.

With async scheduling the newest token of a request may still be a placeholder on the host: a
shadow draft then continues the newest known token (its first draft predicts the placeholder's
value), and is checked once the tokens are known.
"""

from __future__ import annotations

import weakref

from engine.scheduling.output import PLACEHOLDER_TOKEN_ID
from engine.spec_decode.adaptive import expected_accepted


class _Trial:
    __slots__ = ("start", "drafts", "checked")

    def __init__(self, start: int, drafts: list[int]) -> None:
        self.start, self.drafts, self.checked = start, drafts, 0   # drafts[i] predicts token_ids[start + i]


class ShadowDrafts:
    """One engine's shadow trials, one per request at a time (the state lives as long as the `Request`)."""

    def __init__(self, ngram, controller) -> None:
        self.ngram, self.controller = ngram, controller
        self._trials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def observe(self, requests, batch_size: int) -> tuple[int, float]:
        """Check each request's trial against the tokens it has emitted since, start a new trial
        where none is open, and return the predicted speculative step: (draft tokens, expected
        accepted tokens) over the requests with a match."""
        trials, controller, ngram = self._trials, self.controller, self.ngram
        max_drafts = controller.max_drafts
        cost = controller.bucket(batch_size).token_cost()
        num_drafts, expected = 0, 0.0
        for request in requests:
            tokens = request.token_ids
            known = len(tokens) - (tokens[-1] == PLACEHOLDER_TOKEN_ID)
            trial = trials.get(request)
            if trial is not None:
                drafts, i, stop = trial.drafts, trial.checked, min(len(trial.drafts), known - trial.start)
                while i < stop and tokens[trial.start + i] == drafts[i]:
                    i += 1
                if i < stop or i == len(drafts):        # a rejection, or every draft confirmed
                    controller.observe_acceptance(request, len(drafts), i)
                    trial = None
                    del trials[request]
                else:
                    trial.checked = i
            if trial is None:
                if request.sampling_params.structured is not None:
                    continue                             # never drafted (`SpecDecoder.propose`)
                drafts = ngram.propose_at(request, known, max_drafts)
                if not drafts:
                    continue
                trial = trials[request] = _Trial(known, drafts)
            left = len(trial.drafts) - trial.checked
            k, alpha = controller.justified_drafts(request, cost, left)
            num_drafts += k
            expected += expected_accepted(alpha, k)
        return num_drafts, expected

    def forget(self, request) -> None:
        """A request verified for real: its open trial would count the same tokens twice."""
        self._trials.pop(request, None)
