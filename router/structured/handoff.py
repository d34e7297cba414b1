"""The router's half of the P/D first-token handoff under a grammar (the pods' half is in
`engine/grammar/structured_outputs.py`; the contract in the i21 notes).

A prefill pod that constrained its first token says so with a grammar fingerprint; one that
did not (an older pod, a pod with the feature off) sends none, and then its token is not given
to the client: the decode pod's index 0 is waited for instead, which the decode pod samples under
its own grammar. A decode pod that refused the prefill pod's token (fingerprint mismatch, token
rejected) prefills locally and samples index 0 itself; with matching pods it is the same token
(sampling is positional), but if the client already has the prefill pod's token and it differs,
the request fails rather than continue from a first token the grammar never saw.
"""

from __future__ import annotations

from wire import cbserve_pb2 as pb
from router.errors import upstream_error


class FirstTokenHandoff:
    """One constrained sequence's first token, across its prefill and decode pods."""

    def __init__(self) -> None:
        self._given: int | None = None      # the prefill pod's first token, once given out

    def from_prefill(self, answer: pb.PrefillResponse) -> bool:
        """Give out P's first token? Only if P sampled it under the grammar."""
        if not answer.grammar_fingerprint:
            return False
        self._given = answer.first_token_id
        return True

    def check_decode(self, message: pb.GenerateResponse) -> None:
        """D's message: its index 0, if any, must be the token already given out."""
        if self._given is not None and message.index == 0 and message.token_ids \
                and message.token_ids[0] != self._given:
            raise upstream_error(f"the decode pod's first token ({message.token_ids[0]}) differs from the prefill "
                                 f"pod's ({self._given}) under the same grammar; the pods disagree on it",
                                 code="structured_output_handoff")
        self._given = None if message.index == 0 and message.token_ids else self._given
